"""Checkpoints and exact resume, including a real `rlkit run` killed with SIGKILL."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlkit_core.errors import RlkitError
from rlkit_core.recipe.document import parse_recipe
from rlkit_core.runtime import checkpoint
from rlkit_core.runtime.export import export_checkpoint
from rlkit_core.runtime.run import run_recipe


def without_timing(rows):
    return [{k: v for k, v in row.items() if not k.startswith("time/")} for row in rows]


def metrics_of(output_dir):
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def test_resumed_run_matches_an_uninterrupted_one(recipe_document, builtin_registry, tmp_path):
    straight = dict(recipe_document, run={**recipe_document["run"], "steps": 4, "output_dir": str(tmp_path / "straight")})
    run_recipe(parse_recipe(straight, builtin_registry), quiet=True)

    split_dir = str(tmp_path / "split")
    first = dict(recipe_document, run={**recipe_document["run"], "steps": 2, "output_dir": split_dir})
    run_recipe(parse_recipe(first, builtin_registry), quiet=True)
    second = dict(recipe_document, run={**recipe_document["run"], "steps": 4, "output_dir": split_dir})
    run_recipe(parse_recipe(second, builtin_registry), quiet=True, resume="auto")

    assert without_timing(metrics_of(split_dir)) == without_timing(metrics_of(tmp_path / "straight"))


def test_checkpoints_are_kept_to_the_latest_k_and_temporaries_ignored(recipe_document, builtin_registry, tmp_path):
    output_dir = tmp_path / "keep"
    document = dict(recipe_document, run={**recipe_document["run"], "steps": 4, "checkpoint_every": 1,
                                          "keep_checkpoints": 2, "output_dir": str(output_dir)})
    run_recipe(parse_recipe(document, builtin_registry), quiet=True)
    names = [p.name for p in checkpoint.complete_checkpoints(output_dir)]
    assert names == ["iter_000003", "iter_000004"]
    (output_dir / "checkpoints" / ".iter_000005.tmp-999").mkdir()  # what a crash mid-write leaves
    assert checkpoint.resolve("auto", output_dir).name == "iter_000004"
    assert checkpoint.read_meta(output_dir / "checkpoints" / "iter_000004")["iteration"] == 4


def test_resume_errors_say_what_to_do(tmp_path):
    with pytest.raises(RlkitError, match="no complete checkpoint under"):
        checkpoint.resolve("auto", tmp_path)
    with pytest.raises(RlkitError, match="not a complete checkpoint"):
        checkpoint.resolve(str(tmp_path), tmp_path)


def test_export_writes_a_model_from_pretrained_loads(recipe_document, builtin_registry, tmp_path):
    from transformers import AutoModelForCausalLM

    output_dir = tmp_path / "exp"
    document = dict(recipe_document, run={**recipe_document["run"], "steps": 1, "output_dir": str(output_dir)})
    run_recipe(parse_recipe(document, builtin_registry), quiet=True)
    source = checkpoint.resolve("auto", output_dir)
    target = export_checkpoint(str(source), str(tmp_path / "exported"), builtin_registry)
    exported = AutoModelForCausalLM.from_pretrained(target)
    final = AutoModelForCausalLM.from_pretrained(output_dir / "final_model")
    for (name, a), (_, b) in zip(exported.state_dict().items(), final.state_dict().items()):
        assert torch.equal(a, b), name
    with pytest.raises(RlkitError, match="exists and is not empty"):
        export_checkpoint(str(source), str(target), builtin_registry)


def test_sigkill_mid_run_then_resume_auto(recipe_document, write_recipe, tmp_path):
    env = {**os.environ, "RLKIT_PLUGINS": "none"}
    command = [sys.executable, "-m", "rlkit_core.runtime.cli", "run", "--quiet"]

    straight = dict(recipe_document, run={**recipe_document["run"], "steps": 6, "output_dir": str(tmp_path / "straight")})
    subprocess.run(command + [write_recipe(straight, "straight.toml")], env=env, check=True, capture_output=True, timeout=300)

    killed_dir = tmp_path / "killed"
    document = dict(recipe_document, run={**recipe_document["run"], "steps": 6, "checkpoint_every": 1, "output_dir": str(killed_dir)})
    recipe = write_recipe(document, "killed.toml")
    process = subprocess.Popen(command + [recipe], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while not (killed_dir / "checkpoints" / "iter_000002").exists():
        assert process.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline, "no checkpoint appeared within 240 s"
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    survived = checkpoint.resolve("auto", killed_dir)
    assert survived.name >= "iter_000002"

    subprocess.run(command + [recipe, "--resume", "auto"], env=env, check=True, capture_output=True, timeout=300)
    assert [row["iteration"] for row in metrics_of(killed_dir)] == [1, 2, 3, 4, 5, 6]
    assert without_timing(metrics_of(killed_dir)) == without_timing(metrics_of(tmp_path / "straight"))


def test_a_fresh_run_never_mixes_with_an_earlier_one(recipe_document, builtin_registry, tmp_path):
    document = dict(recipe_document, run={**recipe_document["run"], "steps": 1, "output_dir": str(tmp_path / "twice")})
    run_recipe(parse_recipe(document, builtin_registry), quiet=True)
    with pytest.raises(RlkitError, match="already holds a run .*--resume auto.*--overwrite"):
        run_recipe(parse_recipe(document, builtin_registry), quiet=True)
    run_recipe(parse_recipe(document, builtin_registry), quiet=True, overwrite=True)
    assert [row["iteration"] for row in metrics_of(tmp_path / "twice")] == [1]
