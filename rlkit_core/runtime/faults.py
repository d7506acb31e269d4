# pyright: standard
"""Faults at run time: a reward that misbehaves, a request to stop, and how each is reported.

A reward is someone else's code. The trainer checks what every reward source returns at the one
place they all pass (`checked_scores`): one finite float32 number per response. A reward that
breaks that contract, or raises, becomes a `BadReward` that names the reward as the recipe wrote it
and the user's own frames of the failure; the run then stops with the last good state saved, or
drops the batch, as `run.on_bad_reward` says. SIGTERM and a first Ctrl-C (`StopRequests`) let the
iteration in progress finish, so that the checkpoint written then is a whole one.
"""

from __future__ import annotations

import importlib.util
import json
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from rlkit_core.errors import RunError

# Our own packages: their frames are internals the user need not read (RLKIT_DEBUG=1 shows them).
OWN_PACKAGES = tuple(str(Path(spec.origin).parent) for spec in map(importlib.util.find_spec, ("rlkit_core", "rlkit_plugins"))
                     if spec is not None and spec.origin is not None)


def checked_scores(scores, count: int) -> list[float]:
    """A reward's return value as `count` floats, or ValueError saying how it breaks the contract
    (one finite number per response, finite also once stored as float32)."""
    if isinstance(scores, torch.Tensor):
        scores = scores.tolist()
    try:
        values = [float(s) for s in scores]
    except (TypeError, ValueError):
        raise ValueError(f"returned {_cut(repr(scores), 80)}, not a list of numbers") from None
    if len(values) != count:
        raise ValueError(f"returned {len(values)} scores for {count} responses")
    finite = torch.isfinite(torch.tensor(values, dtype=torch.float32)).tolist()
    if not all(finite):
        first = finite.index(False)
        raise ValueError(f"returned a score that is not a finite float32 number ({values[first]!r}) for response {first}")
    return values


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def failure_text(exc: BaseException) -> str:
    """`Type: message`, then the traceback frames outside rlkit (the user's function and what it
    called), so that the line that failed is in view without rlkit's internals around it."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(OWN_PACKAGES)]
    lines = [f"{type(exc).__name__}: {exc}"]
    lines += [line.rstrip("\n") for line in traceback.format_list(frames)]
    return "\n".join(lines)


class BadReward(RunError):
    """The reward broke its contract or raised on this batch (on some process); `batch` holds this
    process's prompts and responses and what the reward returned, for the user to look at."""

    def __init__(self, problem: str, batch: dict):
        super().__init__(problem)
        self.problem = problem
        self.batch = batch
        # the one-line problem, and the user's own traceback frames under it ("" or "\n" + frames)
        self.headline, newline, frames = problem.partition("\n")
        self.frames = newline + frames


def reward_name(recipe) -> str:
    """The reward as the recipe names it: `reward "python" (function = "my.py:score")`."""
    if "reward" not in recipe.components:  # `reward.type = "none"`: the environment's rewards alone
        return f'environment "{recipe["environment"].component.name}"'
    table = dict(recipe.document.get("reward", {}))
    kind = table.pop("type", recipe["reward"].component.name)
    settings = ", ".join(f"{key} = {json.dumps(value, default=str)}" for key, value in table.items())
    return f'reward "{kind}"' + (f" ({_cut(settings, 120)})" if settings else "")


def save_bad_batch(output_dir: str | Path, iteration: int, reward: str, fault: BadReward) -> Path:
    """`<output_dir>/bad_batches/iter_NNNNNN.json`: the batch a reward failed on, for the user."""
    path = Path(output_dir) / "bad_batches" / f"iter_{iteration:06d}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"iteration": iteration, "reward": reward, "problem": fault.problem, **fault.batch}
    path.write_text(json.dumps(record, indent=2, default=repr))
    return path


class NonFiniteSteps(RunError):
    """Too many optimiser steps in a row had a non-finite loss or gradient."""


class NothingTrained(RunError):
    """Iterations in a row trained nothing (every episode kept out of training): exit code 3, as a
    health check that stops the run."""

    exit_code = 3


class Stopped(RunError):
    """The run stopped on a signal, after checkpointing; the exit code is the shell's 128 + signal."""

    def __init__(self, message: str, signal_number: int):
        super().__init__(message)
        self.exit_code = 128 + signal_number


class StopRequests:
    """While active, SIGTERM and a first Ctrl-C (SIGINT) are noted rather than fatal: the loop asks
    `requested()` after each iteration and stops there with a checkpoint. A second Ctrl-C stops at
    once (KeyboardInterrupt), without a new checkpoint. A signal the process inherited as ignored
    stays ignored (a run started with nohup)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, processes):
        self.processes = processes
        self.received: int | None = None
        self.previous: dict[int, Callable[[int, FrameType | None], Any] | int | signal.Handlers | None] = {}

    def __enter__(self) -> StopRequests:
        for number in self.SIGNALS:
            try:
                current = signal.getsignal(number)
                if current is not signal.SIG_IGN:
                    self.previous[number] = signal.signal(number, self._note)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def __exit__(self, *exc) -> None:
        for number, handler in self.previous.items():
            signal.signal(number, handler)

    def _note(self, number, frame) -> None:
        if number == signal.SIGINT and self.received is not None:
            raise KeyboardInterrupt
        self.received = number
        if number == signal.SIGINT:
            print("\nrlkit run: Ctrl-C: stopping after this iteration with a checkpoint (Ctrl-C again stops at once, "
                  "without one)", flush=True, file=sys.stderr)

    def requested(self) -> int | None:
        """The signal that asks to stop, agreed by every process (any one that got it stops them all)."""
        return max(n or 0 for n in self.processes.gather_objects(self.received)) or None
