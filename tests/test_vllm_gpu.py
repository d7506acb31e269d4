"""The vllm generator on a real vLLM engine against the hf generator, on the same small Llama.

Needs vLLM's CUDA build and a CUDA GPU; skipped otherwise, with the reason (`pytest -rs` prints it).
Run it with `benchmarks/gpu_check.sh` or `pytest -rs tests/test_vllm_gpu.py`. One engine serves the
module (vLLM does not hand its GPU memory back between engines in one process). It sleeps between
rollouts (sleep_level 1), so every push goes through the GPU-only wake order: the weights, the push,
then the KV cache. tests/test_vllm_cpu.py runs the rest on vLLM's CPU build, in CI.
"""

from __future__ import annotations

import pytest
import torch
from rlkit_plugins.hf_generator import HFGenerator, HFGeneratorConfig
from rlkit_plugins.hf_policy import HFPolicy, HFPolicyConfig
from rlkit_plugins.vllm_generator import VLLMGenerator, VLLMGeneratorConfig, missing_here

from rlkit_core.context import BuildContext
from rlkit_core.functional import logprobs_from_logits, masked_mean
from rlkit_core.prompts import encode_prompts
from rlkit_core.recipe.document import structure_table

MISSING = missing_here(VLLMGeneratorConfig(sleep_level=1), "cuda")
pytestmark = pytest.mark.skipif(bool(MISSING), reason="needs vLLM's CUDA build and a GPU: " + "; ".join(MISSING))

PROMPTS = ["the cat", "the cat", "a dog ran", "a dog ran", "x", "hello world"]
MAX_NEW = 16
# bf16 on both sides, different kernels: per-token gaps of a few hundredths are expected
MEAN_GAP = 0.05


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    from transformers import ByT5Tokenizer, LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=384, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=1, pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(path)
    ByT5Tokenizer().save_pretrained(path)
    settings, problems = structure_table({"model": str(path), "dtype": "bfloat16"}, HFPolicyConfig, "policy")
    assert not problems
    return HFPolicy(settings, _context(path))


def _context(path, policy=None):
    return BuildContext(recipe=None, device=torch.device("cuda"), output_dir=str(path), seed=0, policy=policy)


@pytest.fixture(scope="module")
def vllm_generator(policy, tmp_path_factory):
    config = VLLMGeneratorConfig(max_new_tokens=MAX_NEW, temperature=1.0, gpu_memory_fraction=0.2, max_model_len=128, sleep_level=1)
    return VLLMGenerator(config, _context(tmp_path_factory.mktemp("vllm"), policy))


def _prompts(policy):
    return encode_prompts(policy.tokenizer, [{"prompt": p} for p in PROMPTS], "cuda")


@torch.no_grad()
def _gap(policy, out, prompt_ids, prompt_mask) -> float:
    """Mean |log π(token) - sampler's log-prob| over the counted tokens, π recomputed by the trainer's path."""
    input_ids = torch.cat([prompt_ids, out.response_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, out.response_mask], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    logits = policy.forward(input_ids, attention_mask, position_ids).logits[:, prompt_ids.shape[1] - 1:-1]
    return float(masked_mean((logprobs_from_logits(logits, out.response_ids) - out.logprobs).abs(), out.response_mask))


def test_same_shapes_and_ends_as_the_hf_generator(policy, vllm_generator):
    prompt_ids, prompt_mask = _prompts(policy)
    vllm_generator.sync_weights(policy)
    ours = vllm_generator.generate(prompt_ids, prompt_mask)
    hf = HFGenerator(HFGeneratorConfig(max_new_tokens=MAX_NEW, temperature=1.0), _context(".", policy)).generate(prompt_ids, prompt_mask)
    for out in (ours, hf):
        assert out.response_ids.shape[0] == len(PROMPTS) and out.response_ids.shape[1] <= MAX_NEW
        assert out.response_ids.shape == out.response_mask.shape == out.logprobs.shape
        assert out.response_ids.device.type == "cuda"
    ended = torch.isin(ours.response_ids, torch.tensor(policy.eos_token_ids, device="cuda")).any(dim=1)
    lengths = ours.response_mask.sum(dim=1)
    assert bool(((lengths == MAX_NEW) | ended).all()), "a response shorter than max_new_tokens must end on an EOS"


def test_sampled_logprobs_match_the_trainers_recomputation(policy, vllm_generator):
    prompt_ids, prompt_mask = _prompts(policy)
    vllm_generator.sync_weights(policy)
    gap = _gap(policy, vllm_generator.generate(prompt_ids, prompt_mask), prompt_ids, prompt_mask)
    print(f"vLLM vs trainer mean log-prob gap: {gap:.4f}")
    assert gap < MEAN_GAP


def lm_head(model) -> float:
    return float(model.lm_head.weight.float().abs().sum())


def test_a_push_visibly_changes_the_engine_and_the_prefix_cache_is_reset(policy, vllm_generator):
    """The same prompts before and after a push: a stale prefix cache would keep the old weights'
    keys and values for them, and the samples would not match the new policy."""
    prompt_ids, prompt_mask = _prompts(policy)
    vllm_generator.sync_weights(policy)
    vllm_generator.generate(prompt_ids, prompt_mask)  # fills the prefix cache
    before = vllm_generator.engine.llm.apply_model(lm_head)[0]
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    vllm_generator.sync_weights(policy)
    after = vllm_generator.engine.llm.apply_model(lm_head)[0]
    assert after != pytest.approx(before) and after == pytest.approx(lm_head(policy.model), rel=1e-2)
    out = vllm_generator.generate(prompt_ids, prompt_mask)
    assert _gap(policy, out, prompt_ids, prompt_mask) < MEAN_GAP
    assert vllm_generator.pop_metrics()["time/weight_sync"] > 0


def test_greedy_repeated_prompts_and_the_pad_never_drawn(policy, vllm_generator):
    """Greedy repeats go one request each (vLLM refuses n > 1 at temperature 0); the suppressed ids'
    -inf logit bias holds on Model Runner V2 (the GPU default), where allowed_token_ids is capped."""
    prompt_ids, prompt_mask = _prompts(policy)
    vllm_generator.sync_weights(policy)
    greedy = vllm_generator.generate(prompt_ids, prompt_mask, greedy=True)
    assert torch.equal(greedy.response_ids[0], greedy.response_ids[1])  # "the cat" twice
    sampled = vllm_generator.generate(prompt_ids, prompt_mask)
    for suppressed in policy.suppressed_token_ids:
        assert suppressed not in sampled.response_ids[sampled.response_mask.bool()].tolist()
