"""Every weight push verified (rlkit_core.runtime.push_check): the rules on hand-made numbers, then
whole runs through the vllm generator's engine seam, with a stand-in engine that learns the
policy's weights only through pushes and, in the failing cases, ignores them on purpose."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rlkit_plugins.vllm_generator import VLLMGenerator
from test_vllm_generator import StandInEngine

from rlkit_core.errors import RunError
from rlkit_core.recipe.document import parse_recipe
from rlkit_core.runtime.push_check import NOISE_MARGIN, PROBE_TOKENS, first_probe, push_problem
from rlkit_core.runtime.run import run_recipe

POLICY = torch.tensor([-1.0, -2.0, -0.5, -3.0])


def test_a_sampler_far_from_the_policy_fails_at_any_push():
    sampler = POLICY + torch.tensor([0.1, -0.1, 0.1, -0.1])  # 0.1 nats per token on average
    assert "0.1 nats per token on average, more than health.weight_push_tolerance = 0.05" in str(push_problem(sampler, POLICY, None, 0.0, 0.05))
    assert push_problem(sampler, POLICY, None, 0.0, 0.2) is None


def test_a_sampler_still_where_the_policy_was_fails_when_the_policy_moved():
    before = POLICY + torch.tensor([0.02, -0.02, 0.02, -0.02])  # the policy moved 0.02 nats per token since the last push
    problem = push_problem(before.clone(), POLICY, before, noise=1e-6, tolerance=0.05)
    assert problem is not None and "moved 0.02 nats per token" in problem and "did not land" in problem
    landed = POLICY + 1e-6
    assert push_problem(landed, POLICY, before, noise=1e-6, tolerance=0.05) is None


def test_a_move_within_the_numerics_gap_is_not_read():
    """With bf16 engines the first push's gap (same weights) is the noise; a smaller move says nothing."""
    noise = 0.01
    before = POLICY + NOISE_MARGIN * noise * 0.9  # moved less than the margin
    assert push_problem(before.clone(), POLICY, before, noise, tolerance=0.05) is None
    before = POLICY + NOISE_MARGIN * noise * 1.1
    assert "did not land" in str(push_problem(before.clone(), POLICY, before, noise, tolerance=0.05))


def test_the_probe_is_the_first_prompt_of_two_tokens_or_more_cut_to_its_last_tokens():
    ids = torch.tensor([[0, 0, 7], [0, 5, 6]])
    mask = torch.tensor([[0, 0, 1], [0, 1, 1]])
    assert first_probe([(ids, mask)]) == [5, 6]
    long = torch.arange(PROBE_TOKENS + 10).unsqueeze(0)
    assert first_probe([(ids[:1], mask[:1]), (long, torch.ones_like(long))]) == list(range(10, PROBE_TOKENS + 10))
    assert first_probe([(ids[:1], mask[:1])]) == []


class IgnoresPushes(StandInEngine):
    """Loads the first push, then reports success for the others without loading them: an engine
    that ignored the update (verl#7495's sampler kept the initial policy for two months)."""

    def load_weights(self, weights):
        if "load_weights" in self.calls:
            self.calls.append("load_weights")
            return
        super().load_weights(weights)


class LoadsNothing(StandInEngine):
    """Keeps its own random initialisation: wrong weights from the first push."""

    def load_weights(self, weights):
        self.calls.append("load_weights")


def _run(recipe_document, builtin_registry, monkeypatch, engine, **health) -> list[dict]:
    monkeypatch.setattr(VLLMGenerator, "_start_engine", lambda self, context: engine(self.policy, self.config))
    recipe_document["generator"] = {"type": "vllm", "max_new_tokens": 8}
    recipe_document["run"]["steps"] = 3
    recipe_document["health"] = health
    run_recipe(parse_recipe(recipe_document, builtin_registry), quiet=True)
    return _rows(recipe_document)


def _rows(recipe_document) -> list[dict]:
    import json

    lines = (Path(recipe_document["run"]["output_dir"]) / "metrics.jsonl").read_text().splitlines()
    return [row for row in map(json.loads, lines) if "score/mean" in row]


def test_every_push_of_a_run_is_checked_and_reported(recipe_document, builtin_registry, monkeypatch):
    rows = _run(recipe_document, builtin_registry, monkeypatch, StandInEngine)
    assert len(rows) == 3
    assert all(row["check/push_gap"] < 1e-5 for row in rows)  # the stand-in computes in float32 like the policy
    assert all(0 < row["time/push_check"] < row["time/iteration"] for row in rows)


def test_a_push_that_did_not_land_stops_the_run_at_the_next_iteration_with_a_checkpoint(recipe_document, builtin_registry,
                                                                                          monkeypatch):
    """A small step (the move stays under the tolerance): only the second rule can see it."""
    recipe_document["optim"]["learning_rate"] = 1e-4
    with pytest.raises(RunError, match=r"weight push to the VLLMGenerator generator \(weights after 1 updates\) failed the check: "
                                       r"the policy moved .* the push did not land.*saved .*continue with --resume auto"):
        _run(recipe_document, builtin_registry, monkeypatch, IgnoresPushes)
    assert len(_rows(recipe_document)) == 1  # the first iteration trained; the second push was caught before sampling
    assert any(Path(recipe_document["run"]["output_dir"]).glob("checkpoints/*"))


def test_wrong_weights_stop_the_run_at_the_first_push(recipe_document, builtin_registry, monkeypatch):
    with pytest.raises(RunError, match=r"\(weights after 0 updates\) failed the check: its log-probs of the probe differ"):
        _run(recipe_document, builtin_registry, monkeypatch, LoadsNothing)
    assert not (Path(recipe_document["run"]["output_dir"]) / "metrics.jsonl").exists()  # nothing trained


def test_a_tolerance_of_zero_turns_the_check_off(recipe_document, builtin_registry, monkeypatch):
    rows = _run(recipe_document, builtin_registry, monkeypatch, IgnoresPushes, weight_push_tolerance=0.0)
    assert len(rows) == 3 and not any("check/push_gap" in row for row in rows)


def test_a_generator_that_samples_with_the_policys_module_is_not_checked(recipe_document, builtin_registry):
    recipe_document["run"]["steps"] = 1
    run_recipe(parse_recipe(recipe_document, builtin_registry), quiet=True)
    assert not any("check/push_gap" in row or "time/push_check" in row for row in _rows(recipe_document))


def test_a_producer_whose_engine_ignores_pushes_stops_the_run(recipe_document, builtin_registry, monkeypatch):
    """Batches made one step ahead: the worker's own engine is checked against the worker's copy."""
    recipe_document["scheduler"] = {"max_staleness": 1}
    recipe_document["loss"] = {"type": "ppo-clip", "tis_cap": 2.0, "is_level": "sequence"}
    recipe_document["optim"]["learning_rate"] = 1e-4
    with pytest.raises(RunError, match=r"the producer's worker 0 failed .* WeightPushFailed: the weight push to the VLLMGenerator "
                                       r"generator .* the push did not land.*saved "):
        _run(recipe_document, builtin_registry, monkeypatch, IgnoresPushes)
