"""The `agent` environment under two processes: `rlkit run` under torchrun (gloo on CPUs), each
process serving its own endpoint to the agents of its own episodes. The agent
(`tests.agent_harnesses:talk_and_tell`, `talk` telling what it saw) and the launcher
(tests/rollout_recorder.py, the rlkit command writing each process's rollouts) let the test hold
every episode's answers against the rows that process trained on, to the token."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tests.test_episodes import ending_model

openai = pytest.importorskip("openai")

ROOT = Path(__file__).parents[1]
RECORDER = Path(__file__).with_name("rollout_recorder.py")
TURNS = 3  # talk_and_tell's turns: the prompt, then "again" after each of the model's turns
# The agent recipes' model ends a sampled turn at once in about a third of its turns and after 3.3 tokens on
# average (`ends_turns_early`), so that the turns of different episodes differ; at 32 tokens all but none is cut off.
END_LOGIT = 5.5


def read_lines(paths) -> list[dict]:
    return [json.loads(line) for path in paths for line in path.read_text().splitlines()]


def agent_recipe(document: dict, model: Path, agent: dict) -> dict:
    """`document` (the conftest recipe) as an agent recipe on `model` (`ends_turns_early` at END_LOGIT):
    `agent` plays each episode, three turns through the endpoint, in the plain chat format."""
    document["policy"]["model"] = str(model)
    document.pop("reward")
    document["generator"]["max_new_tokens"] = 32
    document["environment"] = {"type": "agent", **agent, "max_turns": TURNS, "max_episode_tokens": 110, "chat_format": "plain",
                               "step_timeout_s": 60.0}
    return document


def recorded_run(recipe: str, told: Path, rolled: Path, processes: int = 1, **environment: str) -> subprocess.CompletedProcess:
    """`rlkit run recipe` from the repository's root (so that `tests.agent_harnesses` imports), on
    `processes` processes under torchrun; talk_and_tell tells what it saw in `told`, and
    tests/rollout_recorder.py what each process rolled out in `rolled`."""
    told.mkdir(exist_ok=True), rolled.mkdir(exist_ok=True)
    launch = [sys.executable] if processes == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    variables = {**os.environ, "RLKIT_TEST_AGENT_LOG": str(told), "PYTHONPATH": str(ROOT), **environment}
    variables.pop("RLKIT_PLUGINS", None)
    return subprocess.run([*launch, str(RECORDER), str(rolled), "run", recipe, "--quiet"], capture_output=True, text=True, timeout=600,
                          env=variables, cwd=ROOT)


def assert_trained_on_what_the_agents_were_answered(episodes: list[dict], samples: list[dict], tokenizer) -> None:
    """Each episode one sample (a row of tests/rollout_recorder.py), and the rows are the agents' own
    conversations in the plain format (a line a message, each turn's ids as the endpoint handed
    them, its end id included), with exactly those turns' ids as the ids sampled."""
    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    assert len(samples) == len(episodes) and all(len(e["answers"]) == TURNS for e in episodes)
    played = []
    for episode in episodes:
        turns = [a["token_ids"] for a in episode["answers"]]
        assert all(ids and ids[-1] == tokenizer.eos_token_id and a["content"] == tokenizer.decode(
            ids[:-1], skip_special_tokens=False, clean_up_tokenization_spaces=False) for ids, a in zip(turns, episode["answers"]))
        response = turns[0]
        for ids in turns[1:]:
            response = response + encode("again\n") + ids
        played.append((encode(episode["prompt"] + "\n"), response, [i for ids in turns for i in ids]))
    trained_on = [(s["prompt_ids"], s["response_ids"], s["sampled_ids"]) for s in samples]
    assert sorted(trained_on) == sorted(played), "the rows trained on are not the ids the agents were answered with"


