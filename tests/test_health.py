"""Health checks: each rule on hand-built metric sequences, each check firing on a tiny run built
to trip it (and not on the same run without the fault), and the loop's reporting: once, on the
terminal, in metrics.jsonl and the tracker, and stopping the run when told to."""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch

from rlkit_core.errors import RecipeError
from rlkit_core.recipe.document import parse_recipe
from rlkit_core.records import CHECKS, HealthConfig
from rlkit_core.runtime.health import HealthMonitor, detect, group_zero_variance_share
from rlkit_core.runtime.trainer import Trainer

ENV = {**os.environ, "RLKIT_PLUGINS": "none"}
RUN = [sys.executable, "-m", "rlkit_core.runtime.cli", "run", "--quiet"]
DEFAULTS = HealthConfig()
HEALTHY = {"score/mean": 0.4, "score/std": 0.2, "response/eos_rate": 0.5, "check/logprob_gap": 0.001,
           "train/entropy": 2.0, "kl/ref": 1.0, "train/grad_norm": 0.3, "train/nonfinite": 0.0}


def fired(history, config=DEFAULTS, **context):
    return {f.check: f.value for f in detect(config, [{**HEALTHY, **row} for row in history], **context)}


def test_a_healthy_sequence_trips_nothing():
    assert fired([{}, {}, {}], group_share=0.2, kl_target=6.0) == {}


