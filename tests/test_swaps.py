"""Swapping a part is one line of the recipe: each swap builds the named component and trains a
step, or, for a part that ships separately, says how to get it."""

import copy
import math

import pytest
from rlkit_plugins.hf_generator import HFGenerator
from rlkit_plugins.kl import AdaptiveKL, FixedKL
from rlkit_plugins.rewards import PythonReward, RewardModel
from rlkit_plugins.vllm_generator import VLLMGeneratorConfig, missing_here

from rlkit_core.recipe.document import parse_recipe
from rlkit_core.runtime.cli import main
from rlkit_core.runtime.trainer import Trainer


def one_step(document, registry):
    document["run"]["steps"] = 1
    trainer = Trainer(parse_recipe(document, registry))
    metrics = trainer.step()
    assert math.isfinite(metrics["train/loss"]) and math.isfinite(metrics["score/mean"])
    return trainer


@pytest.mark.parametrize("kl_type, controller", [("fixed", FixedKL), ("adaptive", AdaptiveKL)])
def test_kl_controller_swaps(recipe_document, builtin_registry, kl_type, controller):
    recipe_document["kl"] = {"type": kl_type, "beta": 0.05}
    kl = one_step(recipe_document, builtin_registry).components.kl
    assert type(kl) is controller
    moved = kl.beta != 0.05
    assert moved is (kl_type == "adaptive")


def test_reward_swaps_from_python_function_to_reward_model(recipe_document, builtin_registry, tiny_reward_model):
    assert type(one_step(copy.deepcopy(recipe_document), builtin_registry).components.reward) is PythonReward
    recipe_document["reward"] = {"type": "reward-model", "model": str(tiny_reward_model), "batch_size": 8}
    assert type(one_step(recipe_document, builtin_registry).components.reward) is RewardModel


def test_generator_hf_trains_and_vllm_says_what_this_machine_lacks(recipe_document, builtin_registry, write_recipe, monkeypatch, capsys):
    assert type(one_step(copy.deepcopy(recipe_document), builtin_registry).components.generator) is HFGenerator
    recipe_document["generator"]["type"] = "vllm"
    monkeypatch.setenv("RLKIT_PLUGINS", "none")
    assert main(["check", write_recipe(recipe_document)]) == 0  # `rlkit check`, in this process
    out = capsys.readouterr().out
    assert "[generator] vllm" in out
    for lack in missing_here(VLLMGeneratorConfig(), "auto"):  # the recipe's run.device
        assert f"generator: the vLLM engine, which this machine cannot run: {lack}" in out