@pytest.mark.slow
@pytest.mark.parametrize("form", ["callable", "command", "callable-as-ready"])
def test_two_processes_each_serve_their_own_agents_and_train_on_what_they_sampled(recipe_document, write_recipe, tmp_path, form):
    """Two iterations of 16 episodes, 8 a process (and the report's before and after); "as-ready":
    without the turn barrier, the turns served by hf's continuous decoding loop. Every episode went through its own process's
    endpoint (one port a process, not the other's) and got its own session's answers in order; each
    process trained on exactly its own episodes, whose rows are the plain render of the conversation
    the agent saw with the ids the endpoint handed it as the ids sampled."""
    told, rolled = tmp_path / "told", tmp_path / "rolled"
    model = ending_model(tmp_path / "ending", end_logit=END_LOGIT)
    agent = {"command": [sys.executable, str(ROOT / "tests" / "agent_harnesses.py"), "talk_and_tell"]} if form == "command" else \
        {"harness": "tests.agent_harnesses:talk_and_tell", "turn_barrier": form == "callable"}
    output_dir = Path(recipe_document["run"]["output_dir"])
    done = recorded_run(write_recipe(agent_recipe(recipe_document, model, agent)), told, rolled, processes=2)
    assert done.returncode == 0, done.stderr[-4000:]

    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [row for row in rows if row["iteration"] >= 1]
    assert [row["iteration"] for row in trained] == [1, 2] and all("score/mean" in row for row in trained)
    for row in trained:  # means over both processes' episodes
        assert row["env/status_ok"] == 1.0 and row.get("env/status_error", 0.0) == 0.0, row
        assert (row["env/agent_requests"], row["env/talked"], row["env/own_answers"]) == (TURNS, TURNS, 1.0)
        assert (row["env/agent_refused"], row["env/agent_rewrites"], row["env/splits"]) == (0.0, 0.0, 0.0)

    episodes = read_lines(told.glob("*.jsonl"))
    by_rank = defaultdict(list)
    for episode in episodes:
        by_rank[episode["rank"]].append(episode)
    assert sorted(by_rank) == ["0", "1"]
    ports = {rank: {e["port"] for e in mine} for rank, mine in by_rank.items()}
    assert all(len(p) == 1 for p in ports.values()) and ports["0"] != ports["1"]  # one endpoint a process
    # the agent ran in the process whose endpoint it used (callable), or as that process's child (command)
    runs_in = {rank: {e["parent" if form == "command" else "pid"] for e in mine} for rank, mine in by_rank.items()}
    assert all(len(p) == 1 for p in runs_in.values()) and runs_in["0"] != runs_in["1"]
    assert len({e["session"] for e in episodes}) == len(episodes)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    for rank in "01":  # 8 episodes a process each iteration, and the before/after report's (each process plays them)
        samples = read_lines([rolled / f"rollouts-{rank}.jsonl"])
        assert len(samples) > 16 and all(s["score"] == 1.0 for s in samples)
        assert_trained_on_what_the_agents_were_answered(by_rank[rank], samples, tokenizer)


@pytest.mark.slow
def test_an_agents_figure_is_its_mean_over_every_process_episodes_that_reported_it(recipe_document, write_recipe,
                                                                                     tmp_path):
    """8 episodes a process an iteration: on process 0 each reports figure = 1, on process 1 one in
    four reports it, as 0 (any 8 episodes in a row hold two). env/figure = 8 / (8 + 2) = 0.8, the
    mean over the episodes that reported it, where a mean of the processes' means would be (1 + 0) / 2."""
    model = ending_model(tmp_path / "ending", end_logit=END_LOGIT)
    agent = {"harness": "tests.agent_harnesses:reports_by_rank"}
    output_dir = Path(recipe_document["run"]["output_dir"])
    recipe = write_recipe(agent_recipe(recipe_document, model, agent))
    done = recorded_run(recipe, tmp_path / "told", tmp_path / "rolled", processes=2)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [row for row in rows if row["iteration"] >= 1]
    assert len(trained) == 2 and all(row["env/figure"] == pytest.approx(0.8) for row in trained), trained
