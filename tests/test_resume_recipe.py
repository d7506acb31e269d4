"""A resumed run checks its recipe against the checkpoint's: a change to what shapes the training
is refused, naming each setting with both values, unless --allow-changes (then recorded in the
tracker and the next row of metrics.jsonl); settings that cannot change the results pass."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlkit_core.recipe.document import parse_recipe
from rlkit_core.recipe.resume_check import recipe_changes
from rlkit_core.runtime import checkpoint
from rlkit_core.runtime.run import run_recipe

ENV = {**os.environ, "RLKIT_PLUGINS": "none"}
RUN = [sys.executable, "-m", "rlkit_core.runtime.cli", "run", "--quiet"]


def rows_of(output_dir):
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def changed(recipe_document, registry, **tables):
    """recipe_changes from the document to the document with `tables` merged in (None: drop the key)."""
    document = json.loads(json.dumps(recipe_document))
    for table, keys in tables.items():
        body = document.setdefault(table, {})
        for key, value in keys.items():
            body.pop(key) if value is None else body.__setitem__(key, value)
    return recipe_changes(recipe_document, parse_recipe(document, registry))


def test_settings_that_shape_training_count_and_the_rest_do_not(recipe_document, builtin_registry):
    assert changed(recipe_document, builtin_registry, ppo={"batch_size": 32}, run={"steps": 9}) == [("ppo.batch_size", 16, 32)]
    assert changed(recipe_document, builtin_registry, run={"seed": 1, "threads": 2}, optim={"learning_rate": 2e-3}) == [
        ("run.seed", 0, 1), ("run.threads", 1, 2), ("optim.learning_rate", 1e-3, 2e-3)]
    assert changed(recipe_document, builtin_registry, loss={"type": "ppo-clip", "clip": 0.3}) == [("loss.clip", 0.2, 0.3)]
    harmless = {"sample_every": 1, "checkpoint_every": 1, "keep_checkpoints": 5, "name": "again", "output_dir": "elsewhere"}
    assert changed(recipe_document, builtin_registry, run=harmless, tracker={"type": "mlflow", "uri": "sqlite:///x.db"},
                   health={"all_truncated": 0}, eval={"every": 3}) == []
    # written out on one side at its default, left out on the other: the same training
    assert changed(recipe_document, builtin_registry, ppo={"kl_penalty": "reward", "samples_per_prompt": 1},
                   kl={"type": "adaptive", "target": 6.0}) == []
    assert changed(recipe_document, builtin_registry, ppo={"epochs": None}) == [("ppo.epochs", 2, 4)]  # back to its default of 4


def test_a_surrogate_named_alone_is_its_table_with_default_settings(recipe_document, builtin_registry):
    """`surrogate = "ppo"`, `[loss.surrogate] type = "ppo"` and no surrogate at all train alike; a surrogate's own setting counts."""
    recipe_document["loss"] = {"type": "ppo-clip", "surrogate": "ppo"}
    assert changed(recipe_document, builtin_registry, loss={"surrogate": None}) == []
    assert changed(recipe_document, builtin_registry, loss={"surrogate": {"type": "ppo"}}) == []
    assert changed(recipe_document, builtin_registry, loss={"surrogate": {"type": "gspo"}}) == [
        ("loss.surrogate", "ppo", "gspo"), ("loss.surrogate.type", "ppo", "gspo")]
    recipe_document["loss"]["surrogate"] = "cispo"
    assert changed(recipe_document, builtin_registry, loss={"surrogate": {"type": "cispo", "eps_high_is": 0.28}}) == [
        ("loss.surrogate.eps_high_is", 0.2, 0.28)]


def test_more_steps_pass_only_under_a_schedule_that_does_not_spread_over_the_run(recipe_document, builtin_registry):
    linear = dict(recipe_document, optim={**recipe_document["optim"], "schedule": "linear"})
    assert changed(linear, builtin_registry, run={"steps": 4}) == [("run.steps", 2, 4)]
    warm = dict(recipe_document, optim={**recipe_document["optim"], "schedule": "constant_with_warmup", "warmup_steps": 2})
    assert changed(warm, builtin_registry, run={"steps": 4}) == []


