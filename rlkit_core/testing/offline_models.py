"""Tiny real tokenizers and models with the awkward properties of hub models, built offline.

The byte-level ByT5 tokenizer is kind: PAD ≠ EOS, one EOS, no chat template (style `"byt5"`, the
toy most tests use). Real policies are not, so tests (and plugin authors' tests) also build these,
in about a second each:

- `"gpt2"`: a byte-level BPE with no PAD token, where BOS = EOS = UNK = `<|endoftext|>` (GPT-2,
  Pythia), and a GPT-2 model whose embedding table has no spare row;
- `"chat"`: a Llama-3-style BPE whose tokenizer EOS is `<|end_of_text|>` while the model's
  generation config also stops on `<|eot_id|>`, with a chat template and no PAD, and a Llama model
  with a few spare embedding rows (as Pythia and Qwen have);
- `"chatml"`: a Qwen-style BPE with EOS `<|im_end|>`, PAD `<|endoftext|>`, no BOS, the tool and
  reasoning tags as added (non-special) tokens, and a Qwen3-like template that is not append-only:
  it puts a newline after each `<|im_end|>` (which a generation stops before), renders tools and
  tool calls, and strips the `<think>` blocks of assistant turns before the last user message; a
  Llama model with spare rows whose generation config stops on `<|im_end|>` and `<|endoftext|>`.

For measuring, `write_qwen_model` builds a random Qwen2 of a real size (Qwen2.5-0.5B's shape) with
`build_wide_chatml_tokenizer`: the "chatml" specials and template over a vocabulary as wide as the
model's, so that the LM head costs what the real one does and every id a random model samples decodes.

The BPE is trained with the `tokenizers` library (a transformers dependency) on a fixed text, so
the same style always gives the same vocabulary.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "summarise the document: the pilot cooked boxes in berlin.",
    "hello world, how are you today? fine, thanks, and you?",
    "User: write a happy sentence. Assistant: what a lovely day it is!",
    "abcdefg hijklmn opqrstu vwxyz 0123456789",
]

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

# Qwen3-like: tools in the system turn, tool calls after an assistant's content, tool results in a
# user turn, and earlier turns' reasoning dropped once a newer user message follows them.
CHATML_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\n' }}"
    "{%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}"
    "{{- '# Tools\n\nThese functions can be called; their JSON schemas are inside <tools></tools>:\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\n</tools>\n\nTo call one, write its name and arguments as a JSON object inside <tool_call></tool_call> tags:\n"
    "<tool_call>\n{\"name\": <function name>, \"arguments\": <arguments object>}\n</tool_call><|im_end|>\n' }}"
    "{%- elif messages and messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{%- if not loop.first %}{{- '<|im_start|>system\n' + message.content + '<|im_end|>\n' }}{%- endif %}"
    "{%- elif message.role == 'user' %}{{- '<|im_start|>user\n' + message.content + '<|im_end|>\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set content = message.content or '' %}"
    "{%- if loop.index0 < ns.last_user and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') %}{%- endif %}"
    "{{- '<|im_start|>assistant\n' + content }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{%- if content or not loop.first %}{{- '\n' }}{%- endif %}"
    "{{- '<tool_call>\n{\"name\": \"' + fn.name + '\", \"arguments\": ' }}"
    "{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}"
    "{{- '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
# added as plain (non-special) tokens, as Qwen does: decoding with skip_special_tokens keeps them
CHATML_TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

STYLES = {
    # style: (special tokens, tokenizer keyword arguments)
    "gpt2": (["<|endoftext|>"], {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}),
    "chat": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
             {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "chat_template": CHAT_TEMPLATE}),
    "chatml": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
               {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML_TEMPLATE}),
}


def build_bpe_tokenizer(style: str, vocab_size: int = 320):
    """A transformers fast tokenizer of `style` ("gpt2", "chat" or "chatml"), trained here on `CORPUS`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials, names = STYLES[style]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS * 20, trainer)
    if style == "chat":  # like Llama 3: BOS in front of plain text, none appended
        bos = backend.token_to_id("<|begin_of_text|>")
        backend.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B", special_tokens=[("<|begin_of_text|>", bos)])
    if style == "chatml":
        backend.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in CHATML_TAGS])
    return PreTrainedTokenizerFast(tokenizer_object=backend, **names)


