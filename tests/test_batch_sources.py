"""Batch sources as a plugin kind: a third party's in one module (examples/batch_sources/rollout_log.py)
registered, checked by the contract kit, picked by a recipe's `[batch_source]` with its settings
and refused beside what only the core's sources do, and trained on: to the last digit of the
core's own sampling, with every row written where it says."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlkit_core.errors import RecipeError
from rlkit_core.imports import load_module
from rlkit_core.recipe.document import parse_recipe
from rlkit_core.recipe.plan import describe_plan
from rlkit_core.recipe.plugins import load_registry
from rlkit_core.runtime.batch_sources import PluginSource
from rlkit_core.testing.contracts import BatchSourceContract
from tests.test_trainer import make_trainer

ROLLOUT_LOG = Path(__file__).parents[1] / "examples" / "batch_sources" / "rollout_log.py"


def rollout_log_registry():
    module = load_module(str(ROLLOUT_LOG), "rlkit_example_rollout_log")
    return load_registry(environ={"RLKIT_PLUGINS": "none"}, extra_plugins=[("rollout-log", module, "rlkit-rollout-log", "0.1")])


class TestRolloutLogContract(BatchSourceContract):
    component = "rollout-log"

    @pytest.fixture(scope="class")
    @classmethod
    def registry(cls):
        return rollout_log_registry()


def test_a_run_with_the_plugins_source_trains_as_the_core_samples_and_logs_every_row(recipe_document):
    registry = rollout_log_registry()
    runs = {}
    for source in (None, {"type": "rollout-log", "path": "log/rows.jsonl"}):
        document = copy.deepcopy(recipe_document)
        if source:
            document["batch_source"] = source
        trainer = make_trainer(document, registry)
        try:
            runs[bool(source)] = [trainer.step() for _ in range(3)]
            if source:
                assert isinstance(trainer.source, PluginSource)
                prompts = [[r["prompt"] for r in trainer.stream_records(i)] for i in range(3)]
        finally:
            trainer.close()
    untimed = {ran: [{k: v for k, v in row.items() if not k.startswith("time/")} for row in rows] for ran, rows in runs.items()}
    assert untimed[True] == untimed[False]  # the same numbers to the last digit
    rows = [json.loads(line) for line in (Path(recipe_document["run"]["output_dir"]) / "log" / "rows.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in rows] == [i for i in (1, 2, 3) for _ in range(16)]
    assert [row["prompt"] for row in rows] == [p for batch in prompts for p in batch]
    scores = [row["score"] for row in rows]
    assert [sum(scores[16 * i:16 * (i + 1)]) / 16 for i in range(3)] == pytest.approx([run["score/mean"] for run in runs[True]])


def test_the_recipe_refuses_what_only_the_core_sources_do(recipe_document):
    registry = rollout_log_registry()
    recipe_document["batch_source"] = {"type": "rollout-log"}
    recipe_document["scheduler"] = {"max_staleness": 1}
    recipe_document["loss"] = {"type": "ppo-clip", "tis_cap": 2.0}
    with pytest.raises(RecipeError, match=r"\$\.batch_source: batch_source 'rollout-log' gives the batches in place of the core's "
                                          r"source, so \[scheduler\] max_staleness = 1 would do nothing"):
        parse_recipe(recipe_document, registry)
    recipe_document.pop("scheduler")
    recipe_document["ppo"]["dynamic_sampling"] = True
    with pytest.raises(RecipeError, match=r"\$\.batch_source: .*dynamic sampling and ReMax's greedy baseline run in the core's own"):
        parse_recipe(recipe_document, registry)
    recipe_document["ppo"].pop("dynamic_sampling")
    recipe_document["batch_source"] = {"type": "rollout-log", "pth": "x.jsonl"}
    with pytest.raises(RecipeError, match=r"\$\.batch_source\.pth"):
        parse_recipe(recipe_document, registry)
    recipe_document["batch_source"] = {"type": "rollout-logs"}
    with pytest.raises(RecipeError, match=r"\$\.batch_source\.type: unknown batch_source 'rollout-logs'.*did you mean 'rollout-log'"):
        parse_recipe(recipe_document, registry)


def test_a_source_that_declares_older_batches_needs_the_loss_that_corrects_for_them(recipe_document, monkeypatch):
    registry = rollout_log_registry()
    monkeypatch.setattr(registry.find("batch_source", "rollout-log").factory, "max_staleness", 2)
    recipe_document["batch_source"] = {"type": "rollout-log"}
    with pytest.raises(RecipeError, match=r"\$\.loss: a batch may be 2 policy version\(s\) old"):
        parse_recipe(recipe_document, registry)
    recipe_document["loss"] = {"type": "ppo-clip", "tis_cap": 2.0, "is_level": "sequence"}
    recipe = parse_recipe(recipe_document, registry)
    assert "batch_source 'rollout-log' gives every batch, at most 2 version(s) behind when trained" in describe_plan(recipe)


def test_rlkit_plugins_lists_the_kind_and_check_says_where_the_batches_come_from(recipe_document):
    done = subprocess.run([sys.executable, "-m", "rlkit_core.runtime.cli", "plugins"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    kind = lines.index("batch_source")
    name, said = lines[kind + 1].split(maxsplit=1)
    assert (name, said.startswith("core: builds no batch_source; the core's own source, by [scheduler] max_staleness")) == ("none", True)
    recipe_document["batch_source"] = {"type": "rollout-log"}
    plan = describe_plan(parse_recipe(recipe_document, rollout_log_registry()))
    assert "batch_source 'rollout-log' gives every batch, sampled by the weights that train on it (as its class declares)" in plan
    assert "[batch_source] rollout-log" in plan


@pytest.mark.slow
def test_two_processes_each_take_their_share_through_the_plugins_source(recipe_document, write_recipe, tmp_path):
    """Installed as a package would be (an entry point), under torchrun: each process's source takes
    its own share of the stream's batch and writes it to its own file; the two shares are the
    global batch, and the run ends as usual."""
    plugin = tmp_path / "plugin"
    plugin.mkdir()
    (plugin / "rlkit_rollout_log.py").write_text(ROLLOUT_LOG.read_text())
    info = plugin / "rlkit_rollout_log-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rlkit-rollout-log\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[rlkit]\nrollout-log = rlkit_rollout_log\n")
    recipe_document["run"]["steps"] = 2
    recipe_document["batch_source"] = {"type": "rollout-log"}
    env = {**os.environ, "PYTHONPATH": f"{plugin}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("RLKIT_PLUGINS", None)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(Path(sys.executable).with_name("rlkit")), "run", write_recipe(recipe_document), "--quiet"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    output = Path(recipe_document["run"]["output_dir"])
    shares = [[json.loads(line) for line in (output / name).read_text().splitlines()] for name in ("rollouts.jsonl", "rollouts-1.jsonl")]
    assert [len(share) for share in shares] == [16, 16]  # 8 rows a process an iteration, two iterations
    for iteration in (1, 2):
        prompts = [[row["prompt"] for row in share if row["iteration"] == iteration] for share in shares]
        assert len(prompts[0]) == len(prompts[1]) == 8 and not set(prompts[0]) & set(prompts[1])
    assert len((output / "metrics.jsonl").read_text().splitlines()) >= 2