def test_zero_reward_variance_over_the_batch_or_in_most_groups():
    assert fired([{"score/std": 0.0}]) == {"zero_reward_variance": 0.0}
    assert fired([{"score/std": 1e-3}]) == {}
    assert fired([{}], group_share=0.9) == {"zero_reward_variance": 0.9}  # 9 groups in 10 without a difference
    assert fired([{}], group_share=0.85) == {}
    assert fired([{"score/std": 0.0}], attrs.evolve(DEFAULTS, zero_reward_variance=False)) == {}
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 0.5, 0.5, 0.5, 0.5])
    assert group_zero_variance_share(scores, torch.arange(12) // 4) == pytest.approx(2 / 3)


def test_all_truncated_after_n_iterations_without_eos():
    assert fired([{"response/eos_rate": 0.0}] * 2) == {}
    assert fired([{"response/eos_rate": 0.1}] + [{"response/eos_rate": 0.0}] * 3) == {"all_truncated": 0.0}
    assert fired([{"response/eos_rate": 0.0}] * 2 + [{"response/eos_rate": 0.01}]) == {}
    assert fired([{"response/eos_rate": 0.0}], attrs.evolve(DEFAULTS, all_truncated=1)) == {"all_truncated": 0.0}
    assert fired([{"response/eos_rate": 0.0}] * 5, attrs.evolve(DEFAULTS, all_truncated=0)) == {}


def test_a_jump_of_the_logprob_gap_against_its_earlier_mean():
    gaps = lambda *values: [{"check/logprob_gap": v} for v in values]  # noqa: E731
    assert fired(gaps(0.001, 0.003, 0.2)) == {"logprob_gap_jump": 0.2}  # 100 times the mean of 0.002
    assert fired(gaps(0.001, 0.003, 0.019)) == {}  # 9.5 times: under the factor of 10
    assert fired(gaps(0.001, 0.003, 0.04)) == {}  # 20 times, but under the floor of 0.05 nats
    assert fired(gaps(0.3)) == {}  # nothing earlier to jump from
    assert fired(gaps(0.001, 0.2), attrs.evolve(DEFAULTS, logprob_gap_jump=0)) == {}


def test_a_batch_made_ahead_is_left_out_of_the_logprob_gap():
    """Sampled by weights some updates older, its gap is the updates' (a run ahead at staleness 2
    of the tiny recipe: 0.069 nats, against 6e-8 before), not a failed sync."""
    rows = [{"check/logprob_gap": 6e-8, "async/staleness": 0.0}, {"check/logprob_gap": 0.069, "async/staleness": 2.0}]
    assert fired(rows) == {}
    assert fired([*rows, {"check/logprob_gap": 0.2, "async/staleness": 0.0}]) == {"logprob_gap_jump": 0.2}  # against 6e-8 alone


def test_entropy_collapse_against_the_first_iteration():
    assert fired([{"train/entropy": 2.0}, {"train/entropy": 0.09}]) == {"entropy_collapse": 0.09}  # under 5% of 2.0
    assert fired([{"train/entropy": 2.0}, {"train/entropy": 0.11}]) == {}
    assert fired([{"train/entropy": 2.0}, {"train/entropy": 0.01}], attrs.evolve(DEFAULTS, entropy_collapse=0)) == {}


def test_kl_over_target_reads_the_mean_of_the_last_five_iterations():
    kl = lambda *values: [{"kl/ref": v} for v in values]  # noqa: E731
    assert fired(kl(12.1), kl_target=6.0) == {"kl_over_target": 12.1}  # over 2 × 6
    assert fired(kl(11.9), kl_target=6.0) == {}
    assert fired(kl(6, 6, 6, 6, 20), kl_target=6.0) == {}  # one noisy batch: a mean of 8.8
    # the runaway of issue 32's run (KL 11.7 at iteration 40 and 19.7 at 50, target 6): flagged on the way up
    assert fired(kl(8.1, 9.5, 11.7, 14.0, 17.0), kl_target=6.0) == pytest.approx({"kl_over_target": 12.06})
    assert fired(kl(30, 30, 30, 6, 6, 6, 6, 6), kl_target=6.0) == {}  # older than the window
    assert fired(kl(500.0)) == {}  # a controller without a target (fixed β)
    assert fired(kl(60.5), attrs.evolve(DEFAULTS, kl_over_target=0), kl_target=6.0) == {}


def test_zero_gradients_only_when_the_steps_were_finite():
    assert fired([{"train/grad_norm": 0.0}]) == {"zero_gradients": 0.0}
    assert fired([{"train/grad_norm": 0.0, "train/nonfinite": 1.0}]) == {}  # every step skipped as non-finite
    assert fired([{"train/grad_norm": 1e-9}]) == {}
    assert fired([{"train/grad_norm": 0.0}], attrs.evolve(DEFAULTS, zero_gradients=False)) == {}


def test_the_monitor_reports_each_check_once_and_not_again_after_a_resume():
    monitor = HealthMonitor(DEFAULTS)
    bad = {**HEALTHY, "score/std": 0.0}
    first = dict(bad)
    assert [f.check for f in monitor.observe(first, None, None)] == ["zero_reward_variance"]
    assert first["health/zero_reward_variance"] == 0.0
    again = dict(bad)
    assert monitor.observe(again, None, None) == [] and "health/zero_reward_variance" not in again
    assert monitor.observe({"run/skipped_batches": 1}, None, None) == []  # a skipped batch is not a trained iteration
    resumed = HealthMonitor(DEFAULTS, [{"iteration": 1, **first}])
    assert resumed.observe(dict(bad), None, None) == []


def test_a_run_whose_kl_ran_away_is_flagged_on_the_way_up():
    """The metrics of a whole run of an earlier default recipe (150 iterations, recorded): its KL ran
    to 5 times the controller's target at iteration 50 and came back. The check speaks at
    iteration 36, when the mean of the last 5 iterations first passes twice the target; nothing else does."""
    rows = json.loads((Path(__file__).parent / "data" / "runaway_run_metrics.json").read_text())
    assert len(rows) == 150 and max(row["kl/ref"] for row in rows) / 6.0 == pytest.approx(5.0, abs=0.05)
    monitor = HealthMonitor(DEFAULTS)
    fired = [(row["iteration"], f.check) for row in rows for f in monitor.observe(dict(row), None, 6.0)]
    assert fired == [(36, "kl_over_target")]


def test_the_default_recipe_trips_nothing():
    """The metrics of a whole run of today's default recipe (recipes/ppo_summarize.toml, seed 0, 150
    iterations, recorded with this code) through the default checks: quiet."""
    rows = json.loads((Path(__file__).parent / "data" / "default_recipe_metrics.json").read_text())
    assert len(rows) == 150
    monitor = HealthMonitor(DEFAULTS)
    assert [f.check for row in rows for f in monitor.observe(dict(row), None, 6.0)] == []


def test_stop_on_names_checks():
    assert all(hasattr(DEFAULTS, name) for name in CHECKS)  # every check has its setting (and off switch)
    assert HealthMonitor(HealthConfig(stop_on=["all"])).stops(detect(DEFAULTS, [{**HEALTHY, "score/std": 0.0}])).check == \
        "zero_reward_variance"
    assert HealthMonitor(HealthConfig(stop_on=["zero_gradients"])).stops(detect(DEFAULTS, [{**HEALTHY, "score/std": 0.0}])) is None


def test_an_unknown_check_in_stop_on_is_a_located_error(recipe_document, builtin_registry):
    with pytest.raises(RecipeError, match=r"\$\.health\.stop_on: unknown check\(s\) 'zero_grad'; the checks are 'all', "
                                          "'zero_reward_variance'"):
        parse_recipe(dict(recipe_document, health={"stop_on": ["zero_grad"]}), builtin_registry)


# --- each check on a tiny run built to trip it -----------------------------------------------------


def trained(document, registry, iterations, prepare=None):
    """{check: iteration it first fired at} over `iterations` of a real trainer, fed as the loop feeds the monitor."""
    trainer = Trainer(parse_recipe(document, registry))
    if prepare:
        prepare(trainer)
    monitor, first = HealthMonitor(trainer.recipe.health), {}
    for _ in range(iterations):
        iteration = trainer.iterate()
        for finding in monitor.observe(iteration.metrics, iteration.batch, getattr(trainer.components.kl, "target", None)):
            first[finding.check] = trainer.state.iteration
    return first


@pytest.fixture
def constant_reward(tmp_path):
    path = tmp_path / "constant.py"
    path.write_text("def score(prompts, responses, **columns):\n    return [0.5] * len(responses)\n")
    return {"type": "python", "function": f"{path}:score"}


def test_a_constant_reward_trips_zero_variance_and_under_grpo_zero_gradients(recipe_document, builtin_registry, constant_reward):
    grpo = dict(recipe_document, reward=constant_reward, advantage={"type": "grpo"}, value_head={"type": "none"},
                ppo={**recipe_document["ppo"], "samples_per_prompt": 4})
    found = trained(grpo, builtin_registry, 1)
    assert found["zero_reward_variance"] == 1 and found["zero_gradients"] == 1
    quiet = trained(dict(recipe_document, advantage={"type": "grpo"}, value_head={"type": "none"},
                         ppo={**recipe_document["ppo"], "samples_per_prompt": 4}), builtin_registry, 1)
    assert "zero_reward_variance" not in quiet and "zero_gradients" not in quiet


def test_responses_all_cut_at_the_limit_trip_all_truncated(recipe_document, builtin_registry):
    cut = dict(recipe_document, generator={"max_new_tokens": 8, "min_new_tokens": 8}, health={"all_truncated": 2})
    assert trained(cut, builtin_registry, 2)["all_truncated"] == 2


def test_a_generator_left_on_the_first_weights_trips_the_logprob_gap(recipe_document, builtin_registry):
    """The sleep-mode bug (TRL#5312): the generator samples from weights that are never synced."""
    fast = dict(recipe_document, optim={"learning_rate": 1e-2})

    def stale(trainer):
        trainer.components.generator.policy = copy.deepcopy(trainer.components.policy)  # its own model, never updated

    assert trained(fast, builtin_registry, 3, stale).get("logprob_gap_jump") == 2
    assert "logprob_gap_jump" not in trained(fast, builtin_registry, 3)


def test_a_kl_target_the_policy_runs_past_trips_kl_over_target(recipe_document, builtin_registry):
    far = dict(recipe_document, kl={"type": "adaptive", "target": 0.001, "beta": 0.01})
    assert trained(far, builtin_registry, 2)["kl_over_target"] == 2
    assert "kl_over_target" not in trained(recipe_document, builtin_registry, 2)


def test_entropy_collapse_on_a_policy_driven_to_one_response(recipe_document, builtin_registry):
    """A learning rate far too high, unclipped, without a KL penalty: every sample the same by iteration 3."""
    sharp = dict(recipe_document, optim={"learning_rate": 0.2, "max_grad_norm": 0.0}, ppo={**recipe_document["ppo"], "epochs": 4},
                 kl={"type": "fixed", "beta": 0.0})
    assert trained(sharp, builtin_registry, 3)["entropy_collapse"] == 3
    assert "entropy_collapse" not in trained(recipe_document, builtin_registry, 2)


# --- the loop: reported once, everywhere, and stopping when told to -----------------------------------


def rows_of(output_dir):
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_check_is_reported_once_on_the_terminal_in_metrics_jsonl_and_the_tracker(recipe_document, write_recipe, constant_reward,
                                                                                     tmp_path):
    from mlflow import MlflowClient

    uri, output_dir = f"sqlite:///{tmp_path}/mlflow.db", tmp_path / "flat"
    document = dict(recipe_document, reward=constant_reward, run={**recipe_document["run"], "steps": 2, "output_dir": str(output_dir)},
                    tracker={"type": "mlflow", "uri": uri}, health={"all_truncated": 0})
    result = subprocess.run(RUN + [write_recipe(document)], env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [line for line in result.stderr.splitlines() if "health check" in line]
    assert warnings == ["rlkit run: warning: health check zero_reward_variance after iteration 1: score/std = 0: every response "
                        "of the batch scored 0.5, so no advantage has a sign to learn from; look at the reward (does it score "
                        "these responses at all?) and at sample responses"]
    first, second = rows_of(output_dir)
    assert first["health/zero_reward_variance"] == 0.0 and first["note/health/zero_reward_variance"] in warnings[0]
    assert not any(key.startswith(("health/", "note/")) for key in second)
    client = MlflowClient(tracking_uri=uri)
    [run] = client.search_runs(experiment_ids=[e.experiment_id for e in client.search_experiments()])
    assert run.data.tags["rlkit.note.health.zero_reward_variance"] == warnings[0].removeprefix("rlkit run: warning: ")
    assert run.data.metrics["health/zero_reward_variance"] == 0.0


@pytest.mark.slow
def test_stop_on_ends_the_run_with_exit_3_and_a_checkpoint_to_resume(recipe_document, write_recipe, constant_reward, tmp_path):
    output_dir = tmp_path / "stopped"
    document = dict(recipe_document, reward=constant_reward, run={**recipe_document["run"], "steps": 3, "output_dir": str(output_dir)},
                    health={"stop_on": ["zero_reward_variance"]})
    result = subprocess.run(RUN + [write_recipe(document)], env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 3 and "Traceback" not in result.stderr, result.stderr[-3000:]
    saved = output_dir / "checkpoints" / "iter_000001"
    assert ("rlkit run: health check zero_reward_variance fired after iteration 1 and is in health.stop_on: score/std = 0: "
            in result.stderr) and result.stderr.rstrip().endswith(f"saved {saved}; continue with --resume auto")
    assert [row["iteration"] for row in rows_of(output_dir)] == [1] and (saved / "manifest.json").is_file()
