"""Damaged checkpoints: every checkpoint carries a manifest of its files, `--resume auto` passes
over a damaged one to the previous usable one, and `--resume PATH` or `rlkit check-checkpoint`
on a damaged one is a located refusal (exit 2, no traceback). Through the real command where the
command is what a user meets."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlkit_core.errors import RlkitError
from rlkit_core.recipe.document import parse_recipe
from rlkit_core.runtime import checkpoint
from rlkit_core.runtime.run import run_recipe

ENV = {**os.environ, "RLKIT_PLUGINS": "none"}
RLKIT = [sys.executable, "-m", "rlkit_core.runtime.cli"]


def rlkit(*args):
    return subprocess.run(RLKIT + list(args), env=ENV, capture_output=True, text=True, timeout=300)


def rows_of(output_dir):
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("time/")}
            for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def two_checkpoints(recipe_document, builtin_registry, write_recipe, tmp_path):
    """A finished 4-iteration run with checkpoints after iterations 2 and 4: (recipe path, output_dir)."""
    output_dir = tmp_path / "run"
    document = dict(recipe_document, run={**recipe_document["run"], "steps": 4, "checkpoint_every": 2, "output_dir": str(output_dir)})
    run_recipe(parse_recipe(document, builtin_registry), quiet=True)
    assert [p.name for p in checkpoint.complete_checkpoints(output_dir)] == ["iter_000002", "iter_000004"]
    return write_recipe(document), output_dir


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


# how a checkpoint gets damaged, and the words that say so
DAMAGES = {
    "truncated weights": (lambda c: truncate(c / "policy.safetensors"), "policy.safetensors is {half} bytes, the manifest says {size}"),
    "zero-byte weights": (lambda c: (c / "policy.safetensors").write_bytes(b""), "policy.safetensors is 0 bytes, the manifest says {size}"),
    "a changed byte": (lambda c: flip_a_byte(c / "policy.safetensors"), "policy.safetensors does not match its SHA-256 checksum"),
    "a missing file": (lambda c: (c / "trainer.pt").unlink(), "trainer.pt is missing"),
    "a missing manifest": (lambda c: (c / "manifest.json").unlink(), "no manifest.json, so its files cannot be verified"),
}


def damage(folder: Path, how: str) -> str:
    size = (folder / "policy.safetensors").stat().st_size
    make, words = DAMAGES[how]
    make(folder)
    return words.format(size=size, half=size // 2)


def test_every_checkpoint_lists_each_of_its_files_with_size_and_sha256(two_checkpoints):
    _, output_dir = two_checkpoints
    for folder in checkpoint.complete_checkpoints(output_dir):
        listed = json.loads((folder / "manifest.json").read_text())["files"]
        on_disk = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name != "manifest.json")
        assert sorted(listed) == on_disk and {"policy.safetensors", "trainer.pt", "meta.json"} <= set(listed)
        for name, entry in listed.items():
            data = (folder / name).read_bytes()
            assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
        assert checkpoint.damage(folder) is None


@pytest.mark.parametrize("how", list(DAMAGES))
def test_resume_auto_passes_over_a_damaged_checkpoint_to_the_previous_one(two_checkpoints, how):
    _, output_dir = two_checkpoints
    latest, previous = checkpoint.complete_checkpoints(output_dir)[::-1]
    words = damage(latest, how)
    chosen, note = checkpoint.choose("auto", output_dir)
    assert chosen == previous
    assert note.startswith(f"--resume auto: {latest} is damaged (") and words in note
    assert note.endswith(f"resuming from {previous}, the latest usable one")
    with pytest.raises(RlkitError, match="the checkpoint is damaged: .*" + words.split(" ")[0]):
        checkpoint.choose(str(latest), output_dir)


@pytest.mark.slow
def test_the_real_command_resumes_from_the_previous_checkpoint_and_trains_the_same_iterations(two_checkpoints):
    recipe, output_dir = two_checkpoints
    straight = rows_of(output_dir)
    latest, previous = checkpoint.complete_checkpoints(output_dir)[::-1]
    words = damage(latest, "truncated weights")
    result = rlkit("run", recipe, "--quiet", "--resume", "auto")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if "is damaged" in line]
    assert lines == [f"rlkit run: --resume auto: {latest} is damaged ({words}); resuming from {previous}, the latest usable one"]
    assert rows_of(output_dir) == straight  # iterations 3 and 4 trained again, exactly as before
    assert checkpoint.damage(latest) is None  # rewritten whole


@pytest.mark.slow
@pytest.mark.parametrize("how", ["zero-byte weights", "a missing manifest"])
def test_resume_from_a_damaged_path_is_refused_with_the_usable_one_named(two_checkpoints, how):
    recipe, output_dir = two_checkpoints
    latest, previous = checkpoint.complete_checkpoints(output_dir)[::-1]
    words = damage(latest, how)
    before = rows_of(output_dir)
    result = rlkit("run", recipe, "--quiet", "--resume", str(latest))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith(f"rlkit run: --resume {latest}: the checkpoint is damaged: {words}")
    assert f"; resume from {previous}, the latest usable one there, or with --resume auto" in result.stderr
    assert rows_of(output_dir) == before


@pytest.mark.slow
def test_check_checkpoint_verifies_without_a_run(two_checkpoints):
    _, output_dir = two_checkpoints
    latest, previous = checkpoint.complete_checkpoints(output_dir)[::-1]
    good = rlkit("check-checkpoint", str(latest))
    assert good.returncode == 0 and good.stdout == f"{latest}: usable: iteration 4, every file matches its manifest\n"
    words = damage(latest, "truncated weights")
    bad = rlkit("check-checkpoint", str(latest))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and f"the checkpoint is damaged: {words}" in bad.stderr
    folder = rlkit("check-checkpoint", str(output_dir))
    assert folder.returncode == 0, folder.stderr
    assert folder.stdout.splitlines() == [f"{previous}: usable", f"{latest}: damaged: {words}",
                                          f"--resume auto would resume from {previous}"]


@pytest.mark.slow
def test_no_usable_checkpoint_at_all_is_a_located_refusal(two_checkpoints):
    recipe, output_dir = two_checkpoints
    latest, previous = checkpoint.complete_checkpoints(output_dir)[::-1]
    damage(latest, "truncated weights")
    damage(previous, "a missing manifest")
    result = rlkit("run", recipe, "--quiet", "--resume", "auto")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"--resume auto: no usable checkpoint under {output_dir / 'checkpoints'}: {latest} is damaged" in result.stderr
    assert f"{previous} is damaged (no manifest.json" in result.stderr and "start over with --overwrite" in result.stderr
    assert not (output_dir / "rlkit.lock").exists()


def test_a_copied_run_keeps_verifying(two_checkpoints, tmp_path):
    """The manifest holds relative paths: a checkpoint copied elsewhere verifies as it did."""
    _, output_dir = two_checkpoints
    copy = tmp_path / "copy"
    shutil.copytree(output_dir, copy)
    assert checkpoint.resolve("auto", copy) == copy / "checkpoints" / "iter_000004"
