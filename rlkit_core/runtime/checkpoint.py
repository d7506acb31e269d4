# pyright: standard
"""Checkpoints: everything a run needs to continue exactly where it stopped.

Layout of `<output_dir>/checkpoints/iter_000012/`:
  policy.safetensors      trainable policy tensors, whole (all weights, or the LoRA adapters):
                          what `rlkit export` reads, and what a run without sharding resumes from
  value_head.safetensors  critic tensors (absent without a critic)
  state/                  accelerate's `save_state`: optimiser (optimizer.bin), schedule
                          (scheduler.bin), each process's random states (random_states_<i>.pkl),
                          the fp16 loss scaler (scaler.pt, under fp16 only); under FSDP also every
                          process's shards of the weights and the optimiser state
  trainer.pt              what accelerate does not hold: the run's state (`RunState`: iteration,
                          non-finite steps and skipped batches) and the KL controller's
  meta.json               iteration, tracker run id, the recipe document, rlkit version, processes,
                          whether the run was sharded, the layout
  manifest.json           every other file's path, size and SHA-256, written last: a checkpoint
                          whose files do not match it (cut short, emptied, changed) is not used

Every engine (one process, DDP, FSDP) goes through the same calls: every process calls
`save_checkpoint`, accelerate writes state/ (each process its random states and, under FSDP, its
shards), and the main process writes the whole weights (gathered under FSDP) and rlkit's files.
Without sharding accelerate is told to leave the weights out of state/ (a save hook), since the
.safetensors files hold them already; under FSDP resuming reads the shards.
rlkit's own state is a file of its own rather than an object registered with accelerate
(`register_for_checkpointing`): accelerate unpickles registered objects with `weights_only=False`,
which would let a crafted checkpoint run code, while trainer.pt is read as tensors and plain values.
The prompt stream and rlkit's seeded streams need no state: they are functions of (seed, iteration).
A checkpoint is written into a hidden temporary folder and renamed into place only when complete,
so a crash mid-write never leaves one that looks whole; only the latest `keep` are kept. A copy
made later (to another disk, by hand) can still be cut short or corrupted: the manifest finds it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import pickle
import random
import shutil
import signal
from pathlib import Path

import attrs
import numpy as np
import torch
from safetensors.torch import load_file, save_file

from rlkit_core import __version__
from rlkit_core.errors import RlkitError, RunError
from rlkit_core.recipe.assemble import Components
from rlkit_core.recipe.document import Recipe
from rlkit_core.runtime.engine import Engine
from rlkit_core.runtime.state import RunState

PREFIX = "iter_"
STATE = "state"
MANIFEST = "manifest.json"
LAYOUT = 2  # meta.json's "layout": 2 since accelerate's save_state holds the optimiser, schedule, RNG and loss scaler


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def rng_state() -> dict:
    """This process's global random states (the ones accelerate's save_state records)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(engine: Engine, components: Components, recipe: Recipe, state: RunState, run_id: str | None, keep: int,
                    rng: dict | None = None) -> Path:
    """Checkpoint the run at `state` (the engine and components as they are), with this process's
    random state as it is (or `rng`, one taken earlier by `rng_state`), under `recipe.run.output_dir`.
    A failed write (a full disk) leaves the earlier checkpoints as they were and stops the run with
    exit code 1 on every process."""
    processes, output_dir = engine.processes, recipe.run.output_dir
    final = checkpoint_root(output_dir) / f"{PREFIX}{state.iteration:06d}"
    temporary = final.parent / f".{final.name}.tmp-{processes.gather_objects(os.getpid())[0]}"  # the main process's id, everywhere
    if processes.is_main:
        final.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir()
    processes.wait()  # the folder exists before any process writes into it
    problem = None
    try:
        _save_accelerate_state(engine, temporary / STATE, rng)
    except OSError as exc:
        problem = _write_failed(output_dir, final, exc)
    processes.wait()  # every process's files are on disk before the main process lists them in the manifest
    with engine.full_weights():
        if processes.is_main and problem is None:
            try:
                _write_checkpoint(engine, components, recipe, state, temporary, final, run_id, keep)
            except OSError as exc:
                problem = _write_failed(output_dir, final, exc)
    problems = [p for p in processes.gather_objects(problem) if p]  # also: every process waits for the write
    if problems:
        if processes.is_main:
            shutil.rmtree(temporary, ignore_errors=True)
        raise RunError(problems[0])
    return final


