"""Checkpoints and exact resume, including a real `rlkit run` killed with SIGKILL."""

import json
import os
import shutil
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
from rlkit_core.runtime.state import RunState
from rlkit_core.runtime.trainer import Trainer


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


@pytest.mark.slow
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


def test_the_fp16_loss_scaler_is_checkpointed_and_restored(recipe_document, builtin_registry, tmp_path):
    """A resumed fp16 run goes on with the loss scale it had, not a fresh one. accelerate makes its
    GradScaler only for fp16 on a GPU; on a CPU a real torch GradScaler, moved by real overflowed
    and finite steps, is put where accelerate keeps it (`accelerator.scaler`), and the checkpoint
    takes it through accelerate's save_state and load_state as on a GPU."""
    recipe = parse_recipe(dict(recipe_document, run={**recipe_document["run"], "output_dir": str(tmp_path / "run")}), builtin_registry)
    trainer = Trainer(recipe)
    scaler = trainer.engine.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    weight = torch.nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    for loss in [weight.sum() * float("inf"), weight.sum(), weight.sum(), weight.sum()]:  # one overflow, then 3 good steps
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    assert scaler.state_dict() == {"scale": 2.0 ** 15, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
                                   "_growth_tracker": 3}
    path = checkpoint.save_checkpoint(trainer.engine, trainer.components, recipe, RunState(iteration=1), None, keep=1)
    assert "state/scaler.pt" in json.loads((path / "manifest.json").read_text())["files"]

    resumed = Trainer(recipe)
    resumed.engine.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    state, _ = checkpoint.load_checkpoint(resumed.engine, resumed.components, path)
    assert resumed.engine.accelerator.scaler.state_dict() == scaler.state_dict()
    assert resumed.engine.accelerator.scaler.get_scale() == 2.0 ** 15 and state.iteration == 1


def test_a_checkpoint_of_the_earlier_layout_is_refused_with_the_fix(recipe_document, builtin_registry, write_recipe, tmp_path, capsys):
    """A checkpoint as rlkit wrote them before accelerate's save_state held the optimiser, schedule
    and random states (all in trainer.pt, no state/, no "layout" in meta.json): a located exit 2
    from `rlkit run --resume` and `rlkit check-checkpoint`, no traceback; `rlkit export` still reads it."""
    from rlkit_core.runtime.cli import main

    output_dir = tmp_path / "run"
    document = dict(recipe_document, run={**recipe_document["run"], "steps": 1, "output_dir": str(output_dir)})
    run_recipe(parse_recipe(document, builtin_registry), quiet=True)
    old = output_dir / "checkpoints" / "iter_000001"
    state = torch.load(old / "trainer.pt", weights_only=True)
    state.update(optimizer=torch.load(old / "state" / "optimizer.bin", weights_only=True),
                 scheduler=torch.load(old / "state" / "scheduler.bin", weights_only=True), rng_by_process=[checkpoint.rng_state()])
    torch.save(state, old / "trainer.pt")
    shutil.rmtree(old / "state")
    meta = checkpoint.read_meta(old)
    del meta["layout"]
    (old / "meta.json").write_text(json.dumps(meta))
    checkpoint.write_manifest(old)  # intact: only its layout is the earlier one
    recipe = write_recipe(dict(document, run={**document["run"], "steps": 2}))
    capsys.readouterr()

    words = ("the checkpoint is in an earlier rlkit's layout (optimiser and random states in trainer.pt, no state/ folder; "
             f"written by rlkit {meta['rlkit_version']}), which this rlkit does not resume; continue it with the rlkit that "
             "wrote it, or start over with --overwrite")
    assert main(["run", recipe, "--resume", str(old), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rlkit run: --resume {old}: {words}") and "Traceback" not in err
    assert main(["run", recipe, "--resume", "auto", "--quiet"]) == 2
    assert f"--resume auto: {old}: {words}" in capsys.readouterr().err
    assert main(["check-checkpoint", str(old)]) == 2
    assert words in capsys.readouterr().err
    assert [row["iteration"] for row in metrics_of(output_dir)] == [1]  # nothing trained
    export_checkpoint(str(old), str(tmp_path / "exported"), builtin_registry)


class WritesAFile:
    """Unpickled, it would write a file: what a crafted checkpoint could hide."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (Path.write_text, (Path(self.path), "ran"))


def test_a_crafted_file_in_accelerates_state_is_refused_and_runs_nothing(recipe_document, builtin_registry, write_recipe, tmp_path, capsys):
    """accelerate reads its files as tensors and plain values too (weights_only): a crafted
    optimizer.bin with a matching manifest is a located exit 2, and its code does not run."""
    from rlkit_core.runtime.cli import main

    output_dir = tmp_path / "run"
    document = dict(recipe_document, run={**recipe_document["run"], "steps": 1, "output_dir": str(output_dir)})
    run_recipe(parse_recipe(document, builtin_registry), quiet=True)
    path = output_dir / "checkpoints" / "iter_000001"
    marker = tmp_path / "code-ran"
    state = torch.load(path / "state" / "optimizer.bin", weights_only=True)
    state["extra"] = WritesAFile(marker)
    torch.save(state, path / "state" / "optimizer.bin")
    checkpoint.write_manifest(path)
    capsys.readouterr()
    assert main(["run", write_recipe(dict(document, run={**document["run"], "steps": 2})), "--resume", str(path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"--resume {path}: state holds more than tensors and plain values, which rlkit never loads" in err
    assert "Traceback" not in err and not marker.exists()
