"""`[scheduler] workers = "processes"`: the producer's workers in processes of their own
(`rlkit_core.runtime.producer_processes`). The weights they sample with are the ones pushed, and a
worker process that dies, hangs or cannot start ends the run located, leaving no process behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from rlkit_core.errors import RecipeError
from rlkit_core.launch import Launch
from rlkit_core.recipe.document import parse_recipe
from rlkit_core.runtime.forward import response_view, rows_of
from rlkit_core.runtime.producer_processes import ProcessWorker, load, pack, unpack
from rlkit_core.runtime.push_check import WeightPushFailed
from rlkit_core.runtime.scheduling import Producer, ProducerFault, Stalled
from tests.test_trainer import make_trainer

AHEAD = {"scheduler__max_staleness": 1, "scheduler__workers": "processes", "loss__tis_cap": 2.0, "loss__is_level": "sequence"}


def test_pack_puts_each_dtype_in_one_buffer_and_unpack_gives_the_same_tensors():
    state = {"w": torch.arange(6.0).view(2, 3), "b": torch.tensor([7.0, 8.0]), "steps": torch.tensor(5),
             "ids": torch.tensor([[1, 2], [3, 4]]), "half": torch.ones(3, dtype=torch.bfloat16)}
    packed = pack(state)
    assert {dtype: buffer.tolist() for dtype, buffer in packed.buffers.items()} == {
        torch.float32: [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 7.0, 8.0], torch.int64: [5, 1, 2, 3, 4], torch.bfloat16: [1.0, 1.0, 1.0]}
    assert packed.layout[1] == ("b", torch.float32, 6, (2,)) and packed.layout[2] == ("steps", torch.int64, 0, ())
    assert packed.sums.tolist() == [15.0, 15.0, 5.0, 10.0, 3.0]
    back = unpack(packed)
    assert list(back) == list(state) and all(back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in state.items())
    state["w"][0, 0] = 100.0  # a copy: the trainer's later writes do not reach what was pushed
    assert back["w"][0, 0] == 0.0


def _logprobs(trainer, batch):
    logprobs, _, _, _ = response_view(trainer.components, batch, rows_of(batch, trainer.recipe.ppo.pack_sequences), grad=False)
    return logprobs[batch.response_mask.bool()]


@pytest.mark.parametrize("style", ["byt5", "gpt2"])
def test_a_worker_process_samples_with_the_weights_last_pushed_to_it(recipe_document, builtin_registry, tmp_path, style):
    """`gpt2`: a pad-less BPE tokenizer, to which the policy adds a suppressed PAD row, in the
    worker's build as in the trainer's."""
    if style == "gpt2":
        from rlkit_core.testing.offline_models import write_tiny_model

        recipe_document["policy"]["model"] = str(write_tiny_model(tmp_path / "gpt2-style", "gpt2"))
    trainer = make_trainer(recipe_document, builtin_registry, **AHEAD)
    model = trainer.components.policy.model
    start = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    worker = ProcessWorker(trainer.recipe, 0, 0, torch.device("cpu"), threads=1)
    records = trainer.stream_records(0)
    torch.manual_seed(1)
    try:
        worker.wait_ready(120)
        for version, push in ((1, True), (2, True), (2, False)):  # two pushes, then a batch on the weights it holds
            if push:
                with torch.no_grad():
                    for parameter in model.parameters():
                        parameter.add_(torch.randn_like(parameter) * 0.05)
            weights = pack(model.state_dict()) if push else None
            batch, metrics = worker.rollout(version, version, weights, records, trainer.prompts.max_tokens)
            assert "time/generate" in metrics
            assert torch.allclose(batch.sampled_logprobs[batch.response_mask.bool()], _logprobs(trainer, batch), atol=1e-4)
            pushed = {name: tensor.clone() for name, tensor in model.state_dict().items()}
            model.load_state_dict(start)  # the starting weights would have sampled other log-probs: the test can fail
            assert (batch.sampled_logprobs[batch.response_mask.bool()] - _logprobs(trainer, batch)).abs().max() > 1e-2
            model.load_state_dict(pushed)
    finally:
        worker.close(wait=True)
    assert worker.process.exitcode == 0  # it stopped when asked


DIES = '''
import os, time

def dies_on_the_second_batch(prompts, responses, letter):
    calls = int(open({counter!r}).read()) + 1
    open({counter!r}, "w").write(str(calls))
    if calls == 2 and os.getpid() != {trainer}:
        {how}
    return [sum(c.islower() for c in r) / 8 for r in responses]
'''


@pytest.mark.parametrize("how, said", [("os._exit(3)", "exited with code 3"), ("os.kill(os.getpid(), 9)", "was killed by SIGKILL"),
                                       ("time.sleep(600)", "no rollout batch for iteration")])
def test_a_worker_process_that_dies_or_hangs_ends_the_run_located_and_is_gone(recipe_document, builtin_registry, tmp_path, how, said):
    counter, reward = tmp_path / "calls.txt", tmp_path / "dies.py"
    counter.write_text("0")
    reward.write_text(DIES.format(counter=str(counter), trainer=os.getpid(), how=how))
    recipe_document["reward"] = {"type": "python", "function": f"{reward}:dies_on_the_second_batch"}
    trainer = make_trainer(recipe_document, builtin_registry, **AHEAD, scheduler__wait_timeout_s=5.0, run__steps=4)
    started = time.monotonic()
    try:
        with pytest.raises(ProducerFault, match=said) as raised:
            for _ in range(4):
                trainer.iterate()
        producer = trainer.source
        assert isinstance(producer, Producer)
        [worker] = producer.workers
        assert worker.remote is not None
        process = worker.remote.process
    finally:
        trainer.close()
    assert time.monotonic() - started < 60
    if how.startswith("time"):
        assert isinstance(raised.value, Stalled)
    else:
        assert re.search(r"the producer's worker 0 failed on the batch of iteration 2 \(weights after \d updates\) while making the "
                         r"batch in its process", str(raised.value))
    assert not running_within(10, process.pid)


def running_within(seconds: float, pid: int) -> bool:
    """Whether process `pid` still runs `seconds` from now, as /proc says (a zombie has ended; which
    thread of this process reaped it does not matter)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(") ")[2][:1]
        except FileNotFoundError:
            return False
        if state in ("Z", "X"):
            return False
        if time.monotonic() > deadline:
            return True
        time.sleep(0.1)