def trained_two(recipe_document, registry, write_recipe, tmp_path, tracker=None):
    output_dir = tmp_path / "run"
    document = dict(recipe_document, run={**recipe_document["run"], "steps": 2, "output_dir": str(output_dir)},
                    tracker=tracker or recipe_document["tracker"])
    run_recipe(parse_recipe(document, registry), quiet=True)
    return write_recipe(document), output_dir


@pytest.mark.slow
def test_a_changed_recipe_is_refused_before_anything_is_trained(recipe_document, builtin_registry, write_recipe, tmp_path):
    recipe, output_dir = trained_two(recipe_document, builtin_registry, write_recipe, tmp_path)
    before = (output_dir / "metrics.jsonl").read_text()
    latest = checkpoint.resolve("auto", output_dir)
    result = subprocess.run(RUN + [recipe, "--resume", "auto", "--set", "ppo.batch_size=32", "--set", "run.steps=4",
                                   "--set", "optim.learning_rate=0.002"], env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr == (
        f"rlkit run: --resume {latest}: 2 setting(s) that shape the training differ from the checkpoint's recipe:\n"
        "  $.ppo.batch_size: 16 in the checkpoint's recipe, 32 now\n"
        "  $.optim.learning_rate: 0.001 in the checkpoint's recipe, 0.002 now\n"
        "resume with the recipe the checkpoint was trained with (its meta.json holds it), or add --allow-changes to "
        "continue with these changes, recorded in the tracker and metrics.jsonl\n")
    assert (output_dir / "metrics.jsonl").read_text() == before
    alone = subprocess.run(RUN + [recipe, "--allow-changes"], env=ENV, capture_output=True, text=True, timeout=300)
    assert alone.returncode == 2 and "--allow-changes: only with --resume" in alone.stderr


@pytest.mark.slow
def test_allowed_changes_are_recorded_in_the_tracker_and_the_next_row(recipe_document, builtin_registry, write_recipe, tmp_path):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    recipe, output_dir = trained_two(recipe_document, builtin_registry, write_recipe, tmp_path, tracker={"type": "mlflow", "uri": uri})
    result = subprocess.run(RUN + [recipe, "--resume", "auto", "--allow-changes", "--set", "ppo.batch_size=32",
                                   "--set", "run.steps=4"], env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    line = "$.ppo.batch_size: 16 in the checkpoint's recipe, 32 now"
    assert (f"rlkit run: warning: resuming {output_dir / 'checkpoints' / 'iter_000002'} with 1 changed setting(s) "
            f"(--allow-changes): {line}") in result.stderr
    rows = rows_of(output_dir)
    assert [row["iteration"] for row in rows] == [1, 2, 3, 4]
    assert rows[2]["note/recipe_changes"] == [line] and rows[2]["run/recipe_changes"] == 1
    assert all("note/recipe_changes" not in row and "run/recipe_changes" not in row for row in rows[:2] + rows[3:])
    run = MlflowClient(tracking_uri=uri).get_run(checkpoint.read_meta(checkpoint.resolve("auto", output_dir))["run_id"])
    assert run.data.tags["rlkit.note.resume.recipe_changes"] == f"resumed after iteration 2 with --allow-changes: {line}"
    assert run.data.metrics["run/recipe_changes"] == 1


@pytest.mark.slow
def test_extending_a_run_and_changing_what_only_logs_pass(recipe_document, builtin_registry, write_recipe, tmp_path):
    recipe, output_dir = trained_two(recipe_document, builtin_registry, write_recipe, tmp_path)
    result = subprocess.run(RUN + [recipe, "--resume", "auto", "--set", "run.steps=3", "--set", "run.sample_every=1",
                                   "--set", "run.checkpoint_every=1"], env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "changed setting" not in result.stderr
    assert [row["iteration"] for row in rows_of(output_dir)] == [1, 2, 3]
