"""What only a CUDA GPU shows: bfloat16 kernels on both sides of the log-prob check, and episodes whose turns end
while the `hf` generator keeps their KV caches on the GPU (the first GPU run found a turn's end indexing a CPU
tensor with a GPU one). Marked `gpu` and skipped without CUDA; benchmarks/gpu_run.py runs them (`pytest -m gpu`)."""

from __future__ import annotations

import pytest
import torch
from rlkit_plugins.hf_generator import HFGenerator, HFGeneratorConfig
from rlkit_plugins.hf_policy import HFPolicy, HFPolicyConfig

from rlkit_core.context import BuildContext
from rlkit_core.functional import logprobs_from_logits, masked_mean
from rlkit_core.prompts import encode_prompts
from rlkit_core.recipe.document import structure_table
from rlkit_core.testing.offline_models import write_qwen_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = ["the cat", "a dog ran", "x", "hello world, how are you today?"]
# bf16 weights; the sampler's loop (with a KV cache) and the trainer's full pass round differently
MEAN_GAP = 0.05


def _context(path, policy=None):
    return BuildContext(recipe=None, device=torch.device("cuda"), output_dir=str(path), seed=0, policy=policy)


def test_bf16_sampler_and_trainer_agree_on_the_gpu(tmp_path):
    model = write_qwen_model(tmp_path / "qwen", "tiny", device="cuda")
    settings, problems = structure_table({"model": str(model), "dtype": "bfloat16"}, HFPolicyConfig, "policy")
    assert not problems
    policy = HFPolicy(settings, _context(tmp_path))
    generator = HFGenerator(HFGeneratorConfig(max_new_tokens=16, temperature=1.0), _context(tmp_path, policy))
    prompt_ids, prompt_mask = encode_prompts(policy.tokenizer, [{"prompt": p} for p in PROMPTS], "cuda")
    out = generator.generate(prompt_ids, prompt_mask)
    assert out.response_ids.device.type == out.logprobs.device.type == "cuda"
    with torch.no_grad():
        input_ids = torch.cat([prompt_ids, out.response_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, out.response_mask], dim=1)
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        logits = policy.forward(input_ids, attention_mask, position_ids).logits[:, prompt_ids.shape[1] - 1:-1]
        gaps = (logprobs_from_logits(logits, out.response_ids) - out.logprobs).abs()
        gap = float(masked_mean(gaps, out.response_mask))
    assert gap < MEAN_GAP


@pytest.mark.parametrize("variant", ["full", "lora-checkpointing"])
def test_episodes_end_turns_with_kept_caches_on_the_gpu(variant, recipe_document, builtin_registry, tmp_path):
    from tests.test_episodes import ending_model, episode_document
    from tests.test_trainer import make_trainer

    document = episode_document(recipe_document, ending_model(tmp_path / "ending"))
    document["run"]["device"] = "cuda"
    document["policy"]["dtype"] = "bfloat16"
    if variant == "lora-checkpointing":
        document["policy"].update(lora_r=4, gradient_checkpointing=True)
    trainer = make_trainer(document, builtin_registry)
    metrics = trainer.step()
    assert metrics["env/turns"] > 2, "the ending model should reach later turns"
    assert metrics.get("generate/kept_prefix", 0.0) > 0, "later turns should start from the kept KV caches"
    assert all(torch.isfinite(torch.tensor(float(v))) for k, v in metrics.items() if k.startswith("loss/"))