FAILS_TO_BUILD = '''
import os

if os.getpid() != {trainer}:
    raise RuntimeError("no reward service reachable from here")

def lowercase_share(prompts, responses, letter):
    return [sum(c.islower() for c in r) / 8 for r in responses]
'''


def test_a_worker_process_that_cannot_build_the_components_says_why(recipe_document, builtin_registry, tmp_path):
    reward = tmp_path / "here_only.py"
    reward.write_text(FAILS_TO_BUILD.format(trainer=os.getpid()))
    recipe_document["reward"] = {"type": "python", "function": f"{reward}:lowercase_share"}
    trainer = make_trainer(recipe_document, builtin_registry, **AHEAD)
    try:
        with pytest.raises(ProducerFault, match="(?s)worker 0 could not start: its process raised .*while building the recipe's "
                                                "components.*no reward service reachable from here"):
            trainer.iterate()
    finally:
        trainer.close()


@pytest.mark.parametrize("changes, launch, said", [
    ({"max_staleness": 0, "workers": "processes"}, Launch(), "set max_staleness >= 1"),
    ({"max_staleness": 1, "workers": "forks"}, Launch(), "threads"),
])
def test_workers_in_processes_are_refused_where_they_cannot_run(recipe_document, builtin_registry, changes, launch, said):
    recipe_document.update(scheduler=changes, loss={"type": "ppo-clip", "tis_cap": 2.0})
    with pytest.raises(RecipeError, match=said) as raised:
        parse_recipe(recipe_document, builtin_registry, launch=launch)
    assert "$.scheduler.workers" in str(raised.value)