def _write_failed(output_dir: str, final: Path, exc: OSError) -> str:
    earlier = complete_checkpoints(output_dir)
    kept = f"the latest complete one, {earlier[-1]}, is intact" if earlier else "there is no earlier one"
    return (f"writing the checkpoint {final} failed: {exc.strerror or exc}; {kept}; free some space (or set "
            "run.output_dir elsewhere) and continue with --resume auto")


def _save_accelerate_state(engine: Engine, folder: Path, rng: dict | None) -> None:
    """accelerate's save_state into `folder`, with the random state `rng` in place of the current
    one when given; the current one is put back after."""
    current = rng_state() if rng is not None else None
    if rng is not None:
        _set_rng_state(rng)
    try:
        with _weights_left_to_rlkit(engine):
            engine.accelerator.save_state(str(folder))
    finally:
        if current is not None:
            _set_rng_state(current)


@contextlib.contextmanager
def _weights_left_to_rlkit(engine: Engine):
    """Without sharding, accelerate's save_state and load_state skip the weights (rlkit writes and
    reads them as policy.safetensors and value_head.safetensors); under FSDP they pass through,
    as accelerate saves and loads the shards before these hooks run."""
    accelerator = engine.accelerator
    hooks = [accelerator.register_save_state_pre_hook(lambda models, weights, folder: weights.clear()),
             accelerator.register_load_state_pre_hook(lambda models, folder: models.clear())]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def _write_checkpoint(engine: Engine, components: Components, recipe: Recipe, state: RunState, temporary: Path, final: Path,
                      run_id: str | None, keep: int) -> None:
    save_file({k: v.contiguous() for k, v in components.policy.state_dict().items()}, temporary / "policy.safetensors")
    _test_fault(state.iteration)
    if components.value_head is not None:
        save_file({k: v.contiguous() for k, v in _critic_state(engine, components.value_head).items()}, temporary / "value_head.safetensors")
    torch.save({**attrs.asdict(state), "kl": components.kl.state_dict()}, temporary / "trainer.pt")
    meta = {"iteration": state.iteration, "run_id": run_id, "rlkit_version": __version__, "recipe": recipe.document,
            "processes": engine.processes.count, "sharded": engine.processes.sharded, "layout": LAYOUT}
    (temporary / "meta.json").write_text(json.dumps(meta, indent=2, default=str))
    write_manifest(temporary)
    if final.exists():  # the same iteration written again (a resumed run redoing it): replace it whole
        shutil.rmtree(final)
    os.replace(temporary, final)
    for old in complete_checkpoints(recipe.run.output_dir)[:-keep]:
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


def _critic_state(engine: Engine, value_head) -> dict[str, torch.Tensor]:
    """The critic's tensors. Under FSDP (inside `full_weights`) they are read as the head module's
    gathered parameters: a module's `state_dict` there would hand back its shards."""
    if not engine.processes.sharded:
        return value_head.state_dict()
    return {name: p.detach().clone() for name, p in value_head.module().named_parameters()}


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


def choose(resume: str, output_dir: str | Path, resuming: bool = True) -> tuple[Path, str]:
    """The checkpoint `--resume` names (`auto`: the latest usable one in output_dir), verified (and,
    when `resuming`, in a layout this rlkit resumes), and a line for the user naming the damaged
    ones passed over ("" when none was)."""
    path, note = _verified(resume, output_dir)
    if resuming and (problem := layout_problem(path)):
        raise RlkitError(f"--resume {resume}: {path}: {problem}" if resume == "auto" else f"--resume {resume}: {problem}")
    return path, note


