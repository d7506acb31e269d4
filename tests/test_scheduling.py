"""`[scheduler]`: batches made ahead of the update (`rlkit_core.runtime.scheduling`). At bound 0
the producer reproduces `sync` to the last digit; above it, no trained batch is staler than the
bound whatever the timing, every iteration trains its own prompts, and a stall ends the run with a
checkpoint instead of a hang."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import attrs
import pytest
import torch

from rlkit_core.errors import RecipeDeprecation, RecipeError
from rlkit_core.messages import Step
from rlkit_core.recipe.document import parse_recipe
from rlkit_core.runtime import scheduling
from rlkit_core.runtime.batch_sources import SyncSource
from tests.test_trainer import make_trainer

SLOW_REWARD = '''
import random, time

def jittery(prompts, responses, letter):
    """The lowercase share, after a wait of 0 to {most} s drawn from its own random stream."""
    time.sleep(random.Random(len(prompts) + sum(map(len, responses))).uniform(0, {most}))
    return [sum(c.islower() for c in r) / 8 for r in responses]

def stalls(prompts, responses, letter):
    """The lowercase share, but from the third batch on it never answers in time."""
    calls = int(open("{counter}").read() or 0) + 1
    open("{counter}", "w").write(str(calls))
    if calls >= 3:
        time.sleep(60)
    return [sum(c.islower() for c in r) / 8 for r in responses]
'''


def without_timing(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith(("time/", "async/")) and k != "time/weight_sync"}


def test_bounded_at_staleness_zero_is_sync_to_the_last_digit(recipe_document, builtin_registry):
    sync = make_trainer(json.loads(json.dumps(recipe_document)), builtin_registry, run__steps=3)
    expected = [without_timing(sync.step()) for _ in range(3)]
    ahead = make_trainer(recipe_document, builtin_registry, run__steps=3, scheduler__type="bounded", scheduler__max_staleness=0)
    try:
        got = [ahead.step() for _ in range(3)]
    finally:
        ahead.close()
    assert [without_timing(m) for m in got] == expected
    assert all(m["async/staleness"] == 0 for m in got)


def test_bounded_at_staleness_zero_is_sync_on_a_multi_turn_recipe(recipe_document, builtin_registry, tmp_path):
    from tests.test_episodes import ending_model, episode_document

    document = episode_document(recipe_document, ending_model(tmp_path / "ending"))
    sync = make_trainer(json.loads(json.dumps(document)), builtin_registry)
    expected = [without_timing(sync.step()) for _ in range(2)]
    ahead = make_trainer(document, builtin_registry, scheduler__type="bounded")
    try:
        assert [without_timing(ahead.step()) for _ in range(2)] == expected
    finally:
        ahead.close()


@pytest.mark.parametrize("kind, bound", [("", 1), ("", 2), ("", 3), ("one-step-off", 1), ("bounded", 2)])
def test_no_trained_batch_is_staler_than_the_bound_under_a_jittery_reward(recipe_document, builtin_registry, tmp_path, kind, bound):
    reward = tmp_path / "slow.py"
    reward.write_text(SLOW_REWARD.format(most=0.05, counter=tmp_path / "unused"))
    recipe_document["reward"] = {"type": "python", "function": f"{reward}:jittery"}
    changes = {"scheduler__type": kind, "loss__tis_cap": 2.0, "run__steps": 6}  # "": max_staleness alone; else the earlier names
    if kind != "one-step-off":
        changes["scheduler__max_staleness"] = bound
    trainer = make_trainer(recipe_document, builtin_registry, **changes)
    sync_prompts = [trainer.stream_records(i) for i in range(6)]
    try:
        rows = [trainer.iterate() for _ in range(6)]
    finally:
        trainer.close()
    staleness = [row.metrics["async/staleness"] for row in rows]
    assert all(0 <= s <= bound for s in staleness) and max(staleness) >= 1  # it did run ahead
    for records, row in zip(sync_prompts, rows):  # each iteration trained its own prompts
        assert row.batch.prompts == [r["prompt"] for r in records for _ in range(trainer.recipe.ppo.samples_per_prompt)]


PID_REWARD = '''
import os

def lowercase_share_here(prompts, responses, letter):
    """The lowercase share, noting the process that scored."""
    with open({pids!r}, "a") as out:
        out.write(f"{{os.getpid()}}\\n")
    return [sum(c.islower() for c in r) / 8 for r in responses]
'''


@pytest.mark.parametrize("bound", [1, 2])
def test_workers_in_processes_of_their_own_make_every_batch_with_the_pushed_weights(recipe_document, builtin_registry, tmp_path, bound):
    pids = tmp_path / "pids.txt"
    reward = tmp_path / "here.py"
    reward.write_text(PID_REWARD.format(pids=str(pids)))
    recipe_document["reward"] = {"type": "python", "function": f"{reward}:lowercase_share_here"}
    trainer = make_trainer(recipe_document, builtin_registry, scheduler__max_staleness=bound, scheduler__workers="processes",
                           loss__tis_cap=2.0, loss__is_level="sequence", run__steps=5)
    sync_prompts = [trainer.stream_records(i) for i in range(5)]
    try:
        rows = [trainer.iterate() for _ in range(5)]
        producer = trainer.source
        assert isinstance(producer, scheduling.Producer)
        workers = [worker.remote.process for worker in producer.workers if worker.remote is not None]
    finally:
        trainer.close()
    assert len(workers) == bound and not any(process.is_alive() for process in workers)  # ended with the producer
    scorers = set(map(int, pids.read_text().split()))
    assert scorers == {process.pid for process in workers} and os.getpid() not in scorers
    staleness = [row.metrics["async/staleness"] for row in rows]
    assert all(0 <= s <= bound for s in staleness) and max(staleness) >= 1
    for records, row in zip(sync_prompts, rows):
        assert row.batch.prompts == [r["prompt"] for r in records for _ in range(trainer.recipe.ppo.samples_per_prompt)]


def test_a_batch_staler_than_the_bound_is_made_again(recipe_document, builtin_registry):
    trainer = make_trainer(recipe_document, builtin_registry, scheduler__max_staleness=1, loss__tis_cap=2.0)
    try:
        trainer.step()
        producer = trainer.source
        assert isinstance(producer, scheduling.Producer)
        with producer.changed:  # batch 2, sampled by version 1 (or 0): move it back three versions
            assert producer.changed.wait_for(lambda: 1 in producer.done, timeout=30)
            producer.done[1].version -= 3
        metrics = trainer.step()
    finally:
        trainer.close()
    assert metrics["async/regenerated"] == 1 and metrics["async/staleness"] == 0


@pytest.mark.parametrize("name, bound", [("sync", 0), ("one-step-off", 1), ("bounded", 2)])
def test_the_earlier_scheduler_names_still_work_with_a_warning_naming_max_staleness(recipe_document, builtin_registry, name, bound):
    recipe_document["scheduler"] = {"type": name, **({"max_staleness": 2} if name == "bounded" else {})}
    recipe_document["loss"] = {"type": "ppo-clip", "tis_cap": 2.0}
    with pytest.warns(RecipeDeprecation, match=f"scheduler.type = '{name}' is deprecated: write max_staleness"):
        recipe = parse_recipe(recipe_document, builtin_registry)
    assert recipe.scheduler.staleness_bound == bound and recipe.scheduler.runs_ahead == (bound > 0)


def test_max_staleness_zero_is_sync_without_a_producer(recipe_document, builtin_registry):
    trainer = make_trainer(recipe_document, builtin_registry, scheduler__max_staleness=0)
    trainer.step()
    assert isinstance(trainer.source, SyncSource)


@pytest.mark.parametrize("changes, where", [
    ({"scheduler__max_staleness": 2}, r"\$\.loss: a batch may be 2 policy version\(s\) old"),
    ({"scheduler__max_staleness": 1, "loss__tis_cap": 2.0, "generator__top_p": 0.9}, r"\$\.generator: top_k/top_p"),
    ({"scheduler__type": "one-step-off", "scheduler__max_staleness": 3, "loss__tis_cap": 2.0},
     r"\$\.scheduler\.type: 'one-step-off' is the earlier name of max_staleness = 1, and max_staleness = 3 is set too"),
    ({"scheduler__max_staleness": 2, "ppo__dynamic_sampling": True, "ppo__samples_per_prompt": 4, "advantage__type": "grpo",
      "value_head__type": "none"}, r"\$\.scheduler\.max_staleness: max_staleness = 2 makes one rollout batch"),
    ({"scheduler__type": "bounded", "ppo__dynamic_sampling": True, "ppo__samples_per_prompt": 4, "advantage__type": "grpo",
      "value_head__type": "none"}, r"\$\.scheduler\.type: type = 'bounded' makes one rollout batch"),
])
def test_what_a_scheduler_ahead_of_the_update_needs_is_checked_before_the_run(recipe_document, builtin_registry, changes, where):
    for key, value in changes.items():
        table, name = key.split("__")
        recipe_document.setdefault(table, {})[name] = value
    with pytest.raises(RecipeError, match=where):
        parse_recipe(recipe_document, builtin_registry)


def test_the_decoupled_loss_with_the_proximal_policy_as_the_behaviour_one_is_ppo_clip(recipe_document, builtin_registry):
    from rlkit_core.testing import rollout_batch
    from tests.test_critic_free import build_loss
    from tests.test_loss_mask import loss_and_gradients

    batch = rollout_batch()
    batch = batch.with_(sampled_logprobs=batch.old_logprobs.clone())  # π_prox = π_behaviour
    plain, decoupled = build_loss(recipe_document, builtin_registry), build_loss(recipe_document, builtin_registry, tis_cap=2.0)
    count = float(batch.loss_mask.sum())
    (terms, gradients), (same, same_gradients) = loss_and_gradients(plain, batch, count), loss_and_gradients(decoupled, batch, count)
    assert all(torch.equal(terms.losses[name], same.losses[name]) for name in terms.losses)
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(gradients, same_gradients))


def test_the_decoupled_weights_by_hand(recipe_document, builtin_registry):
    from rlkit_core.interfaces import LossInputs
    from rlkit_core.testing import rollout_batch
    from tests.test_critic_free import build_loss

    # one response of two tokens, advantages 1; π_θ = π_prox (ratio 1, inside the clip), behaviour
    # log-probs 0.5 and 2 nats below: weights min(e^0.5, 2) = 1.6487 and min(e^2, 2) = 2
    loss = build_loss(recipe_document, builtin_registry, tis_cap=2.0)
    proximal = torch.tensor([[-1.0, -1.0]])
    batch = rollout_batch(with_values=False).select(torch.tensor([0])).with_(
        response_mask=torch.ones(1, 2, dtype=torch.long), loss_mask=torch.ones(1, 2, dtype=torch.long), old_logprobs=proximal,
        sampled_logprobs=proximal - torch.tensor([[0.5, 2.0]]), advantages=torch.ones(1, 2))
    terms = loss(batch, LossInputs(logprobs=proximal.clone(), values=None, entropy=torch.zeros(1, 2)), token_count=2.0)
    assert float(terms.losses["policy"]) == pytest.approx(-(1.6487212707 + 2.0) / 2, abs=1e-6)


def rlkit(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).with_name("rlkit")), *args], capture_output=True, text=True, timeout=timeout, cwd=cwd)


@pytest.mark.slow
def test_a_stalled_reward_ends_the_run_with_a_checkpoint_not_a_hang(recipe_document, write_recipe, tmp_path):
    reward, counter = tmp_path / "stall.py", tmp_path / "calls.txt"
    counter.write_text("0")
    reward.write_text(SLOW_REWARD.format(most=0, counter=counter))
    recipe_document["reward"] = {"type": "python", "function": f"{reward}:stalls"}
    recipe_document["run"].update(steps=4)
    recipe_document["scheduler"] = {"max_staleness": 1, "wait_timeout_s": 3.0}
    recipe_document["loss"] = {"type": "ppo-clip", "tis_cap": 2.0}
    started = time.monotonic()
    done = rlkit("run", write_recipe(recipe_document), "--quiet", cwd=tmp_path)
    assert time.monotonic() - started < 120 and done.returncode != 0
    assert "no rollout batch for iteration 3 within scheduler.wait_timeout_s = 3 s" in done.stderr, done.stderr[-2000:]
    assert "continue with --resume auto" in done.stderr
    assert (Path(recipe_document["run"]["output_dir"]) / "checkpoints" / "iter_000002").is_dir()


@pytest.mark.slow
@pytest.mark.parametrize("workers", ["threads", "processes"])
@pytest.mark.parametrize("episodes", ["single-turn", "multi-turn"])
def test_killed_mid_run_and_resumed_it_trains_every_prompt_once_in_order(recipe_document, write_recipe, tmp_path, monkeypatch,
                                                                         episodes, workers):
    """SIGKILLed twice with batches made ahead in flight (and, multi-turn, episodes part-played by the
    workers): the resumed run trains each iteration's prompts once, in order, as an uninterrupted one.
    No worker process outlives its killed trainer."""
    monkeypatch.setenv("RLKIT_TEST_RUN", str(tmp_path))  # inherited by the runs and their workers
    if episodes == "multi-turn":
        from tests.test_episodes import ending_model, episode_document

        episode_document(recipe_document, ending_model(tmp_path / "ending"))
    else:
        reward = tmp_path / "slow.py"
        reward.write_text(SLOW_REWARD.format(most=0.2, counter=tmp_path / "unused"))
        recipe_document["reward"] = {"type": "python", "function": f"{reward}:jittery"}
    recipe_document["scheduler"] = {"max_staleness": 2, "workers": workers}
    expected, trained = prompts_trained_whole_and_killed(recipe_document, write_recipe, tmp_path, steps=6)
    assert trained == expected  # every iteration's prompts, each once, in order


def processes_with_environment(name: str, value: str) -> list[int]:
    """The living processes (not this one, nor a zombie) whose environment sets `name` to `value`."""
    found, marker = [], f"{name}={value}".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:  # ended meanwhile, or not ours to read
                pass
    return found


def gone_within(seconds: float, name: str, value: str) -> bool:
    """Whether every process marked `name=value` in its environment ends within `seconds`."""
    deadline = time.monotonic() + seconds
    while processes_with_environment(name, value):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def prompts_trained_whole_and_killed(recipe_document, write_recipe, tmp_path, steps: int, wait_s: float = 120) -> tuple[list, list]:
    """`data/prompts_crc` of each iteration of an uninterrupted run, and of the same run SIGKILLed
    after 2 and then after 4 logged iterations (resumed with `--resume auto` each time) and finished."""
    recipe_document["run"].update(steps=steps, checkpoint_every=1)
    recipe_document["loss"] = {"type": "ppo-clip", "tis_cap": 2.0}
    whole_dir = tmp_path / "whole"
    recipe_document["run"]["output_dir"] = str(whole_dir)
    done = rlkit("run", write_recipe(recipe_document, "whole.toml"), "--quiet", cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    expected = [row["data/prompts_crc"] for row in map(json.loads, (whole_dir / "metrics.jsonl").read_text().splitlines())
                if "data/prompts_crc" in row]
    assert len(expected) == steps and len(set(expected)) == steps

    killed_dir = tmp_path / "killed"
    recipe_document["run"]["output_dir"] = str(killed_dir)
    recipe = write_recipe(recipe_document, "killed.toml")
    for kill_after, resume in ((2, []), (4, ["--resume", "auto"])):  # iterations logged before the SIGKILL, batches made ahead
        process = subprocess.Popen([str(Path(sys.executable).with_name("rlkit")), "run", recipe, "--quiet", *resume],
                                   cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        log = killed_dir / "metrics.jsonl"
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and (not log.exists() or log.read_text().count("data/prompts_crc") < kill_after):
            time.sleep(0.05)
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        if marked := os.environ.get("RLKIT_TEST_RUN"):  # nothing the killed run started outlives it
            assert gone_within(10, "RLKIT_TEST_RUN", marked)
    done = rlkit("run", recipe, "--quiet", "--resume", "auto", cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in (killed_dir / "metrics.jsonl").read_text().splitlines()]
    return expected, [row["data/prompts_crc"] for row in rows if "data/prompts_crc" in row]


def test_a_failed_batch_made_ahead_is_raised_where_sync_raises_it_and_the_next_one_follows(recipe_document, builtin_registry,
                                                                                            tmp_path):
    from rlkit_core.runtime.faults import BadReward

    counter = tmp_path / "calls.txt"
    counter.write_text("0")
    reward = tmp_path / "fails.py"
    reward.write_text(f"def second_fails(prompts, responses, letter):\n"
                      f"    calls = int(open({str(counter)!r}).read()) + 1\n"
                      f"    open({str(counter)!r}, 'w').write(str(calls))\n"
                      f"    if calls == 2:\n"
                      f"        raise ValueError('the service is down')\n"
                      f"    return [0.5] * len(responses)\n")
    recipe_document["reward"] = {"type": "python", "function": f"{reward}:second_fails"}
    trainer = make_trainer(recipe_document, builtin_registry, scheduler__max_staleness=1, loss__tis_cap=2.0, run__steps=3)
    try:
        trainer.step()
        with pytest.raises(BadReward, match="the service is down"):
            trainer.iterate()
        trainer.skip_iteration()  # what run.on_bad_reward = "skip" does
        third = trainer.iterate()
    finally:
        trainer.close()
    assert third.batch.prompts[0] == trainer.stream_records(2)[0]["prompt"] and third.metrics["async/staleness"] <= 1


def test_episodes_made_one_step_off_train_their_own_prompts(recipe_document, builtin_registry, tmp_path):
    from tests.test_episodes import ending_model, episode_document

    document = episode_document(recipe_document, ending_model(tmp_path / "ending"))
    trainer = make_trainer(document, builtin_registry, scheduler__max_staleness=1, loss__tis_cap=2.0)
    try:
        rows = [trainer.iterate() for _ in range(3)]
    finally:
        trainer.close()
    assert all(row.metrics["async/staleness"] <= 1 for row in rows)
    for iteration, row in enumerate(rows):
        assert row.batch.columns["secret"] == [r["secret"] for r in trainer.stream_records(iteration)]
        assert row.metrics["env/turns"] > 1 and row.batch.turn_rewards is not None


def test_every_turn_made_ahead_is_labelled_with_the_weights_that_sampled_it(recipe_document, builtin_registry, tmp_path):
    """`Reply.weights_version` (what the agent endpoint answers with) of each episode's turns is the
    version its batch was made from: the iteration trained minus its staleness."""
    from tests.test_episodes import ending_model, episode_document

    document = episode_document(recipe_document, ending_model(tmp_path / "ending"))
    trainer = make_trainer(document, builtin_registry, scheduler__max_staleness=1, loss__tis_cap=2.0)
    environment = trainer.components.environment
    # the producer makes up to two batches past the last one trained: their episodes are labelled too
    iteration_of = {id(record): iteration for iteration in range(6) for record in trainer.stream_records(iteration)}
    seen: dict[int, set[int]] = {iteration: set() for iteration in range(6)}
    reset, step = environment.reset, environment.step

    def labelled_reset(record, seed):
        opened = reset(record, seed)
        return attrs.evolve(opened, state=(iteration_of[id(record)], opened.state))

    def recorded_step(state, reply):
        seen[state[0]].add(reply.weights_version)
        return step(state[1], reply)

    environment.reset, environment.step = labelled_reset, recorded_step
    try:
        rows = [trainer.iterate() for _ in range(3)]
    finally:
        trainer.close()
    assert [seen[iteration] for iteration in range(3)] == [{iteration - int(row.metrics["async/staleness"])} for iteration, row in enumerate(rows)]
    assert trainer.components.policy.weights_version == 3  # the trainer's own weights, after three iterations


@pytest.mark.slow
def test_two_processes_make_batches_ahead_with_the_prompts_of_sync(recipe_document, write_recipe, tmp_path):
    """Under torchrun each process runs its workers; each worker's collectives (the reward's
    gathered problems) go over a process group of its own, beside the update's all-reduces: a
    thread's group, or with workers in processes, a group of the same worker's processes. Under
    FSDP the weights are gathered whole for the worker processes at each push."""
    from tests import fsdp_on_cpu
    from tests.test_scaling import FSDP_ON_CPU, rlkit_script, torchrun

    recipe_document["run"].update(steps=3)
    crcs = {}
    for name, scheduler in (("sync", {"max_staleness": 0}), ("ahead", {"max_staleness": 1}),
                            ("bounded", {"max_staleness": 2}),  # two workers, a process group each
                            ("processes", {"max_staleness": 2, "workers": "processes"}),
                            ("fsdp", {"max_staleness": 2, "workers": "processes"})):
        recipe_document["run"]["output_dir"] = str(tmp_path / name)
        recipe_document["scheduler"] = scheduler
        recipe_document["loss"] = {"type": "ppo-clip", "tis_cap": 2.0}
        recipe = write_recipe(recipe_document, f"{name}.toml")
        if name == "fsdp":
            torchrun(str(FSDP_ON_CPU), "rlkit", "run", recipe, "--quiet", environment=fsdp_on_cpu.launch_environment())
        else:
            torchrun(rlkit_script(), "run", recipe, "--quiet")
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        crcs[name] = [row["data/prompts_crc"] for row in rows if "data/prompts_crc" in row]
        if name != "sync":
            assert all(row["async/staleness"] <= scheduler.get("max_staleness", 1) for row in rows if "async/staleness" in row)
    assert len(crcs["sync"]) == 3 and crcs["ahead"] == crcs["sync"] and crcs["bounded"] == crcs["sync"]
    assert crcs["processes"] == crcs["sync"] and crcs["fsdp"] == crcs["sync"]


def test_a_scheduler_ahead_of_the_update_under_fsdp_needs_worker_processes(recipe_document, builtin_registry):
    from rlkit_core.launch import Launch

    recipe_document["scheduler"] = {"max_staleness": 1}
    recipe_document["loss"] = {"type": "ppo-clip", "tis_cap": 2.0}
    fsdp = Launch(processes=2, sharded=True, fsdp_version=2)
    with pytest.raises(RecipeError, match=r"\$\.scheduler\.max_staleness: max_staleness = 1 samples while the update runs, and FSDP"
                                          r".*set scheduler\.workers = 'processes'"):
        parse_recipe(recipe_document, builtin_registry, launch=fsdp)
    recipe_document["scheduler"]["workers"] = "processes"  # they are sent the whole weights
    parse_recipe(recipe_document, builtin_registry, launch=fsdp)


@pytest.mark.parametrize("fails", ["push", "generation", "generation stalls"])
def test_a_failed_push_or_generation_ends_the_run_located_with_a_checkpoint(recipe_document, builtin_registry, monkeypatch, fails):
    import threading

    from rlkit_core.errors import RunError
    from rlkit_core.runtime.run import run_recipe

    calls = {"push": 0, "generation": 0}
    released = threading.Event()  # a stalled generation returns when the test is over

    class Failing(scheduling.WeightsCopy):  # fails on the second time it is asked: the batch of iteration 3
        def __init__(self, policy):
            super().__init__(policy)
            load = self.model.load_state_dict

            def load_state_dict(state, *args, **kwargs):
                calls["push"] += 1
                if fails == "push" and calls["push"] == 2:
                    raise RuntimeError("the copy's memory is gone")
                return load(state, *args, **kwargs)

            self.model.load_state_dict = load_state_dict

    def worker(*args):
        made = original_worker(*args)
        generate = made.components.generator.generate

        def failing_generate(*args, **kwargs):
            calls["generation"] += 1
            if fails.startswith("generation") and calls["generation"] == 3:
                if fails == "generation stalls":
                    released.wait(120)
                raise RuntimeError("the sampler crashed")
            return generate(*args, **kwargs)

        made.components.generator.generate = failing_generate
        return made

    original_worker = scheduling.Producer._worker
    monkeypatch.setattr(scheduling, "WeightsCopy", Failing)
    monkeypatch.setattr(scheduling.Producer, "_worker", staticmethod(worker))
    recipe_document["run"].update(steps=5, checkpoint_every=100)
    recipe_document["scheduler"] = {"max_staleness": 1, "wait_timeout_s": 3.0 if fails == "generation stalls" else 60.0}
    recipe_document["loss"] = {"type": "ppo-clip", "tis_cap": 2.0}
    started = time.monotonic()
    try:
        with pytest.raises(RunError) as raised:
            run_recipe(parse_recipe(recipe_document, builtin_registry), quiet=True)
    finally:
        released.set()
    assert time.monotonic() - started < 50  # at once, or at the wait timeout: not after the 60 s one
    text = str(raised.value)
    if fails == "generation stalls":
        assert "no rollout batch for iteration 3 within scheduler.wait_timeout_s = 3 s" in text, text
    else:
        doing = "loading the pushed weights" if fails == "push" else "making the batch"
        assert f"worker 0 failed on the batch of iteration 3 (weights after 1 updates) while {doing}" in text, text
        assert ("the copy's memory is gone" if fails == "push" else "the sampler crashed") in text
    assert "continue with --resume auto" in text
    checkpoints = Path(recipe_document["run"]["output_dir"]) / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("iter_")) == ["iter_000002"]



class StuckFromTheSecondBatch:
    """A worker's environment whose steps, from the worker's second batch on, never return (until `released`, then
    they end their episodes quietly)."""

    def __init__(self, environment, batches: list[int], released):
        self.environment, self.batches, self.released = environment, batches, released

    def tools(self):
        return self.environment.tools()

    def reset(self, record, seed):
        return self.environment.reset(record, seed)

    def close(self, state):
        self.environment.close(state)

    def step(self, state, reply):
        if self.batches[0] >= 2:
            self.released.wait()
            return Step(status="error")
        return self.environment.step(state, reply)


@pytest.mark.parametrize("stuck", ["generator", "environment"])
def test_a_stall_with_every_worker_stuck_ends_the_run_at_the_wait_timeout_not_after_the_workers(recipe_document, builtin_registry,
                                                                                                 monkeypatch, tmp_path, stuck):
    """Two workers (bound 2), each stuck for good from its second batch on, in its generator or in an
    environment's step without a timeout: the run ends about scheduler.wait_timeout_s after its last
    trained row, not after waiting on each stuck worker in turn (5 s each before)."""
    import threading

    import attrs

    from rlkit_core.errors import RunError
    from rlkit_core.runtime import run as run_module
    from rlkit_core.runtime.run import run_recipe
    from tests.test_episodes import ending_model, episode_document

    released = threading.Event()  # the stuck calls return when the test is over
    moments: dict[str, float] = {}

    def worker(*args):
        made = original_worker(*args)
        generator, batches = made.components.generator, [0]
        sync, generate = generator.sync_weights, generator.generate

        def counting_sync(*args, **kwargs):  # once per batch, before its first generation
            batches[0] += 1
            return sync(*args, **kwargs)

        def stuck_generate(*args, **kwargs):
            if batches[0] >= 2:  # this worker's second batch: worker 0 makes iterations 1, 3, ..., worker 1 makes 2, 4, ...
                released.wait()
                raise RuntimeError("released at the end of the test")
            return generate(*args, **kwargs)

        generator.sync_weights = counting_sync
        if stuck == "generator":
            generator.generate = stuck_generate
            return made
        return attrs.evolve(made, components=attrs.evolve(made.components, environment=StuckFromTheSecondBatch(
            made.components.environment, batches, released)))

    def take(self, iteration):
        try:
            return original_take(self, iteration)
        except scheduling.Stalled:
            moments["stalled"] = time.monotonic()
            raise

    def record(self, iteration, metrics, *args):
        if "score/mean" in metrics:
            moments["trained"] = time.monotonic()
        return original_record(self, iteration, metrics, *args)

    original_worker, original_take, original_record = scheduling.Producer._worker, scheduling.Producer.take, run_module.RunOutputs.record
    monkeypatch.setattr(scheduling.Producer, "_worker", staticmethod(worker))
    monkeypatch.setattr(scheduling.Producer, "take", take)
    monkeypatch.setattr(run_module.RunOutputs, "record", record)
    if stuck == "environment":  # nothing else bounds a step
        recipe_document = episode_document(recipe_document, ending_model(tmp_path / "ending"), step_timeout_s=0, episode_timeout_s=0)
    recipe_document["run"].update(steps=5, checkpoint_every=100)
    recipe_document["scheduler"] = {"max_staleness": 2, "wait_timeout_s": 3.0}
    recipe_document["loss"] = {"type": "ppo-clip", "tis_cap": 2.0}
    try:
        with pytest.raises(RunError, match="no rollout batch for iteration 3 within scheduler.wait_timeout_s = 3 s"):
            run_recipe(parse_recipe(recipe_document, builtin_registry), quiet=True)
        ended = time.monotonic()
    finally:
        released.set()
    # after the stall: the checkpoint (a fraction of a second for the tiny model) and no wait for the two stuck workers
    assert ended - moments["stalled"] < 3.0, f"{ended - moments['stalled']:.1f} s from the stall to the end of the run"
    assert ended - moments["trained"] < 3.0 + 4.0, f"{ended - moments['trained']:.1f} s from the last trained row to the end of the run"
    checkpoints = Path(recipe_document["run"]["output_dir"]) / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("iter_")) == ["iter_000002"]


def test_an_ordinary_close_waits_for_the_workers_in_flight_within_one_deadline(recipe_document, builtin_registry, monkeypatch):
    """Closing without a stall (the run's end, a signal, a health stop): every worker busy on a batch
    shares one deadline of `CLOSE_WAIT_S`, rather than that long each."""
    import threading


    released, busy = threading.Event(), threading.Semaphore(0)

    def worker(*args):
        made = original_worker(*args)
        generator = made.components.generator

        def stuck_generate(*args, **kwargs):
            busy.release()
            released.wait()
            raise RuntimeError("released at the end of the test")

        generator.generate = stuck_generate
        return made

    original_worker = scheduling.Producer._worker
    monkeypatch.setattr(scheduling.Producer, "_worker", staticmethod(worker))
    monkeypatch.setattr(scheduling, "CLOSE_WAIT_S", 1.0)
    trainer = make_trainer(recipe_document, builtin_registry)
    try:
        producer = scheduling.Producer(trainer.sampling_view(), trainer.state.iteration, 3, 60.0)
        for _ in range(3):
            assert busy.acquire(timeout=60)  # all three workers in a generation that never returns
        started = time.monotonic()
        producer.close()
        closed = time.monotonic() - started
    finally:
        released.set()
    assert 0.9 < closed < 2.0, f"close took {closed:.2f} s for three stuck workers and a deadline of 1 s"


def test_the_report_gives_the_staleness_of_the_trained_batches_as_counts():
    import io

    from rlkit_core.runtime.report import print_report

    history = [{"iteration": i + 1, "score/mean": 0.5, "kl/ref": 0.0, "time/iteration": 1.0, "async/staleness": float(age),
                "async/regenerated": float(i == 3), "time/trainer_waiting": wait}
               for i, (age, wait) in enumerate([(0, 0.9), (1, 0.1), (2, 0.3), (1, 0.2), (1, 0.0)])]
    out = io.StringIO()
    print_report(history, [], True, "m.jsonl", "ckpt", None, out=out)
    assert "batches made ahead: staleness 0: 1, 1: 3, 2: 1; regenerated 1; the update waited a median 0.20 s for its batch" in out.getvalue()
    out = io.StringIO()
    print_report([{k: v for k, v in row.items() if not k.startswith(("async/", "time/trainer"))} for row in history], [], True, "m.jsonl",
                 "ckpt", None, out=out)
    assert "made ahead" not in out.getvalue()  # sync logs no staleness


def test_batches_made_ahead_are_scored_by_a_reward_service_that_answers_late(recipe_document, builtin_registry, tmp_path):
    """examples/reward_server.py as its own process, answering each request after 0.3 s: every
    batch the producer made was scored by it, and trained with its own prompts."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    try:
        from reward_server import score
    finally:
        sys.path.pop(0)
    data = tmp_path / "with_references.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Document {i}: the pilot cooked boxes.", "reference": "The pilot cooked boxes."}) + "\n"
                            for i in range(32)))
    server = subprocess.Popen([sys.executable, str(Path(__file__).resolve().parents[1] / "examples" / "reward_server.py"), "--port", "0",
                               "--delay", "0.3"], stdout=subprocess.PIPE, text=True)
    try:
        address = server.stdout.readline().split()[3]
        recipe_document["data"] = {"type": "jsonl", "path": str(data)}
        recipe_document["reward"] = {"type": "http", "url": f"{address}/score", "batch_size": 8, "max_concurrent": 2}
        trainer = make_trainer(recipe_document, builtin_registry, scheduler__max_staleness=1, loss__tis_cap=2.0,
                               loss__is_level="sequence", run__steps=3)
        try:
            iterations = [trainer.iterate() for _ in range(3)]
        finally:
            trainer.close()
    finally:
        server.terminate()
        server.wait()
    for number, done in enumerate(iterations):
        batch = done.batch
        assert batch.prompts == [r["prompt"] for r in trainer.stream_records(number)]
        assert batch.scores.tolist() == pytest.approx([score(r, "The pilot cooked boxes.") for r in batch.responses])
        assert done.metrics["async/staleness"] <= 1 and done.metrics["time/score"] >= 0.3  # two requests of 8, two at once