def write_tiny_model(path: Path, style: str = "byt5", classifier: bool = False, spare_rows: int | None = None,
                     seed: int | None = None) -> Path:
    """A tiny model directory with its tokenizer, the one builder behind every test model.

    `style`: "byt5" (a GPT-2 with the file-free byte-level ByT5 tokenizer, the kind toy), or
    "gpt2"/"chat"/"chatml" (see the module docstring). Two layers as a causal LM; as a `classifier`, one
    layer with one output (a reward model, or a separate critic's starting point) and a vocabulary
    that is exactly the tokenizer's. `spare_rows`: a causal LM's embedding rows past the tokenizer's
    vocabulary (default: 6 for "chat" and "chatml", none otherwise). `seed`: default 0 for a causal LM, 1 for a
    classifier, so that a reward model is not the policy's twin."""
    from transformers import (
        ByT5Tokenizer,
        GPT2Config,
        GPT2ForSequenceClassification,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        LlamaForSequenceClassification,
    )

    tokenizer = ByT5Tokenizer() if style == "byt5" else build_bpe_tokenizer(style)
    eos, bos, pad = tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id
    ids: dict[str, Any]  # the config's special ids (and the classifier's label count)
    if classifier:
        vocab, layers = len(tokenizer), 1
        ids = {"num_labels": 1, "pad_token_id": eos if pad is None else pad, "eos_token_id": eos}
    else:
        spare = (6 if style in ("chat", "chatml") else 0) if spare_rows is None else spare_rows
        vocab, layers = len(tokenizer) + spare, 2
        ids = {"bos_token_id": eos if bos is None else bos, "eos_token_id": eos}
        if pad is not None:
            ids["pad_token_id"] = pad
    torch.manual_seed((1 if classifier else 0) if seed is None else seed)
    if style in ("chat", "chatml"):
        config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                             num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256, **ids)
        model = (LlamaForSequenceClassification if classifier else LlamaForCausalLM)(config)
    else:
        config = GPT2Config(vocab_size=vocab, n_positions=128 if style == "byt5" else 256, n_embd=32, n_layer=layers,
                            n_head=2, **ids)
        model = (GPT2ForSequenceClassification if classifier else GPT2LMHeadModel)(config)
    if style == "chat" and not classifier:
        model.generation_config.eos_token_id = [eos, tokenizer.convert_tokens_to_ids("<|eot_id|>")]
    if style == "chatml" and not classifier:  # as Qwen's: the end of a turn, or of a text
        model.generation_config.eos_token_id = [eos, pad]
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return Path(path)



# Qwen2.5-0.5B's shape (494 M parameters with its 151,936-row tied embedding), and a tiny one for CPUs
QWEN_SIZES: dict[str, dict[str, Any]] = {
    "0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2, "max_position_embeddings": 32768, "rope_theta": 1000000.0, "vocab_size": 151936},
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "max_position_embeddings": 1024, "rope_theta": 1000000.0, "vocab_size": 512},
}