@pytest.mark.slow
def test_a_worker_process_busy_in_a_call_ends_when_its_trainer_is_sigkilled(recipe_document, write_recipe, tmp_path, monkeypatch):
    from tests.test_scheduling import gone_within, processes_with_environment

    counter, reward = tmp_path / "calls.txt", tmp_path / "dies.py"
    counter.write_text("0")
    reward.write_text(DIES.format(counter=str(counter), trainer=0, how="time.sleep(600)"))  # every worker's second batch hangs
    recipe_document["reward"] = {"type": "python", "function": f"{reward}:dies_on_the_second_batch"}
    recipe_document.update(scheduler={"max_staleness": 1, "workers": "processes"}, loss={"type": "ppo-clip", "tis_cap": 2.0})
    monkeypatch.setenv("RLKIT_TEST_RUN", str(tmp_path))
    trainer = subprocess.Popen([str(Path(sys.executable).with_name("rlkit")), "run", write_recipe(recipe_document), "--quiet"],
                               cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while counter.read_text() != "2" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert counter.read_text() == "2"  # the worker is in its second batch's reward, sleeping
    workers = [pid for pid in processes_with_environment("RLKIT_TEST_RUN", str(tmp_path)) if pid != trainer.pid]
    assert workers
    os.kill(trainer.pid, signal.SIGKILL)
    trainer.wait()
    assert gone_within(10, "RLKIT_TEST_RUN", str(tmp_path))


def test_a_component_class_another_process_cannot_import_is_named(recipe_document, builtin_registry):
    from rlkit_plugins.rewards import PythonReward, PythonRewardConfig

    from rlkit_core import hookimpl
    from rlkit_core.recipe.plugins import load_registry

    class LocalReward(PythonReward):  # defined in a function: a spawned process cannot import it
        pass

    class Plugin:
        @hookimpl
        def register_rewards(self, register):
            register("local-reward", LocalReward, PythonRewardConfig)

    registry = load_registry(environ={"RLKIT_PLUGINS": "none"}, extra_plugins=[("local", Plugin(), "tests", "0")])
    recipe_document["reward"]["type"] = "local-reward"
    trainer = make_trainer(recipe_document, registry, **AHEAD)
    try:
        with pytest.raises(RecipeError, match=r"\$\.scheduler\.workers: workers = 'processes' sends the recipe .*LocalReward"):
            trainer.iterate()
    finally:
        trainer.close()


class IgnoresLoads(torch.nn.Linear):
    def load_state_dict(self, state_dict, strict=True, assign=False):  # a module that keeps its own weights
        return torch.nn.modules.module._IncompatibleKeys([], [])


def test_weights_that_did_not_land_in_the_workers_policy_stop_it_named():
    policy = types.SimpleNamespace(model=IgnoresLoads(3, 2), weights_version=0)
    pushed = {name: tensor + 1.0 for name, tensor in policy.model.state_dict().items()}
    with pytest.raises(WeightPushFailed, match="the weights after 4 updates did not land in the worker's policy: its tensors weight, bias"):
        load(policy, 4, pack(pushed))
    assert policy.weights_version == 0
    fine = types.SimpleNamespace(model=torch.nn.Linear(3, 2), weights_version=0)
    load(fine, 4, pack(pushed))
    assert fine.weights_version == 4 and torch.equal(fine.model.weight, pushed["weight"])


def test_a_worker_builds_every_component_but_the_critic(recipe_document, builtin_registry, tmp_path):
    from rlkit_core.context import BuildContext
    from rlkit_core.recipe.assemble import build_components

    recipe = parse_recipe(recipe_document, builtin_registry)
    context = BuildContext(recipe=recipe, device=torch.device("cpu"), output_dir=str(tmp_path), seed=0)
    assert build_components(recipe, context).value_head is not None
    parts = build_components(recipe, BuildContext(recipe=recipe, device=torch.device("cpu"), output_dir=str(tmp_path), seed=0),
                             with_critic=False)
    assert parts.value_head is None and parts.reward is not None and parts.generator is not None


def test_every_workers_components_are_seeded_apart_from_the_trainers_and_each_others():
    """An engine seeds its sampling from its context's seed plus SEED_STRIDE times the trainer
    process's index (vLLM's `sampling_seed`): no two of the trainer's and the workers' meet."""
    from rlkit_core.randomness import SEED_STRIDE, sampling_seed
    from rlkit_core.runtime.producer_processes import worker_seed

    trainers = [sampling_seed(3, index) for index in range(8)]
    workers = [sampling_seed(worker_seed(3, number), index) for number in range(4) for index in range(8)]
    assert len(set(trainers + workers)) == len(trainers) + len(workers)
    assert worker_seed(3, 0) == 3 + SEED_STRIDE * 256  # by hand: ENGINE_PROCESSES strides past the run seed
    assert sampling_seed(worker_seed(10**8, 14), 255) < 2**32  # vLLM's seeds are 32-bit


KILLED_UNDER_TORCHRUN = '''
import multiprocessing, os, signal

calls = 0

def killed_in_the_second_trainers_worker(prompts, responses, letter):
    global calls
    calls += 1
    if multiprocessing.parent_process() is not None and os.environ["RANK"] == "1" and calls == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return [sum(c.islower() for c in r) / 8 for r in responses]
'''


@pytest.mark.slow
def test_a_worker_process_killed_under_two_trainer_processes_ends_both_located(recipe_document, write_recipe, tmp_path,
                                                                                monkeypatch):
    """Its trainer process names the SIGKILL; the other's worker loses its group's peer mid-batch
    and its trainer process names that. Both checkpoint and exit, and no process is left."""
    from tests.test_scheduling import gone_within

    reward = tmp_path / "killed.py"
    reward.write_text(KILLED_UNDER_TORCHRUN)
    recipe_document["reward"] = {"type": "python", "function": f"{reward}:killed_in_the_second_trainers_worker"}
    recipe_document["run"]["steps"] = 6
    recipe_document.update(scheduler={"max_staleness": 1, "workers": "processes"}, loss={"type": "ppo-clip", "tis_cap": 2.0})
    monkeypatch.setenv("RLKIT_TEST_RUN", str(tmp_path))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(Path(sys.executable).with_name("rlkit")), "run", write_recipe(recipe_document), "--quiet"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode != 0
    said = [line for line in done.stderr.splitlines() if line.startswith("rlkit run: the producer's worker 0 failed")]
    assert len(said) == 2, done.stderr[-3000:]
    assert any("its process" in line and "was killed by SIGKILL" in line for line in said)
    assert all("saved" in line and "continue with --resume auto" in line for line in said)
    assert gone_within(10, "RLKIT_TEST_RUN", str(tmp_path))
