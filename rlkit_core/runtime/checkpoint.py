"""Checkpoints: everything a run needs to continue exactly where it stopped.

Layout of `<output_dir>/checkpoints/iter_000012/`:
  policy.safetensors      trainable policy tensors (all weights, or the LoRA adapters)
  value_head.safetensors  critic tensors (absent without a critic)
  trainer.pt              optimiser, schedule, KL controller, RNG states of every process, iteration
  meta.json               iteration, tracker run id, the recipe document, rlkit version, processes,
                          whether the run was sharded
  manifest.json           every other file's path, size and SHA-256, written last: a checkpoint
                          whose files do not match it (cut short, emptied, changed) is not used
  sharded/                under FSDP only: accelerate's `save_state`, every process's shards of the
                          weights and the optimiser state; trainer.pt then holds no optimiser state

Under several processes every one of them calls `save_checkpoint` (each hands over its RNG state)
and the main process writes; under DDP the weights and optimiser state are the same in every
process. Under FSDP every process writes its own shards into sharded/, and the main process writes
the whole weights (gathered) into the .safetensors files as well, so `rlkit export` and a reader
of the checkpoint see the same layout whatever the engine; resuming reads the shards.
A checkpoint is written into a hidden temporary folder and renamed into place only when complete,
so a crash mid-write never leaves one that looks whole; only the latest `keep` are kept. A copy
made later (to another disk, by hand) can still be cut short or corrupted: the manifest finds it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import random
import shutil
import signal
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rlkit_core import __version__
from rlkit_core.errors import RlkitError, RunError

PREFIX = "iter_"
SHARDED = "sharded"
MANIFEST = "manifest.json"


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(trainer, run_id: str | None, keep: int, rng: dict | None = None) -> Path:
    """Checkpoint the trainer as it is, with this process's random state as it is (or `rng`, one
    taken earlier by `rng_state`). A failed write (a full disk) leaves the earlier checkpoints as they were
    and stops the run with exit code 1 on every process."""
    processes = trainer.processes
    rng_states = processes.gather_objects(rng or rng_state())
    final = checkpoint_root(trainer.output_dir) / f"{PREFIX}{trainer.iteration:06d}"
    temporary = final.parent / f".{final.name}.tmp-{processes.gather_objects(os.getpid())[0]}"  # the main process's id, everywhere
    if processes.is_main:
        final.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir()
    if processes.sharded:
        processes.wait()
        trainer.accelerator.save_state(str(temporary / SHARDED))  # every process writes its shards
        processes.wait()  # every shard is on disk before the main process lists them in the manifest
    problem = None
    with trainer.full_weights():
        if processes.is_main:
            try:
                _write_checkpoint(trainer, temporary, final, run_id, keep, rng_states)
            except OSError as exc:
                shutil.rmtree(temporary, ignore_errors=True)
                earlier = complete_checkpoints(trainer.output_dir)
                kept = f"the latest complete one, {earlier[-1]}, is intact" if earlier else "there is no earlier one"
                problem = (f"writing the checkpoint {final} failed: {exc.strerror or exc}; {kept}; free some space (or set "
                           "run.output_dir elsewhere) and continue with --resume auto")
    problems = [p for p in processes.gather_objects(problem) if p]  # also: every process waits for the write
    if problems:
        raise RunError(problems[0])
    return final


def _write_checkpoint(trainer, temporary: Path, final: Path, run_id: str | None, keep: int, rng_states: list[dict]) -> None:
    sharded = trainer.processes.sharded
    save_file({k: v.contiguous() for k, v in trainer.policy.state_dict().items()}, temporary / "policy.safetensors")
    _test_fault(trainer.iteration)
    if trainer.value_head is not None:
        save_file({k: v.contiguous() for k, v in _critic_state(trainer).items()}, temporary / "value_head.safetensors")
    torch.save({
        "iteration": trainer.iteration,
        **({} if sharded else {"optimizer": trainer.optimizer.state_dict()}),
        "scheduler": trainer.scheduler.state_dict(),
        "kl": trainer.parts.kl.state_dict(),
        "rng_by_process": rng_states,
    }, temporary / "trainer.pt")
    meta = {"iteration": trainer.iteration, "run_id": run_id, "rlkit_version": __version__, "recipe": trainer.recipe.document,
            "processes": len(rng_states), "sharded": sharded}
    (temporary / "meta.json").write_text(json.dumps(meta, indent=2, default=str))
    write_manifest(temporary)
    if final.exists():  # the same iteration written again (a resumed run redoing it): replace it whole
        shutil.rmtree(final)
    os.replace(temporary, final)
    for old in complete_checkpoints(trainer.output_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _test_fault(iteration: int) -> None:
    """Test-only: `RLKIT_TEST_CHECKPOINT_FAULT=kill@N` (or `enospc@N`) makes the write of iteration
    N's checkpoint SIGKILL its own process (or fail with ENOSPC) halfway, after the first file, so
    that tests can land inside the write deterministically. Unset in real runs."""
    fault, _, at = os.environ.get("RLKIT_TEST_CHECKPOINT_FAULT", "").partition("@")
    if not fault or int(at) != iteration:
        return
    if fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _critic_state(trainer) -> dict[str, torch.Tensor]:
    """The critic's tensors. Under FSDP (inside `full_weights`) they are read as the head module's
    gathered parameters: a module's `state_dict` there would hand back its shards."""
    if not trainer.processes.sharded:
        return trainer.value_head.state_dict()
    return {name: p.detach().clone() for name, p in trainer.value_head.module().named_parameters()}


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Finished checkpoints, oldest first (temporary folders start with a dot and are ignored)."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith(PREFIX) and (p / "meta.json").is_file())


