"""A soak test: a real `rlkit run` of many short iterations, its resident memory sampled as it goes;
memory must not grow with the iterations. Bounded to about a minute."""

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a 200-iteration rlkit run

STEPS = 200
# Growth allowed per iteration: the run keeps each iteration's metrics (a few KB measured, 4.1 KB
# on this machine); keeping every rollout batch alive instead measured 28 KB per iteration.
ALLOWED_KB_PER_ITERATION = 16


def resident_kb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    except (FileNotFoundError, ProcessLookupError, StopIteration):
        return None


def lines_in(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def test_resident_memory_does_not_grow_with_iterations(recipe_document, write_recipe):
    output_dir = Path(recipe_document["run"]["output_dir"])
    document = dict(recipe_document,
                    run={**recipe_document["run"], "steps": STEPS, "checkpoint_every": 50, "keep_checkpoints": 1, "sample_every": 25},
                    ppo={"batch_size": 4, "minibatch_size": 4, "epochs": 1}, generator={"max_new_tokens": 4})
    command = [sys.executable, "-m", "rlkit_core.runtime.cli", "run", "--quiet", write_recipe(document)]
    process = subprocess.Popen(command, env={**os.environ, "RLKIT_PLUGINS": "none"}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    samples = []  # (iterations done, resident KB)
    deadline = time.monotonic() + 600
    while process.poll() is None and time.monotonic() < deadline:
        done, kb = lines_in(output_dir / "metrics.jsonl"), resident_kb(process.pid)
        if kb is not None:
            samples.append((done, kb))
        time.sleep(0.02)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr.decode()

    steady = [(done, kb) for done, kb in samples if STEPS // 5 <= done < STEPS]  # after the warm-up, before the final outputs
    sampled = {done for done, _ in steady}  # a loaded machine samples fewer iterations; enough to fit a line
    assert len(sampled) >= 30 and max(sampled) - min(sampled) >= STEPS // 2, f"too few samples to fit: {sorted(sampled)}"
    slope, _ = statistics.linear_regression([done for done, _ in steady], [kb for _, kb in steady])
    assert slope < ALLOWED_KB_PER_ITERATION, f"resident memory grows by {slope:.1f} KB per iteration"
