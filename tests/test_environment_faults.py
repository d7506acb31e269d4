"""An environment that misbehaves, met as a user meets it: a third-party plugin found through its
entry point, run by the real `rlkit` command. A run that trains on nothing says so and stops (exit
3); a `RecipeError` out of the environment is bad input (exit 2) on one process or two; an opening
past the context is an episode status, not a traceback; hung calls never pile up; a fault is shown
once; and the data checksum tells one game from another."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import attrs
import pytest
import torch

from rlkit_core.errors import RecipeError
from rlkit_core.interfaces import Environment
from rlkit_core.messages import Reset, Step
from rlkit_core.runtime.after_update import data_checksum
from tests.test_episodes import Faulty, Scripted, ending_model, episode_document
from tests.test_trainer import make_trainer, rollout_with

PLUGIN = '''
import os
import time

import attrs

from rlkit_core import Environment, RecipeError, Reset, StandardEpisode, Step, hookimpl, setting


@attrs.frozen
class FaultyConfig(StandardEpisode):
    fault: str = setting("none", help="how the environment misbehaves")


class Faulty(Environment):
    def __init__(self, config, context=None):
        self.fault = config.fault

    def reset(self, record, seed):
        if self.fault == "every call raises" or (self.fault == "half the resets raise" and seed % 2):
            raise RuntimeError("the tool server refused the call")
        if self.fault == "reset finds the record wrong" or (self.fault == "process 1 finds the record wrong" and os.environ.get("RANK") == "1"):
            raise RecipeError([f"$.data: the record {record['prompt']!r} has no 'board' column; add one to every record"])
        opening = "tell me a long story " * 30 if self.fault == "opening past the context" else "go"
        return Reset([{"role": "user", "content": opening}], {"seed": seed})

    def step(self, state, reply):
        if self.fault == "step hangs on half the episodes" and state["seed"] % 2 == 0:
            time.sleep(3600)
        if self.fault == "every step times out":
            raise TimeoutError("the tool server did not answer within 5 s")
        return Step(messages=[{"role": "user", "content": "more"}], reward=1.0, done=True)


@hookimpl
def register_environments(register):
    register("faulty", Faulty, FaultyConfig)
'''


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory) -> Path:
    """A folder holding the plugin module and its distribution's metadata: on PYTHONPATH, the
    plugin loads through its entry point as if pip had installed it."""
    root = tmp_path_factory.mktemp("faulty-plugin")
    (root / "faulty_environment.py").write_text(PLUGIN)
    info = root / "faulty_environment-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: faulty-environment\nVersion: 0.0.1\n")
    (info / "entry_points.txt").write_text("[rlkit]\nfaulty = faulty_environment\n")
    return root


@pytest.fixture(scope="module")
def ending_tiny_model(tmp_path_factory):
    return ending_model(tmp_path_factory.mktemp("ending-gpt2"))


@pytest.fixture
def faulty_recipe(recipe_document, write_recipe, ending_tiny_model):
    def write(fault: str, **run) -> tuple[str, Path]:
        prompts = recipe_document["data"]
        document = episode_document(recipe_document, ending_tiny_model)
        document["environment"] = {"type": "faulty", "fault": fault, "max_turns": 2, "step_timeout_s": 1.0}
        document["data"] = prompts
        document["run"].update(run)
        return write_recipe(document), Path(document["run"]["output_dir"])

    return write


def rlkit(plugin_path: Path, *args: str, processes: int = 1) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{plugin_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("RLKIT_PLUGINS", None)
    script = str(Path(sys.executable).with_name("rlkit"))
    command = [script, *args] if processes == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}", script, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


def rows_of(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_run_whose_every_episode_fails_says_so_and_exits_3(plugin_path, faulty_recipe):
    recipe, output_dir = faulty_recipe("every call raises", steps=3)
    done = rlkit(plugin_path, "run", recipe, "--quiet")
    assert done.returncode == 3, done.stderr[-3000:]
    assert "every iteration of the run trained nothing, up to iteration 3: no rollout had a token to train: every episode ended " \
           "in a status kept out of training (env/status_error = 1.00)" in done.stderr
    assert "continue with --resume auto" in done.stderr and not (output_dir / "final_model").exists()
    assert (output_dir / "checkpoints" / "iter_000003").is_dir()
    assert done.stderr.count("EnvironmentFault: the environment's reset raised RuntimeError: the tool server refused") == 1  # once, not each iteration
    assert "health check" not in done.stderr  # no check fires on what was never measured
    trained = [row for row in rows_of(output_dir) if row["iteration"] >= 1]
    assert [row["run/untrained_batches"] for row in trained] == [1, 2, 3]
    assert not any(name.startswith(("score/", "kl/", "train/", "response/")) for row in trained for name in row)
    assert all(row["env/status_error"] == 1.0 for row in trained)


@pytest.mark.slow
def test_a_run_whose_every_episode_times_out_says_why_above_its_end(plugin_path, faulty_recipe):
    """The warnings the run's last message points to are there: the timeout, once, with its reason."""
    recipe, _ = faulty_recipe("every step times out", steps=2)
    done = rlkit(plugin_path, "run", recipe, "--quiet")
    assert done.returncode == 3, done.stderr[-3000:]
    said = ("EnvironmentFault: the environment's step timed out: the tool server did not answer within 5 s; the episode ends as a timeout, "
            "kept out of training (env/status_timeout)")
    assert done.stderr.count(said) == 1
    assert done.stderr.index(said) < done.stderr.index("every iteration of the run trained nothing, up to iteration 2: no rollout had a "
                                                       "token to train: every episode ended in a status kept out of training "
                                                       "(env/status_timeout = 1.00)")


