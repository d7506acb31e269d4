"""The transformers-backed parts in the configurations a user reaches for: LoRA (reference = the
base with adapters off, no second copy), a separate critic, and LoRA export."""

import torch

from rlkit_core.recipe.document import parse_recipe
from rlkit_core.runtime.trainer import Trainer
from tests.test_trainer import advantages_with, rollout_with, update_with


def lora_trainer(recipe_document, registry):
    recipe_document["policy"].update(lora_r=4, lora_alpha=8, lora_target_modules=["c_attn"])
    recipe_document["optim"]["learning_rate"] = 1e-2
    return Trainer(parse_recipe(recipe_document, registry))


def test_lora_trains_only_adapters_and_the_reference_is_the_base(recipe_document, builtin_registry):
    trainer = lora_trainer(recipe_document, builtin_registry)
    policy = trainer.components.policy
    assert policy._reference is None  # no frozen copy: the base with adapters disabled serves
    names = [name for name, p in policy.model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in name for name in names)

    batch = advantages_with(trainer, rollout_with(trainer, trainer.stream.batch(0))[0])
    sequence = batch.sequence()
    reference_before = policy.reference_logits(*sequence)
    update_with(trainer, batch)
    with torch.no_grad():
        policy_after = policy.forward(*sequence).logits
    assert torch.equal(policy.reference_logits(*sequence), reference_before)  # the base never moves
    assert not torch.allclose(policy_after, reference_before)  # the adapters did


def test_lora_export_merges_when_asked(recipe_document, builtin_registry, tmp_path):
    from transformers import AutoModelForCausalLM

    from rlkit_core.runtime import checkpoint
    from rlkit_core.runtime.export import export_checkpoint
    from rlkit_core.runtime.run import run_recipe

    recipe_document["policy"].update(lora_r=4, lora_alpha=8, lora_target_modules=["c_attn"])
    recipe_document["run"]["steps"] = 1
    run_recipe(parse_recipe(recipe_document, builtin_registry), quiet=True)
    source = checkpoint.resolve("auto", recipe_document["run"]["output_dir"])
    merged = export_checkpoint(str(source), str(tmp_path / "merged"), builtin_registry, merge_lora=True)
    model = AutoModelForCausalLM.from_pretrained(merged)
    assert not any("lora_" in name for name, _ in model.named_parameters())
    adapters = export_checkpoint(str(source), str(tmp_path / "adapters"), builtin_registry, merge_lora=False)
    assert (adapters / "adapter_config.json").is_file()


def test_separate_critic_has_its_own_model(recipe_document, builtin_registry, tiny_reward_model):
    recipe_document["value_head"] = {"type": "separate", "model": str(tiny_reward_model)}
    trainer = Trainer(parse_recipe(recipe_document, builtin_registry))
    batch = advantages_with(trainer, rollout_with(trainer, trainer.stream.batch(0))[0])
    assert torch.count_nonzero(batch.values) == 0  # zero-initialised head: values start at 0
    metrics = update_with(trainer, batch)
    assert metrics["train/value_loss"] > 0
    after = advantages_with(trainer, rollout_with(trainer, trainer.stream.batch(1))[0])
    assert torch.count_nonzero(after.values) > 0  # the critic learned something


def test_the_hf_policy_declares_its_context_and_its_fsdp_units(tiny_model):
    """What the trainer, vLLM and FSDP read through the Policy interface, not the model's config."""
    from rlkit_plugins.hf_policy import HFPolicy, HFPolicyConfig
    from transformers import AutoConfig

    policy = HFPolicy(HFPolicyConfig(model=str(tiny_model)))
    assert policy.context_length == AutoConfig.from_pretrained(tiny_model).n_positions
    assert [unit.__name__ for unit in policy.shard_units()] == ["GPT2Block"]


def test_a_configs_context_length_under_any_of_its_names():
    import types

    from rlkit_core.hf import context_length

    assert context_length(types.SimpleNamespace(n_positions=1024)) == 1024
    assert context_length(types.SimpleNamespace(seq_length=2048, max_position_embeddings=None)) == 2048
    assert context_length(types.SimpleNamespace(max_sequence_length=512)) == 512
    assert context_length(types.SimpleNamespace(hidden_size=64)) is None


def test_a_policy_without_a_context_or_units_declares_none():
    from rlkit_core import Policy

    assert Policy.context_length is None and Policy.shard_units(object()) == []


def test_fsdp_wraps_the_units_the_policy_declares():
    """accelerate finds the classes to shard by name on the module it prepares."""
    import types

    from rlkit_core.runtime.distributed import TrainableModules

    class Block(torch.nn.Module):
        pass

    policy = types.SimpleNamespace(model=torch.nn.Sequential(Block()), shard_units=lambda: [Block])
    assert TrainableModules(policy, None)._no_split_modules == ["Block"]