def write_manifest(folder: Path) -> None:
    """List every file under `folder` with its size and SHA-256 in manifest.json; called once the
    other files are written, so a checkpoint with a manifest had all of them complete."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST):
        files[path.relative_to(folder).as_posix()] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    (folder / MANIFEST).write_text(json.dumps({"files": files}, indent=1))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while chunk := stream.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def damage(folder: Path) -> str | None:
    """What is wrong with the checkpoint in `folder` against its manifest (None: every file is as
    it was written). Without a manifest a checkpoint cannot be verified, so it counts as damaged:
    rlkit writes the manifest last, and a checkpoint from before rlkit wrote manifests has none."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return (f"no {MANIFEST}, so its files cannot be verified (a copy that missed it, or a checkpoint from "
                "before rlkit wrote manifests)")
    try:
        files = json.loads(manifest.read_text())["files"]
        listed = {name: (int(entry["size"]), str(entry["sha256"])) for name, entry in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"its {MANIFEST} cannot be read ({type(exc).__name__}: {exc})"
    problems = []
    for name, (size, sha256) in listed.items():
        path = folder / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size != size:
            problems.append(f"{name} is {path.stat().st_size} bytes, the manifest says {size}")
        elif _sha256(path) != sha256:
            problems.append(f"{name} does not match its SHA-256 checksum in the manifest")
    if not problems:
        return None
    more = f" and {len(problems) - 3} more" if len(problems) > 3 else ""
    return ", ".join(problems[:3]) + more


def usable_checkpoint(output_dir: str | Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The latest checkpoint whose files match its manifest (None if there is none), and the
    damaged ones newer than it, each with what is wrong."""
    damaged = []
    for path in reversed(complete_checkpoints(output_dir)):
        why = damage(path)
        if why is None:
            return path, damaged
        damaged.append((path, why))
    return None, damaged


def choose(resume: str, output_dir: str | Path) -> tuple[Path, str]:
    """The checkpoint `--resume` names (`auto`: the latest usable one in output_dir), verified, and
    a line for the user naming the damaged ones passed over ("" when none was)."""
    if resume == "auto":
        found, damaged = usable_checkpoint(output_dir)
        passed = ", ".join(f"{path} is damaged ({why})" for path, why in damaged)
        if found is None:
            if damaged:
                raise RlkitError(f"--resume auto: no usable checkpoint under {checkpoint_root(output_dir)}: {passed}; start "
                                 "over with --overwrite, or check one with rlkit check-checkpoint PATH")
            raise RlkitError(f"--resume auto: no complete checkpoint under {checkpoint_root(output_dir)}; "
                             "start without --resume, or set run.checkpoint_every so runs leave checkpoints")
        return found, f"--resume auto: {passed}; resuming from {found}, the latest usable one" if damaged else ""
    path = Path(resume)
    if not (path / "meta.json").is_file():
        raise RlkitError(f"--resume {resume}: not a complete checkpoint (no meta.json); "
                         f"pick one of the {PREFIX}* folders under <output_dir>/checkpoints, or use --resume auto")
    why = damage(path)
    if why is not None:
        others = [p for p in reversed(complete_checkpoints(path.parent.parent)) if p.resolve() != path.resolve()]
        instead = next((p for p in others if damage(p) is None), None)
        fix = f"resume from {instead}, the latest usable one there, or with --resume auto" if instead else \
            "there is no usable checkpoint beside it: start over with --overwrite"
        raise RlkitError(f"--resume {resume}: the checkpoint is damaged: {why}; {fix}")
    return path, ""


def resolve(resume: str, output_dir: str | Path) -> Path:
    """`auto` → the latest usable checkpoint in output_dir; otherwise the given folder, verified."""
    return choose(resume, output_dir)[0]


def read_meta(path: Path) -> dict:
    return json.loads((path / "meta.json").read_text())


def load_checkpoint(trainer, path: Path) -> dict:
    """Restore `trainer` from `path`; returns the checkpoint's meta (iteration, run id, recipe).
    Every process loads; each takes back its own RNG state."""
    meta = read_meta(path)
    sharded = trainer.processes.sharded
    if meta.get("sharded", False) != sharded:
        engines = {True: "under FSDP (configs/accelerate/fsdp.yaml)", False: "without sharding (one process or DDP)"}
        raise RlkitError(f"--resume {path}: the checkpoint was written {engines[not sharded]} and this run is launched "
                         f"{engines[sharded]}; resume the way it was written (the optimiser state is kept the engine's way)")
    written_by, processes = meta.get("processes", 1), trainer.processes.count
    if written_by != processes:
        raise RlkitError(f"--resume {path}: the checkpoint was written by {written_by} processes and this run has "
                         f"{processes}; resume with {written_by} processes (each continues its own random stream)")
    if sharded:
        trainer.accelerator.load_state(str(path / SHARDED))  # every process reads its shards
    else:
        trainer.policy.load_state_dict(load_file(path / "policy.safetensors", device=str(trainer.device)))
        if trainer.value_head is not None:
            trainer.value_head.load_state_dict(load_file(path / "value_head.safetensors", device=str(trainer.device)))
    try:  # tensors and plain values only: a checkpoint from elsewhere runs no code; RNG states stay on the CPU
        state = torch.load(path / "trainer.pt", map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise RlkitError(f"--resume {path}: trainer.pt holds more than tensors and plain values, which rlkit never loads "
                         f"(it could run code): {str(exc).splitlines()[0]}; resume from a checkpoint rlkit wrote") from None
    if not sharded:
        trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.scheduler.load_state_dict(state["scheduler"])
    trainer.parts.kl.load_state_dict(state["kl"])
    by_process = state["rng_by_process"] if "rng_by_process" in state else [state["rng"]]  # "rng": rlkit 0.1.0
    _set_rng_state(by_process[trainer.processes.index])
    trainer.iteration = state["iteration"]
    return meta