def _verified(resume: str, output_dir: str | Path) -> tuple[Path, str]:
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


def resolve(resume: str, output_dir: str | Path, resuming: bool = True) -> Path:
    """`auto` → the latest usable checkpoint in output_dir; otherwise the given folder, verified."""
    return choose(resume, output_dir, resuming)[0]


def read_meta(path: Path) -> dict:
    return json.loads((path / "meta.json").read_text())


def layout_problem(path: Path, meta: dict | None = None) -> str | None:
    """Why this rlkit cannot resume the checkpoint's layout (None: it can). Checkpoints from before
    `LAYOUT` 2 kept the optimiser, schedule and random states in trainer.pt and had no state/."""
    meta = read_meta(path) if meta is None else meta
    if meta.get("layout") == LAYOUT:
        return None
    return (f"the checkpoint is in an earlier rlkit's layout (optimiser and random states in trainer.pt, no {STATE}/ "
            f"folder; written by rlkit {meta.get('rlkit_version', 'unknown')}), which this rlkit does not resume; continue "
            "it with the rlkit that wrote it, or start over with --overwrite; rlkit export still reads its weights")


def load_checkpoint(engine: Engine, components: Components, path: Path) -> tuple[RunState, dict]:
    """Restore the engine and the components from `path`; returns the run's state there and the
    checkpoint's meta (iteration, run id, recipe). Every process loads; each takes back its own
    random states."""
    meta = read_meta(path)
    if problem := layout_problem(path, meta):
        raise RlkitError(f"--resume {path}: {problem}")
    sharded = engine.processes.sharded
    if meta.get("sharded", False) != sharded:
        engines = {True: "under FSDP (configs/accelerate/fsdp.yaml)", False: "without sharding (one process or DDP)"}
        raise RlkitError(f"--resume {path}: the checkpoint was written {engines[not sharded]} and this run is launched "
                         f"{engines[sharded]}; resume the way it was written (the optimiser state is kept the engine's way)")
    written_by, processes = meta.get("processes", 1), engine.processes.count
    if written_by != processes:
        raise RlkitError(f"--resume {path}: the checkpoint was written by {written_by} processes and this run has "
                         f"{processes}; resume with {written_by} processes (each continues its own random stream)")
    saved = _plain_values(path, path / "trainer.pt", lambda: torch.load(path / "trainer.pt", map_location="cpu", weights_only=True))
    if not sharded:  # under FSDP accelerate loads the shards
        components.policy.load_state_dict(load_file(path / "policy.safetensors", device=str(engine.device)))
        if components.value_head is not None:
            components.value_head.load_state_dict(load_file(path / "value_head.safetensors", device=str(engine.device)))
    with _weights_left_to_rlkit(engine):  # optimiser, schedule, loss scaler, this process's random states
        _plain_values(path, path / STATE, lambda: engine.accelerator.load_state(str(path / STATE)))
    components.kl.load_state_dict(saved["kl"])
    # a trainer.pt from before the skip counts were kept in it: no batch counted as skipped
    return RunState(**{field.name: saved.get(field.name, 0) for field in attrs.fields(RunState)}), meta


def _plain_values(checkpoint: Path, where: Path, load):
    """`load()`, which reads tensors and plain values only (torch's weights_only, as accelerate's
    loads do too): a checkpoint from elsewhere runs no code, and one that tries is refused."""
    try:
        return load()
    except pickle.UnpicklingError as exc:
        raise RlkitError(f"--resume {checkpoint}: {where.relative_to(checkpoint)} holds more than tensors and plain values, "
                         f"which rlkit never loads (it could run code): {str(exc).splitlines()[0]}; resume from a "
                         "checkpoint rlkit wrote") from None
