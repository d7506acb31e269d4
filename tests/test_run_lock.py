"""One run per output folder: real `rlkit run` processes racing for a folder, a SIGKILLed holder
whose lock is taken over, and a two-process torchrun launch, which takes one lock (its main
process's) and verifies checkpoints as one process does."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_faults import wait_for

from rlkit_core.errors import RlkitError
from rlkit_core.runtime import checkpoint
from rlkit_core.runtime.run_lock import LOCK, Holder, RunLock, read_holder, running

ENV = {**os.environ, "RLKIT_PLUGINS": "none"}
RUN = [sys.executable, "-m", "rlkit_core.runtime.cli", "run", "--quiet"]


def recipe_for(recipe_document, write_recipe, output_dir, name="recipe.toml", **run):
    document = dict(recipe_document, run={**recipe_document["run"], "output_dir": str(output_dir), **run})
    return write_recipe(document, name)


def iterations(output_dir):
    return [json.loads(line)["iteration"] for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def test_a_second_lock_on_a_held_folder_names_the_holder(tmp_path):
    first = RunLock(tmp_path / "out")
    assert first.acquire() == ""
    holder = read_holder(tmp_path / "out" / LOCK)
    assert holder == Holder(os.getpid(), socket.gethostname(), holder.started, holder.process_start)
    with pytest.raises(RlkitError) as refused:
        RunLock(tmp_path / "out").acquire()
    assert str(refused.value) == (f"{tmp_path / 'out'} is in use by another run (process {os.getpid()} on {socket.gethostname()}, "
                                  f"started {holder.started}; lock file {tmp_path / 'out' / LOCK}): wait for it to end or stop "
                                  "it, or pick another folder with --set run.output_dir=...")
    first.release()
    assert not (tmp_path / "out").exists()  # the lock made the folder and nothing else used it
    with RunLock(tmp_path / "out") as again:
        assert again.acquire() == ""


def test_staleness_is_judged_by_pid_host_and_the_process_start_time(tmp_path):
    me = Holder.this_process()
    assert running(me)
    assert not running(Holder(me.pid, me.host, me.started, "1"))  # the pid now belongs to a later process
    ended = subprocess.Popen(["true"])
    ended.wait()
    assert not running(Holder(ended.pid, me.host, me.started, None))
    assert running(Holder(ended.pid, "another-host", me.started, None))  # cannot be seen from here: held
    (tmp_path / LOCK).write_text(json.dumps({"pid": ended.pid, "host": "another-host", "started": "then"}))
    with pytest.raises(RlkitError, match=f"rlkit cannot see processes on another-host: if that run has ended, delete {tmp_path / LOCK}"):
        RunLock(tmp_path).acquire()
    (tmp_path / LOCK).write_text("{half a lo")
    with pytest.raises(RlkitError, match="a lock file rlkit cannot read"):
        RunLock(tmp_path).acquire()


GATED_REWARD = '''
import os
import time


def gated(prompts, responses, letter):
    """Scores once the test opens the gate: until then the run that trains holds its folder, however
    slowly the other process starts."""
    deadline = time.monotonic() + 240
    while not os.path.exists(os.environ["RLKIT_TEST_GATE"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [sum(c.islower() for c in r) / 8 for r in responses]
'''


@pytest.mark.slow
def test_two_runs_started_together_into_one_folder_one_trains_the_other_is_refused(recipe_document, write_recipe, tmp_path):
    output_dir, gate = tmp_path / "shared", tmp_path / "gate"
    (tmp_path / "gated_reward.py").write_text(GATED_REWARD)
    recipe_document["reward"] = {"type": "python", "function": f"{tmp_path / 'gated_reward.py'}:gated"}
    recipe = recipe_for(recipe_document, write_recipe, output_dir, steps=3)
    env = {**ENV, "RLKIT_TEST_GATE": str(gate)}
    processes = [subprocess.Popen(RUN + [recipe], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        deadline = time.monotonic() + 300
        while all(p.poll() is None for p in processes):  # the refused one ends; the other waits at the gate
            assert time.monotonic() < deadline, "neither run ended within 300 s"
            time.sleep(0.05)
    finally:
        gate.touch()  # let the other train
    results = [(p, *p.communicate(timeout=300)) for p in processes]
    codes = sorted(p.returncode for p, _, _ in results)
    assert codes == [0, 2], [err[-2000:] for _, _, err in results]
    winner = next(p for p, _, _ in results if p.returncode == 0)
    _, out, err = next(r for r in results if r[0].returncode == 2)
    assert out == "" and "Traceback" not in err
    assert err.startswith(f"rlkit run: {output_dir} is in use by another run (process {winner.pid} on {socket.gethostname()}, started ")
    assert iterations(output_dir) == [1, 2, 3]  # the winner's rows only
    assert not (output_dir / LOCK).exists()


@pytest.mark.slow
def test_a_sigkilled_holders_lock_is_taken_over_with_one_line(recipe_document, write_recipe, tmp_path):
    output_dir = tmp_path / "killed"
    recipe = recipe_for(recipe_document, write_recipe, output_dir, steps=3)
    process = subprocess.Popen(RUN + [recipe], env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(process, lambda: (output_dir / LOCK).exists(), "lock")
    holder = read_holder(output_dir / LOCK)
    assert holder.pid == process.pid
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    assert (output_dir / LOCK).exists()  # SIGKILL leaves it

    result = subprocess.run(RUN + [recipe, "--overwrite"], env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    took = [line for line in result.stderr.splitlines() if "took over" in line]
    assert took == [f"rlkit run: took over the lock of {output_dir} from process {process.pid} on {socket.gethostname()}, "
                    f"started {holder.started}, which is no longer running (it ended without releasing it: a crash or SIGKILL)"]
    assert iterations(output_dir) == [1, 2, 3] and not (output_dir / LOCK).exists()


@pytest.mark.slow
def test_the_lock_is_released_when_a_run_is_stopped_or_fails(recipe_document, write_recipe, tmp_path):
    output_dir = tmp_path / "stopped"
    recipe = recipe_for(recipe_document, write_recipe, output_dir, steps=50)
    process = subprocess.Popen(RUN + [recipe], env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for(process, lambda: (output_dir / "metrics.jsonl").exists(), "first iteration")
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 143, err[-2000:]
    assert not (output_dir / LOCK).exists()
    refused = subprocess.run(RUN + [recipe], env=ENV, capture_output=True, text=True, timeout=300)  # holds a run: exit 2
    assert refused.returncode == 2 and "already holds a run" in refused.stderr
    assert not (output_dir / LOCK).exists()


def torchrun(recipe, *args):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(Path(sys.executable).with_name("rlkit")), "run", "--quiet", recipe, *args]
    return subprocess.Popen(command, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_two_processes_take_one_lock_and_verify_checkpoints_as_one_does(recipe_document, write_recipe, tmp_path):
    output_dir = tmp_path / "two"
    recipe = recipe_for(recipe_document, write_recipe, output_dir, steps=2, checkpoint_every=1)
    launch = torchrun(recipe)
    wait_for(launch, lambda: (output_dir / LOCK).exists(), "lock")
    holder = read_holder(output_dir / LOCK)
    assert holder.pid != launch.pid and running(holder)  # a worker's (the main process's), not the launcher's
    out, err = launch.communicate(timeout=300)
    assert launch.returncode == 0, err[-3000:]
    assert not (output_dir / LOCK).exists()

    latest, previous = checkpoint.complete_checkpoints(output_dir)[::-1]
    (latest / "policy.safetensors").write_bytes(b"")
    resumed = torchrun(recipe, "--resume", "auto")
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-3000:]
    assert [line for line in err.splitlines() if "is damaged" in line] == [
        f"rlkit run: --resume auto: {latest} is damaged (policy.safetensors is 0 bytes, the manifest says "
        f"{(previous / 'policy.safetensors').stat().st_size}); resuming from {previous}, the latest usable one"]
    assert iterations(output_dir) == [1, 2] and checkpoint.damage(latest) is None and not (output_dir / LOCK).exists()


@pytest.mark.slow
def test_a_two_process_launch_into_a_held_folder_is_refused_by_its_main_process(recipe_document, write_recipe, tmp_path):
    output_dir = tmp_path / "held"
    recipe = recipe_for(recipe_document, write_recipe, output_dir, steps=1)
    with RunLock(output_dir) as held:
        held.acquire()
        launch = torchrun(recipe)
        out, err = launch.communicate(timeout=300)
    assert launch.returncode != 0  # torchrun ends the other process with the refused one, and exits 1 itself
    assert f"rlkit run: {output_dir} is in use by another run (process {os.getpid()} on {socket.gethostname()}" in err
    assert err.count("is in use by another run") == 1 and not (output_dir / "metrics.jsonl").exists()