def build_wide_chatml_tokenizer(vocab_size: int = 151936):
    """The "chatml" style's specials, tags and template over `vocab_size` ids: the 256 byte-level symbols (text
    encodes one token a byte, no merges), the specials and tags, then fillers `w<id>` that only sampling produces."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials, names = STYLES["chatml"]
    vocab = {symbol: i for i, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for token in specials + CHATML_TAGS:
        vocab[token] = len(vocab)
    if vocab_size < len(vocab):
        raise ValueError(f"vocab_size {vocab_size}: at least {len(vocab)} (the bytes, specials and tags)")
    vocab.update({f"w{i}": i for i in range(len(vocab), vocab_size)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials])
    backend.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in CHATML_TAGS])
    return PreTrainedTokenizerFast(tokenizer_object=backend, **names)


def write_qwen_model(path: Path, size: str = "tiny", device: str = "cpu", dtype: torch.dtype = torch.bfloat16,
                     seed: int = 0, mean_length: float = 0.0) -> Path:
    """A random-initialised Qwen2 of `size` (`QWEN_SIZES`) with its wide ChatML tokenizer, saved in `dtype`;
    built on `device` (a GPU initialises 0.5 B weights in a moment), stopping on `<|im_end|>` and `<|endoftext|>`.
    `mean_length`: sampling ends a response or turn after about that many tokens (`lift_end`); 0: almost never."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = QWEN_SIZES[size]
    tokenizer = build_wide_chatml_tokenizer(shape["vocab_size"])
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    assert isinstance(eos, int) and isinstance(pad, int)
    config = Qwen2Config(**shape, tie_word_embeddings=True, rms_norm_eps=1e-6, bos_token_id=pad, eos_token_id=eos,
                         pad_token_id=pad)
    torch.manual_seed(seed)
    with torch.device(device):
        model: Any = Qwen2ForCausalLM(config)
        if mean_length:
            lift_end(model, eos, mean_length)
    model.to(dtype)
    model.generation_config.eos_token_id = [eos, pad]
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return Path(path)


@torch.no_grad()
def lift_end(model, end: int, mean_length: float, branch_scale: float = 0.01, after_marker: float = 0.9) -> None:
    """Make a random Qwen/Llama-style model (tied embedding, RMSNorm: no bias to lift a logit with, as GPT-2's has)
    end a response after about `mean_length` tokens, geometrically. A deep random model's hidden states follow the
    context, not the token (a lift along one direction ends some sequences at once and others never), so the
    blocks' output projections are scaled by `branch_scale`, which leaves each final hidden state mostly its own
    token's embedding, and the final norm's weights get random signs, so that (the embedding being tied) a token
    does not predict itself. Every k-th id is a marker, a 1 in the embedding's first dimension (the end token: 4):
    after a marker the first dimension of the normed hidden state is H (set through its norm weight), which lifts
    the end token's logit by 4·H and each marker's by H, so that p(end) = `after_marker`; after other ids, by
    nothing much. Ids are sampled about uniformly, so a response ends after about k / `after_marker` tokens; a
    sampler that forbids the end token (`min_new_tokens`) differs from the model by −log(1 − after_marker) there."""
    for name, module in model.named_modules():
        if name.endswith(("o_proj", "down_proj")):
            module.weight.mul_(branch_scale)
    norm = model.base_model.norm.weight
    signs = torch.randint(2, norm.shape, generator=torch.Generator().manual_seed(0)).to(norm) * 2 - 1
    norm.copy_(signs)
    norm[0] = 1.0
    weight = model.get_input_embeddings().weight
    vocab, every = weight.shape[0], max(1, round(after_marker * (mean_length - 1)))
    markers = torch.arange(1, vocab, every, device=weight.device)
    markers = markers[markers != end]
    weight[markers, 0] = 1.0
    weight[end, 0] = 4.0
    first = float(model.base_model(input_ids=markers[None, :256]).last_hidden_state[..., 0].float().mean())

    def p_end(lift: float) -> float:  # the end token's logit 4·lift, the markers' lift, the rest about 0
        return 1 / (1 + (len(markers) * math.exp(-3 * lift) + (vocab - len(markers) - 1) * math.exp(-4 * lift)))

    low, high = 0.0, 64.0
    for _ in range(60):
        low, high = ((low + high) / 2, high) if p_end((low + high) / 2) < after_marker else (low, (low + high) / 2)
    norm[0] = low / first
