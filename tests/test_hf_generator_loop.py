"""The `hf` generator's own decoding loop: the same responses, log-probs and random draws as
transformers' `generate` (the path it replaced), with finished rows dropped from every later step,
on the byte-level toy and on real-style tokenizers (a pad-less GPT-2-style BPE that gets an added,
suppressed PAD; a Llama-style chat model with two end ids)."""

from __future__ import annotations

import pytest
import torch
from rlkit_plugins.hf_generator import HFGenerator, HFGeneratorConfig, prefill_groups, without_padding_columns
from rlkit_plugins.hf_policy import HFPolicy, HFPolicyConfig

from rlkit_core.batch import sequence_inputs
from rlkit_core.context import BuildContext
from rlkit_core.functional import logprobs_from_logits, response_mask
from rlkit_core.testing.offline_models import write_tiny_model

STYLES = ("byt5", "gpt2", "chat")
COUNTDOWN = list(range(100, 110))  # a script: COUNTDOWN[k] -> COUNTDOWN[k - 1], COUNTDOWN[0] -> an end id
FOREVER, ENDS_NOW = 120, 130  # FOREVER -> FOREVER (runs to the limit); ENDS_NOW -> the first end id


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {style: write_tiny_model(tmp_path_factory.mktemp(f"loop-{style}"), style) for style in STYLES}


def make_policy(models, style, **config):
    return HFPolicy(HFPolicyConfig(model=str(models[style]), **config))


def make_generator(policy, **config):
    context = BuildContext(recipe=None, device=torch.device("cpu"), output_dir="", seed=0, policy=policy)
    return HFGenerator(HFGeneratorConfig(**config), context)


def base_model(policy):
    model = policy.model
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def follow_script(policy, lift: float = 10.0):
    """A real model whose next token is mostly scripted: after token t, the logit of script[t] is
    raised by `lift` (the model's own logits stay underneath, so log-probs are not trivial). The
    hooks sit on the embedding and output layers, which peft's wrapper also calls as modules."""
    model = base_model(policy)
    script = torch.full((model.get_output_embeddings().weight.shape[0],), -1)
    script[COUNTDOWN[1:]] = torch.tensor(COUNTDOWN[:-1])
    script[COUNTDOWN[0]] = policy.eos_token_ids[-1]  # the chat model's second end id
    script[FOREVER], script[ENDS_NOW] = FOREVER, policy.eos_token_ids[0]
    fed = {}

    def remember(module, args):
        fed["ids"] = args[0]

    def steer(module, inputs, logits):
        targets = script[fed["ids"][:, -logits.shape[1]:]]
        rows, columns = (targets >= 0).nonzero(as_tuple=True)
        logits[rows, columns, targets[rows, columns]] += lift

    model.get_input_embeddings().register_forward_pre_hook(remember)
    model.get_output_embeddings().register_forward_hook(steer)
    return fed


def lift_logits(policy, ids, lift: float):
    """The output layer adds `lift` to the logits of `ids` at every position (in `generate`, in the
    loop and in a forward pass alike)."""
    def hook(module, inputs, output):
        output[..., list(ids)] += lift
        return output

    return base_model(policy).get_output_embeddings().register_forward_hook(hook)


