"""`[scheduler] partial_rollouts`: a producer's worker loads the weights pushed while its episodes
are in flight, between their turns. Every sampled token keeps the version that sampled it
(`RolloutBatch.sampled_versions`), and its sampled log-prob is that version's."""

from __future__ import annotations

import time

import attrs
import pytest
import torch
from rlkit_plugins.guess_number import GuessNumber, GuessNumberConfig

from rlkit_core import hookimpl, setting
from rlkit_core.errors import RecipeError
from rlkit_core.recipe.document import parse_recipe
from rlkit_core.recipe.plugins import load_registry
from rlkit_core.runtime.forward import response_view, rows_of
from tests.test_episodes import ending_model, episode_document
from tests.test_trainer import make_trainer


@attrs.frozen
class SlowGuessNumberConfig(GuessNumberConfig):
    delay: float = setting(0.3, help="seconds each step waits")


class SlowGuessNumber(GuessNumber):
    """guess-number answering each turn after `delay` s, so that an update ends while a batch plays
    (defined at the top level: a worker process imports it)."""

    def step(self, state, reply):
        time.sleep(self.config.delay)  # pyright: ignore[reportAttributeAccessIssue]  (a SlowGuessNumberConfig)
        return super().step(state, reply)


class SlowPlugin:
    @hookimpl
    def register_environments(self, register):
        register("slow-guess-number", SlowGuessNumber, SlowGuessNumberConfig)


def slow_registry():
    return load_registry(environ={"RLKIT_PLUGINS": "none"}, extra_plugins=[("slow-guess-number", SlowPlugin(), "tests", "0")])


AHEAD = {"scheduler__max_staleness": 1, "scheduler__partial_rollouts": True, "loss__tis_cap": 2.0, "loss__is_level": "sequence"}


@pytest.mark.parametrize("workers, style", [("threads", "byt5"), ("processes", "byt5"), ("processes", "gpt2")])
def test_weights_pushed_mid_batch_sample_the_later_turns_and_each_token_keeps_its_version(recipe_document, tmp_path, workers, style):
    """`gpt2`: a pad-less BPE tokenizer (the policy adds a suppressed PAD row), its turns rendered
    with the environment's answers between them."""
    document = episode_document(recipe_document, ending_model(tmp_path / "ending", style))
    document["environment"].update(type="slow-guess-number", delay=0.3)
    trainer = make_trainer(document, slow_registry(), **AHEAD, scheduler__workers=workers, optim__learning_rate=1e-2, run__steps=4)
    model = trainer.components.policy.model
    weights, taken = {}, []  # the weights after v updates; each batch as made, with its metrics
    rollouts = trainer._rollouts

    def recorded(iteration):
        weights[iteration] = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        taken.append(rollouts(iteration))
        return taken[-1]

    trainer._rollouts = recorded
    try:
        for _ in range(4):
            trainer.iterate()
    finally:
        trainer.close()
    mixed = 0
    for iteration, (batch, metrics) in enumerate(taken):
        versions, counted = batch.sampled_versions, batch.loss_mask.bool()
        assert versions is not None and (versions[counted] >= 0).all() and (versions[~batch.response_mask.bool()] == -1).all()
        sampled = versions[versions >= 0]
        assert iteration - int(sampled.min()) == metrics["async/staleness"] <= 1  # the bound holds for the oldest token
        assert metrics["async/token_staleness"] == pytest.approx(iteration - sampled.double().mean().item())
        mixed += len(sampled.unique()) > 1
        for version in sampled.unique().tolist():  # each token's log-prob is its own version's
            model.load_state_dict(weights[version])
            logprobs, _, _, _ = response_view(trainer.components, batch, rows_of(batch, False), grad=False)
            mine = versions == version
            assert torch.allclose(batch.sampled_logprobs[mine], logprobs[mine], atol=1e-4)
            if version > 0:  # the weights before it would have sampled other log-probs: the check can fail
                model.load_state_dict(weights[version - 1])
                before, _, _, _ = response_view(trainer.components, batch, rows_of(batch, False), grad=False)
                assert (batch.sampled_logprobs[mine] - before[mine]).abs().max() > 1e-3
    assert mixed  # some batch's later turns were sampled by weights pushed while it played


@pytest.mark.parametrize("changes, said", [
    ({"max_staleness": 0}, "set max_staleness >= 1"),
    ({"max_staleness": 1, "environment": {"turn_barrier": False}}, "environment.turn_barrier = true"),
    ({"max_staleness": 1, "single_turn": True}, "a single-turn recipe has no turns"),
])
def test_partial_rollouts_are_refused_where_no_turn_can_take_newer_weights(recipe_document, builtin_registry, tmp_path, changes, said):
    if not changes.pop("single_turn", False):
        episode_document(recipe_document, ending_model(tmp_path / "ending"))
        recipe_document["environment"].update(changes.pop("environment", {}))
    recipe_document.update(scheduler={"partial_rollouts": True, **changes}, loss={"type": "ppo-clip", "tis_cap": 2.0})
    with pytest.raises(RecipeError, match=said) as raised:
        parse_recipe(recipe_document, builtin_registry)
    assert "$.scheduler.partial_rollouts" in str(raised.value)


def test_rlkit_check_says_where_batches_are_made_and_when_weights_change(recipe_document, builtin_registry, tmp_path):
    from rlkit_core.recipe.plan import describe_plan

    episode_document(recipe_document, ending_model(tmp_path / "ending"))
    recipe_document.update(scheduler={"max_staleness": 2, "workers": "processes", "partial_rollouts": True},
                           loss={"type": "ppo-clip", "tis_cap": 2.0})
    plan = describe_plan(parse_recipe(recipe_document, builtin_registry))
    assert ("max_staleness = 2: batches sampled ahead by worker processes of their own, at most 2 version(s) behind when trained; "
            "weights pushed mid-batch are loaded between turns; a wait over 600 s ends the run") in plan


@pytest.mark.slow
@pytest.mark.parametrize("workers", ["threads", "processes"])
def test_under_two_trainer_processes_each_loads_the_weights_pushed_between_its_turns(recipe_document, tmp_path, workers):
    """Each trainer process's workers load its pushes on their own, with no collective between
    turns; a worker process's batch gathers over the group of that worker's processes."""
    import json
    from pathlib import Path

    from tests.test_scaling import torchrun

    document = episode_document(recipe_document, ending_model(tmp_path / "ending"))
    document["environment"].update(type="slow-guess-number", delay=0.3)
    for key, value in {**AHEAD, "scheduler__workers": workers, "optim__learning_rate": 1e-2, "run__steps": 4}.items():
        table, name = key.split("__")
        document.setdefault(table, {})[name] = value
    (tmp_path / "recipe.json").write_text(json.dumps(document))
    torchrun(str(Path(__file__).with_name("partial_rollouts_ddp.py")), str(tmp_path / "recipe.json"), str(tmp_path))
    everywhere = json.loads((tmp_path / "versions.json").read_text())
    assert [[row["iteration"] for row in taken] for taken in everywhere] == [[0, 1, 2, 3]] * 2
    for taken in everywhere:
        for row in taken:
            assert row["iteration"] - min(row["versions"]) == row["staleness"] <= 1
    assert any(len(row["versions"]) > 1 for taken in everywhere for row in taken)  # weights loaded mid-batch somewhere