@pytest.mark.slow
def test_a_fault_is_shown_once_over_a_run_that_trains(plugin_path, faulty_recipe):
    """Python's own once-only record is reset by any warnings filter (the optimiser's schedule
    step set one at every step): rlkit keeps its own."""
    recipe, output_dir = faulty_recipe("half the resets raise", steps=4)
    done = rlkit(plugin_path, "run", recipe, "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("EnvironmentFault: the environment's reset raised RuntimeError: the tool server refused") == 1
    rows = [row for row in rows_of(output_dir) if row["iteration"] >= 1]
    assert all(0 < row["env/status_error"] < 1 and "score/mean" in row for row in rows)


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_a_streak_of_iterations_that_train_nothing_stops_the_run(plugin_path, faulty_recipe, processes):
    recipe, output_dir = faulty_recipe("every call raises", steps=6, max_skips_in_a_row=2)
    done = rlkit(plugin_path, "run", recipe, "--quiet", processes=processes)
    assert done.returncode == (3 if processes == 1 else 1), done.stderr[-3000:]  # torchrun answers 1 for a worker's 3
    assert "2 iterations in a row (run.max_skips_in_a_row) trained nothing, up to iteration 2" in done.stderr
    assert [row["iteration"] for row in rows_of(output_dir)] == [1, 2]


@pytest.mark.slow
@pytest.mark.parametrize("processes, scheduler", [(1, "sync"), (1, "ahead"), (2, "sync")])
def test_a_recipe_error_from_an_environment_is_bad_input_on_every_process(plugin_path, faulty_recipe, processes, scheduler):
    fault = "reset finds the record wrong" if processes == 1 else "process 1 finds the record wrong"
    recipe, output_dir = faulty_recipe(fault, steps=3)
    if scheduler != "sync":  # made ahead by a worker: raised where sync raises it, not as the worker's fault (exit 1)
        Path(recipe).write_text(Path(recipe).read_text() + "\n[scheduler]\nmax_staleness = 1\n\n[loss]\ntype = \"ppo-clip\"\ntis_cap = 2.0\n")
    started = time.monotonic()
    done = rlkit(plugin_path, "run", recipe, "--quiet", processes=processes)
    assert time.monotonic() - started < 200  # the process whose records were fine does not wait for the other forever
    assert done.returncode == (2 if processes == 1 else 1), done.stderr[-3000:]  # torchrun answers 1 for a worker's 2
    assert "problem in the recipe:\n  $.data: the record" in done.stderr and "has no 'board' column" in done.stderr
    assert "EnvironmentFault" not in done.stderr  # not turned into warnings about error episodes
    assert not (output_dir / "final_model").exists() and not (output_dir / "checkpoints").exists()


@pytest.mark.slow
def test_the_built_in_environments_own_recipe_error_exits_2(recipe_document, write_recipe, ending_tiny_model):
    prompts = recipe_document["data"]  # prompts without the 'secret' column guess-number reads
    document = episode_document(recipe_document, ending_tiny_model)
    document["data"] = prompts
    done = subprocess.run([str(Path(sys.executable).with_name("rlkit")), "run", write_recipe(document), "--quiet"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "$.environment: a record's 'secret' column is None, not a number from 1 to 16" in done.stderr


@pytest.mark.slow
def test_an_opening_past_the_context_ends_its_episodes_as_overflow(plugin_path, faulty_recipe):
    recipe, output_dir = faulty_recipe("opening past the context", steps=2)
    done = rlkit(plugin_path, "run", recipe, "--quiet")
    assert "Traceback" not in done.stderr and done.returncode == 3, done.stderr[-3000:]
    assert "with a turn of 6 (generator.max_new_tokens) do not fit the policy's context of 128 tokens" in done.stderr
    assert "env/status_overflow = 1.00" in done.stderr


@pytest.mark.slow
def test_hung_calls_are_bounded_and_end_the_run_with_a_checkpoint_when_they_hold_every_thread(plugin_path, faulty_recipe):
    recipe, output_dir = faulty_recipe("step hangs on half the episodes", steps=6, checkpoint_every=1)
    recipe_text = Path(recipe).read_text().replace('step_timeout_s = 1.0', 'step_timeout_s = 0.5\ncall_threads = 12')
    Path(recipe).write_text(recipe_text)
    done = rlkit(plugin_path, "run", recipe, "--quiet")
    assert done.returncode == 1, done.stderr[-3000:]
    assert "every one of the environment's 12 call threads (environment.call_threads) is held by a call that did not return" in done.stderr
    assert "saved" in done.stderr and "continue with --resume auto" in done.stderr
    rows = [row for row in rows_of(output_dir) if row["iteration"] >= 1]
    hung = [row["env/hung_calls"] for row in rows]
    assert hung == sorted(hung) and 0 < hung[-1] <= 12  # counted, growing, never past the pool
    assert (output_dir / "checkpoints" / f"iter_{len(rows):06d}").is_dir()


class SaysDoneWithAString(Faulty):
    def step(self, state, reply):
        return attrs.evolve(super().step(state, reply), done="no")


def test_a_done_that_is_not_a_bool_ends_the_episode_as_an_error(recipe_document, builtin_registry, ending_tiny_model):
    trainer = make_trainer(episode_document(recipe_document, ending_tiny_model), builtin_registry)
    trainer.components = attrs.evolve(trainer.components, environment=SaysDoneWithAString())
    with pytest.warns(UserWarning, match=r"returned done='no'; an environment says True or False"):
        batch, metrics = rollout_with(trainer, [{"prompt": "p", "fault": "none"}] * 16)
    assert metrics["env/status_error"] > 0.5 and metrics["env/status_ok"] == 0 and not batch.loss_mask.any()


@pytest.mark.parametrize("barrier", [True, False], ids=["turn-barrier", "as-ready"])
def test_threads_of_hung_calls_stay_within_the_pool_over_many_rollouts(recipe_document, builtin_registry, ending_tiny_model, barrier):
    release = threading.Event()

    class HangsOnOddSeeds(Faulty):
        def reset(self, record, seed):
            return Reset([{"role": "user", "content": "go"}], {"fault": "none", "seed": seed})

        def step(self, state, reply):
            if state["seed"] % 2:
                release.wait()
            return super().step(state, reply)

    trainer = make_trainer(episode_document(recipe_document, ending_tiny_model, step_timeout_s=0.2, call_threads=20, turn_barrier=barrier),
                           builtin_registry)
    trainer.components = attrs.evolve(trainer.components, environment=HangsOnOddSeeds())
    before = threading.active_count()
    try:
        hung = []
        for iteration in range(6):
            try:
                _, metrics = rollout_with(trainer, trainer.stream.batch(iteration))
            except Exception as exc:  # the pool ran out: the run would end here, located
                assert "call threads (environment.call_threads) is held" in str(exc)
                break
            hung.append(metrics["env/hung_calls"])
            assert threading.active_count() - before <= 20
        assert hung and hung == sorted(hung) and hung[-1] <= 20
    finally:
        release.set()


@pytest.mark.parametrize("barrier", [True, False], ids=["turn-barrier", "as-ready"])
def test_a_recipe_error_from_a_step_stops_the_rollout(recipe_document, builtin_registry, ending_tiny_model, barrier):
    class FindsTheRecordWrong(Faulty):
        def reset(self, record, seed):
            return Reset([{"role": "user", "content": "go"}], {"bad": record["bad"]})

        def step(self, state, reply):
            if state["bad"]:
                raise RecipeError(["$.data: the record has no 'board' column; add one to every record"])
            return Step(messages=[{"role": "user", "content": "more"}])

    trainer = make_trainer(episode_document(recipe_document, ending_tiny_model, turn_barrier=barrier), builtin_registry)
    trainer.components = attrs.evolve(trainer.components, environment=FindsTheRecordWrong())
    with pytest.raises(RecipeError, match="no 'board' column"):
        rollout_with(trainer, [{"prompt": "p", "bad": i == 3} for i in range(16)])


def test_the_data_checksum_tells_games_of_one_prompt_apart(recipe_document, builtin_registry, ending_tiny_model):
    def checksum(secrets):
        return data_checksum(SimpleNamespace(prompts=["Guess my number, 1-16."] * len(secrets), columns={"secret": secrets}))

    assert len({checksum([3, 9]), checksum([9, 3]), checksum([3, 3])}) == 3 and checksum([3, 9]) == checksum([3, 9])
    # guess-number's iterations: one prompt text, other games
    trainer = make_trainer(episode_document(recipe_document, ending_tiny_model), builtin_registry)
    first, second = (rollout_with(trainer, trainer.stream.batch(i))[0] for i in range(2))
    assert set(first.prompts) == set(second.prompts) == {first.prompts[0]}
    assert data_checksum(first) != data_checksum(second)


class LongOpeningsOrFailingResets(Faulty):
    """By the record's `fault`: an opening past the context, a reset that raises, or a good game."""

    def reset(self, record, seed):
        if record["fault"] == "long opening":
            return Reset([{"role": "user", "content": "tell me a long story " * 40}], {"fault": "none"})
        return super().reset(record, seed)


def test_on_a_chat_template_tokenizer_untrainable_rows_neither_crash_nor_train(recipe_document, builtin_registry, tmp_path):
    """The Qwen-style tokenizer (a chat template, two end ids, no pad of its own): an opening past
    the context is cut to fit as a row that never trains, beside episodes that train, through the
    whole iteration; and a batch where nothing trains leaves the weights and β as they were."""
    from rlkit_core.testing.offline_models import write_tiny_model

    path = write_tiny_model(tmp_path / "chatml", "chatml")
    trainer = make_trainer(episode_document(recipe_document, path, max_turns=2), builtin_registry)
    trainer.components = attrs.evolve(trainer.components, environment=LongOpeningsOrFailingResets())
    context = trainer.components.policy.context_length
    trainer.stream.batch = lambda iteration: [{"prompt": "p", "fault": "long opening" if i % 2 else "none"} for i in range(8)]
    with pytest.warns(UserWarning, match="do not fit the policy's context of 256 tokens"):
        done = trainer.iterate()
    overflowed = ~done.batch.loss_mask.any(dim=1)
    assert done.trained and done.metrics["env/status_overflow"] >= 0.5 and overflowed.any() and not overflowed.all()
    assert int(done.batch.prompt_mask.sum(dim=1).max()) < context  # the cut opening fits
    weights = [p.detach().clone() for p in trainer.components.policy.parameters()]
    beta = trainer.components.kl.beta
    trainer.stream.batch = lambda iteration: [{"prompt": "p", "fault": "reset raises"}] * 8
    with pytest.warns(UserWarning, match="no such game"):
        nothing = trainer.iterate()
    assert not nothing.trained and "score/mean" not in nothing.metrics and nothing.metrics["run/untrained_batches"] == 1
    assert trainer.components.kl.beta == beta
    assert all(torch.equal(a, b) for a, b in zip(weights, trainer.components.policy.parameters()))


class ClosesEveryEpisode(Environment):
    """By the record's `kind`: 0 done at once, 1 a step that raises, 2 a step past its timeout, 3
    never done (the turn limit ends it), 4 a reset that raises (no episode to close). Records each close."""

    def __init__(self, close_fails: bool = False):
        self.closed: list[dict] = []
        self.close_fails = close_fails
        self.release = threading.Event()

    def reset(self, record, seed):
        if record["kind"] == 4:
            raise RuntimeError("no room for another sandbox")
        return Reset([{"role": "user", "content": "go"}], {"kind": record["kind"], "seed": seed, "steps": 0})

    def step(self, state, reply):
        state["steps"] += 1
        kind = state["kind"]
        if kind == 1:
            raise RuntimeError("the sandbox died")
        if kind == 2:
            self.release.wait(5)
        return Step(messages=[{"role": "user", "content": "more"}], reward=1.0, done=kind != 3)

    def close(self, state):
        self.closed.append(state)
        if self.close_fails:
            raise OSError("the sandbox was already gone")


@pytest.mark.parametrize("close_fails", [False, True])
def test_every_episode_that_started_is_closed_once_however_it_ended(recipe_document, builtin_registry, ending_tiny_model, close_fails):
    """Done, a step that raised, a step past its timeout and the turn limit each end an episode that
    is closed once, with its own state; a failed reset leaves nothing to close. A close that fails is
    warned of once and changes no episode's status."""
    environment = ClosesEveryEpisode(close_fails)
    trainer = make_trainer(episode_document(recipe_document, ending_tiny_model, max_turns=2, step_timeout_s=0.3), builtin_registry)
    policy = trainer.components.policy
    turn = Scripted([[policy.tokenizer.convert_tokens_to_ids("a"), policy.eos_token_ids[0]]], policy.tokenizer.pad_token_id)
    trainer.components = attrs.evolve(trainer.components, environment=environment, generator=turn)  # every turn ends
    try:
        with pytest.warns(UserWarning) as warned:
            batch, metrics = rollout_with(trainer, [{"prompt": "p", "kind": kind} for kind in range(5)] * 4)
    finally:
        environment.release.set()
    assert len(environment.closed) == 16 and len({state["seed"] for state in environment.closed}) == 16
    assert sorted(state["kind"] for state in environment.closed) == sorted([0, 1, 2, 3] * 4)
    assert {state["kind"]: state["steps"] for state in environment.closed} == {0: 1, 1: 1, 2: 1, 3: 2}
    # done, a step that raised (and the 4 resets), a step past its timeout, the turn limit: unchanged by a close that fails
    assert (metrics["env/status_ok"], metrics["env/status_error"], metrics["env/status_timeout"]) == pytest.approx((0.4, 0.4, 0.2))
    said = [str(w.message) for w in warned if "close" in str(w.message)]
    assert len(said) == (1 if close_fails else 0)
    if close_fails:  # the error and the line that raised it
        assert said[0].startswith("the environment's close failed in 16 of 16 episodes, so what they hold may not have been released: "
                                  "OSError: the sandbox was already gone") and 'in close\n    raise OSError' in said[0]