def left_padded(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def scripted_prompts(pad: int, lengths: list[int], last: list[int]):
    """Prompts of `lengths` tokens (filler ids 50, 51, ...) that end on the scripted tokens `last`."""
    return left_padded([[50 + i for i in range(n - 1)] + [t] for n, t in zip(lengths, last)], pad)


def generated_by_transformers(policy, prompt_ids, prompt_mask, greedy, max_new_tokens, temperature=1.0, top_k=0, top_p=1.0,
                              min_new_tokens=0):
    """The replaced path: `model.generate` with rlkit's whole generation config swapped in, its
    scores' log-softmax as the log-probs, PAD after the first end id."""
    from transformers import GenerationConfig

    tokenizer = policy.tokenizer
    common = dict(max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens or None, eos_token_id=list(policy.eos_token_ids),
                  pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                  suppress_tokens=list(policy.suppressed_token_ids) or None, return_dict_in_generate=True, output_scores=True)
    config = (GenerationConfig(do_sample=False, **common) if greedy
              else GenerationConfig(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p, **common))
    base = base_model(policy)
    saved, base.generation_config = base.generation_config, config
    ids, mask = without_padding_columns(prompt_ids, prompt_mask)
    try:
        with torch.no_grad():
            out = policy.model.generate(input_ids=ids, attention_mask=mask)
    finally:
        base.generation_config = saved
    response = out.sequences[:, ids.shape[1]:]
    ended = response_mask(response, policy.eos_token_ids)
    logprobs = torch.log_softmax(torch.stack(out.scores, dim=1), dim=-1).gather(-1, response[..., None]).squeeze(-1)
    pad = tokenizer.pad_token_id
    return response * ended + pad * (1 - ended), ended, torch.where(ended.bool(), logprobs, 0.0)


def assert_padded_after_the_end(out, policy):
    ends, pad = set(policy.eos_token_ids), policy.tokenizer.pad_token_id
    for ids, mask in zip(out.response_ids.tolist(), out.response_mask.tolist()):
        length = next((i + 1 for i, t in enumerate(ids) if t in ends), len(ids))
        assert mask == [1] * length + [0] * (len(ids) - length)
        assert ids[length:] == [pad] * (len(ids) - length)


# --- the same as generate ---------------------------------------------------------------------


@pytest.mark.parametrize("style", STYLES)
def test_greedy_equals_generate_on_ragged_prompts_that_end_at_different_steps(models, style):
    policy = make_policy(models, style)
    follow_script(policy)
    pad = policy.tokenizer.pad_token_id
    prompt_ids, prompt_mask = scripted_prompts(pad, [3, 1, 6, 2, 4], [COUNTDOWN[1], COUNTDOWN[4], FOREVER, ENDS_NOW, COUNTDOWN[2]])
    out = make_generator(policy, max_new_tokens=8).generate(prompt_ids, prompt_mask, greedy=True)
    ids, mask, logprobs = generated_by_transformers(policy, prompt_ids, prompt_mask, True, 8)
    assert out.response_mask.sum(dim=1).tolist() == [2, 5, 8, 1, 3]  # ends at steps 2, 5, the limit, 1, 3
    assert out.response_ids[:, -1].tolist()[:2] == [pad, pad] and out.response_ids[1, 4] == policy.eos_token_ids[-1]
    assert torch.equal(out.response_ids, ids) and torch.equal(out.response_mask, mask)
    assert torch.allclose(out.logprobs, logprobs, atol=1e-5)
    assert_padded_after_the_end(out, policy)


def test_greedy_equals_generate_in_chunks_and_with_lora_and_keeps_training_mode(models):
    policy = make_policy(models, "byt5", lora_r=2, lora_alpha=4)
    follow_script(policy)
    policy.model.train()
    prompt_ids, prompt_mask = scripted_prompts(policy.tokenizer.pad_token_id, [3, 1, 6, 2, 4],
                                               [COUNTDOWN[1], COUNTDOWN[4], FOREVER, ENDS_NOW, COUNTDOWN[2]])
    chunked = make_generator(policy, max_new_tokens=8, batch_size=2).generate(prompt_ids, prompt_mask, greedy=True)
    assert policy.model.training
    policy.model.eval()
    ids, mask, logprobs = generated_by_transformers(policy, prompt_ids, prompt_mask, True, 8)
    assert torch.equal(chunked.response_ids, ids) and torch.equal(chunked.response_mask, mask)
    assert torch.allclose(chunked.logprobs, logprobs, atol=1e-5)


SAMPLING = [
    {"temperature": 0.7},
    {"temperature": 1.3, "top_k": 20, "min_new_tokens": 3},
    {"temperature": 1.0, "top_p": 0.9},
]


@pytest.mark.parametrize("sampling", SAMPLING, ids=["temperature", "top-k-min-new", "top-p"])
@pytest.mark.parametrize("style", STYLES)
def test_sampling_draws_what_generate_drew_with_the_same_seed(models, style, sampling):
    """generate's multinomial draws for every row, finished ones too; the loop draws the same
    numbers, so the same seed gives the same tokens and leaves the generator where generate did."""
    policy = make_policy(models, style)
    lift_logits(policy, policy.eos_token_ids, 2.0)  # responses end after a few tokens, at different steps
    texts = ["hello there", "a", "the quick brown fox jumps over", "xy z", "how are you today", "fine"]
    encoded = policy.tokenizer(texts, return_tensors="pt", padding=True)
    prompt_ids, prompt_mask = encoded["input_ids"], encoded["attention_mask"]
    torch.manual_seed(3)
    out = make_generator(policy, max_new_tokens=20, **sampling).generate(prompt_ids, prompt_mask)
    after_loop = torch.rand(4)
    torch.manual_seed(3)
    ids, mask, logprobs = generated_by_transformers(policy, prompt_ids, prompt_mask, False, 20, **sampling)
    after_generate = torch.rand(4)
    lengths = out.response_mask.sum(dim=1)
    assert len(set(lengths.tolist())) > 2 and lengths.min() < out.response_ids.shape[1]  # ragged ends
    assert torch.equal(out.response_ids, ids) and torch.equal(out.response_mask, mask)
    assert torch.allclose(out.logprobs, logprobs, atol=1e-5)
    assert torch.equal(after_loop, after_generate)


# --- what sampling keeps --------------------------------------------------------------------


def recomputed_logits(policy, prompt_ids, prompt_mask, out):
    with torch.no_grad():
        return policy.forward(*sequence_inputs(prompt_ids, prompt_mask, out.response_ids, out.response_mask)).logits[:, prompt_ids.shape[1] - 1:-1]


def test_sampled_logprobs_are_the_policys_at_the_temperature_and_pad_is_never_drawn(models):
    policy = make_policy(models, "gpt2")  # pad-less: rlkit's added PAD is suppressed
    pad = policy.tokenizer.pad_token_id
    assert policy.suppressed_token_ids == (pad,)
    lift_logits(policy, policy.eos_token_ids, 2.5)
    lift_logits(policy, [pad], 30.0)  # the likeliest token by far, were it not suppressed
    encoded = policy.tokenizer(["hello there", "a", "the quick brown fox", "xy z"] * 4, return_tensors="pt", padding=True)
    prompt_ids, prompt_mask = encoded["input_ids"], encoded["attention_mask"]
    torch.manual_seed(0)
    out = make_generator(policy, max_new_tokens=24, temperature=1.5).generate(prompt_ids, prompt_mask)
    counted = out.response_mask.bool()
    assert counted.sum() > 40 and (out.response_mask.sum(dim=1) < out.response_ids.shape[1]).any()
    assert not (out.response_ids[counted] == pad).any()
    recomputed = logprobs_from_logits(recomputed_logits(policy, prompt_ids, prompt_mask, out), out.response_ids, 1.5, (pad,))
    assert (recomputed - out.logprobs)[counted].abs().max() < 1e-5
    assert (out.logprobs[~counted] == 0).all()
    assert_padded_after_the_end(out, policy)


def test_min_new_tokens_holds_back_every_end_id(models):
    policy = make_policy(models, "chat")
    lift_logits(policy, policy.eos_token_ids, 50.0)  # without min_new_tokens every response ends at once
    encoded = policy.tokenizer(["hello there", "a", "the quick brown fox"], return_tensors="pt", padding=True)
    out = make_generator(policy, max_new_tokens=10, min_new_tokens=4).generate(encoded["input_ids"], encoded["attention_mask"])
    assert out.response_mask.sum(dim=1).tolist() == [5, 5, 5]
    assert not torch.isin(out.response_ids[:, :4], torch.tensor(policy.eos_token_ids)).any()


def test_top_k_samples_only_among_the_k_likeliest(models):
    policy = make_policy(models, "byt5")
    encoded = policy.tokenizer(["hello there", "a", "the quick brown fox", "xy z"] * 4, return_tensors="pt", padding=True)
    prompt_ids, prompt_mask = encoded["input_ids"], encoded["attention_mask"]
    torch.manual_seed(0)
    out = make_generator(policy, max_new_tokens=16, temperature=2.0, top_k=3).generate(prompt_ids, prompt_mask)
    counted = out.response_mask.bool()
    top3 = recomputed_logits(policy, prompt_ids, prompt_mask, out).topk(3, dim=-1).indices
    assert counted.sum() > 100
    assert (top3 == out.response_ids[..., None]).any(dim=-1)[counted].all()


# --- the work it does ------------------------------------------------------------------------


def test_prefill_groups_keep_padding_under_a_tenth():
    # [10, 10, 9]: 29 real of 30; adding 5 would make 34 of 40 (15% padding): a new group; [5, 4]: 9 of 10
    assert prefill_groups([10, 10, 9, 5, 4, 1]) == [3, 2, 1]
    assert prefill_groups([7]) == [1] and prefill_groups([4, 4, 4]) == [3]


def test_finished_rows_leave_the_computation_and_the_counter_counts_what_ran(models):
    policy = make_policy(models, "byt5")
    follow_script(policy)
    shapes = []  # of the token ids fed to each forward pass
    base_model(policy).get_input_embeddings().register_forward_pre_hook(lambda module, args: shapes.append(tuple(args[0].shape)))
    # rows of 10, 9 and 3 prompt tokens whose responses end at steps 2, 5 and 5
    prompt_ids, prompt_mask = scripted_prompts(policy.tokenizer.pad_token_id, [10, 9, 3], [COUNTDOWN[1], COUNTDOWN[4], COUNTDOWN[4]])
    generator = make_generator(policy, max_new_tokens=8)
    out = generator.generate(prompt_ids, prompt_mask, greedy=True)
    assert out.response_mask.sum(dim=1).tolist() == [2, 5, 5]
    # prefill: the rows of 10 and 9 tokens together (19 real of 20), the row of 3 alone; then the
    # steps that produce tokens 2..5: 3 rows, then 2, 2, 2 (the first row ended at token 2)
    assert shapes == [(2, 10), (1, 3), (3, 1), (2, 1), (2, 1), (2, 1)]
    computed, real = generator.positions
    assert computed == 2 * 10 + 1 * 3 + (3 + 2 + 2 + 2) == 32
    assert int(real) == (10 + 9 + 3) + (3 + 2 + 2 + 2) == 31
    assert computed < 3 * (10 + 5 - 1)  # generate: every row, full width, at every step
    generator.generate(prompt_ids, prompt_mask, greedy=True)
    assert generator.positions[0] == 64 and int(generator.positions[1]) == 62  # summed over calls
