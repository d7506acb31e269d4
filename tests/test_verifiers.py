"""verifiers' environments as the rlkit environment `verifiers` and the prompt source
`verifiers-dataset` (plugins/verifiers_envs.py), on a verifiers environment built here
(tests/data/rlkit_vf_echo.py: a taskset, its rewards and metric, and an in-process chat harness):
the tasks become records; each episode is verifiers' own, played by the policy through rlkit's
endpoint, its rows the template's render of the conversation and its reward the task's rewards;
the run's sampling is verifiers'; failures are statuses; bad recipes are located errors; and a
short run goes through the `rlkit` command. Skipped without verifiers."""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

pytest.importorskip("verifiers.v1")

from rlkit_plugins.verifiers_envs import (  # noqa: E402 (after the skip)
    VerifiersDataset,
    VerifiersDatasetConfig,
    server_sent,
)

from rlkit_core.errors import RecipeError  # noqa: E402
from rlkit_core.runtime.cli import main  # noqa: E402
from rlkit_core.testing.contracts import PromptSourceContract  # noqa: E402
from tests.test_agents import rows_of, sampled_of, turn_ids  # noqa: E402
from tests.test_episodes import Scripted, render_ids  # noqa: E402
from tests.test_trainer import make_trainer, rollout_with  # noqa: E402

FIXTURES = Path(__file__).parent / "data"


@pytest.fixture(autouse=True)
def echo_on_path(monkeypatch):
    """verifiers finds the test environment by its id, as an installed package: tests/data on the path."""
    monkeypatch.syspath_prepend(str(FIXTURES))


def dataset(**settings) -> list[dict]:
    return VerifiersDataset(VerifiersDatasetConfig(**{"env_id": "rlkit_vf_echo", **settings})).load()


def verifiers_trainer(document, registry, chatml, turns: list[list[int]], **environment):
    """A trainer whose episodes are the test environment's, the policy's turns `turns` in order
    (`Scripted`, as tests/test_agents.py's `agent_trainer`), so the rows are known to the token."""
    path, tokenizer = chatml
    document["policy"]["model"] = str(path)
    document.pop("reward")
    document["generator"]["max_new_tokens"] = 12
    document["environment"] = {"type": "verifiers", "env_id": "rlkit_vf_echo", "max_turns": 3, "max_episode_tokens": 200,
                               "step_timeout_s": 60.0, **environment}
    document["data"] = {"type": "verifiers-dataset", "env_id": "rlkit_vf_echo"}
    trainer = make_trainer(document, registry)
    trainer.components = attrs.evolve(trainer.components, generator=Scripted(turns, tokenizer.pad_token_id))
    return trainer


def conversation_of(prompt: str, replies: list[str]) -> list[dict]:
    messages = [{"role": "user", "content": prompt}]
    for index, reply in enumerate(replies):
        if index:
            messages.append({"role": "user", "content": "again"})
        messages.append({"role": "assistant", "content": reply})
    return messages


class TestVerifiersDataset(PromptSourceContract):
    component = "verifiers-dataset"
    config = {"env_id": "rlkit_vf_echo", "env_args": {"taskset": {"num_tasks": 3}}}


def test_the_dataset_makes_a_record_of_each_task():
    records = dataset(env_args={"taskset": {"num_tasks": 3}})
    assert [r["prompt"] for r in records] == ["Say 7.", "Say 8.", "Say fig."]
    assert records[0]["task"] == {"idx": 0, "id": "echo-0", "prompt": "Say 7.", "answer": "7"}
    assert json.loads(json.dumps(records)) == records
    assert len(dataset(size=2, env_args={"taskset": {"infinite": True}})) == 2


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_verifiers_episode_is_the_templates_render_scored_by_its_rewards(recipe_document, builtin_registry, chatml, stream):
    """The policy says "7" to "Say 7." and "Say 8.": the first task's `correct` is 1, the second's
    0, and neither is polite; the rows are the template's render of the conversation the harness
    held, the sampled ids the policy's, whether the harness streamed or not."""
    path, tokenizer = chatml
    seven = turn_ids(tokenizer, "7")
    trainer = verifiers_trainer(recipe_document, builtin_registry, chatml, [seven],
                                env_args={"agent": {"harness": {"id": "rlkit_vf_echo", "stream": stream}}})
    records = dataset(env_args={"taskset": {"num_tasks": 2}})
    batch, metrics = rollout_with(trainer, records, samples_per_prompt=1)
    assert (metrics["env/status_ok"], metrics["env/splits"], metrics["env/turns"]) == (1.0, 0.0, 1.0)
    assert batch.scores.tolist() == [1.0, 0.0]
    assert (metrics["env/correct"], metrics["env/polite"], metrics["env/words"]) == (0.5, 0.0, 1.0)
    assert rows_of(batch) == [render_ids(tokenizer, conversation_of(f"Say {word}.", ["7"]))[:-1] for word in ("7", "8")]
    assert sampled_of(batch) == [seven, seven]


def test_a_multi_turn_episode_is_one_sample_of_every_turn(recipe_document, builtin_registry, chatml):
    path, tokenizer = chatml
    seven = turn_ids(tokenizer, "7")
    trainer = verifiers_trainer(recipe_document, builtin_registry, chatml, [seven], env_args={"taskset": {"turns": 3}})
    batch, metrics = rollout_with(trainer, dataset(env_args={"taskset": {"num_tasks": 1, "turns": 3}}), samples_per_prompt=1)
    assert (metrics["env/status_ok"], metrics["env/splits"], metrics["env/turns"], metrics["env/reward"]) == (1.0, 0.0, 3.0, 1.0)
    assert rows_of(batch) == [render_ids(tokenizer, conversation_of("Say 7.", ["7", "7", "7"]))[:-1]]
    assert sampled_of(batch) == [seven * 3]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_calls_cross_verifiers_with_their_ids(recipe_document, builtin_registry, chatml, stream):
    """The policy's call reaches the harness through verifiers' interception with an id, streamed
    or whole; the harness's result by that id comes back rendered as the template renders a tool
    result: the sample is the render of the conversation with its tools."""
    path, tokenizer = chatml
    call = turn_ids(tokenizer, '<tool_call>\n{"name": "lookup", "arguments": {"word": "fig"}}\n</tool_call>')
    seven = turn_ids(tokenizer, "7")
    trainer = verifiers_trainer(recipe_document, builtin_registry, chatml, [call, seven],
                                env_args={"agent": {"harness": {"id": "rlkit_vf_echo", "tools": True, "stream": stream}}})
    batch, metrics = rollout_with(trainer, dataset(env_args={"taskset": {"num_tasks": 1}}), samples_per_prompt=1)
    from rlkit_vf_echo import LOOKUP

    conversation = [{"role": "user", "content": "Say 7."},
                    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "lookup",
                                                                                                          "arguments": {"word": "fig"}}}]},
                    {"role": "tool", "name": "lookup", "content": "found"}, {"role": "assistant", "content": "7"}]
    text = tokenizer.apply_chat_template(conversation, tools=[LOOKUP], tokenize=False)
    assert (metrics["env/status_ok"], metrics["env/splits"], metrics["env/reward"], metrics["env/agent_refused"]) == (1.0, 0.0, 1.0, 0.0)
    assert rows_of(batch) == [tokenizer(text, add_special_tokens=False)["input_ids"][:-1]]
    assert sampled_of(batch) == [call + seven]


def test_the_runs_sampling_is_verifiers_so_a_harnesss_own_never_reaches_the_endpoint(recipe_document, builtin_registry, chatml):
    """A harness that asks for another temperature and fewer tokens than the run samples: verifiers
    imposes its episode's sampling (the run's) on every request, so the endpoint refuses nothing."""
    path, tokenizer = chatml
    harness = {"id": "rlkit_vf_echo", "request": {"temperature": 0.3, "max_tokens": 4}}
    trainer = verifiers_trainer(recipe_document, builtin_registry, chatml, [turn_ids(tokenizer, "7")], env_args={"agent": {"harness": harness}})
    _, metrics = rollout_with(trainer, dataset(env_args={"taskset": {"num_tasks": 1}}), samples_per_prompt=1)
    assert (metrics["env/status_ok"], metrics["env/agent_refused"], metrics["env/reward"]) == (1.0, 0.0, 1.0)


def test_records_of_another_source_make_tasks_from_their_columns(recipe_document, builtin_registry, chatml):
    path, tokenizer = chatml
    seven = turn_ids(tokenizer, "7 please")
    trainer = verifiers_trainer(recipe_document, builtin_registry, chatml, [seven])
    records = [{"prompt": "Say 7 please.", "answer": "7 please", "letter": "e"}, {"prompt": "Say 8.", "answer": "8"}]
    batch, metrics = rollout_with(trainer, records, samples_per_prompt=1)
    assert batch.scores.tolist() == [1.5, 0.5]  # correct (weight 1) and polite (weight 0.5); polite only
    assert (metrics["env/correct"], metrics["env/polite"], metrics["env/words"]) == (0.5, 1.0, 2.0)
    with pytest.raises(RecipeError, match=r"\$\.environment: a record \(columns: prompt\) does not make a EchoData: task.answer: Field required"):
        rollout_with(trainer, [{"prompt": "Say 7."}], samples_per_prompt=1)


@pytest.mark.parametrize(("record", "said"), [
    ({"prompt": "Say 7.", "answer": "7", "broken": True}, "verifiers' episode failed: TaskError: .*the scorer broke"),
], ids=["scoring-raises"])
def test_an_episode_verifiers_did_not_complete_is_a_status_never_a_score(recipe_document, builtin_registry, chatml, record, said):
    from rlkit_core.runtime.episodes import EnvironmentFault

    path, tokenizer = chatml
    trainer = verifiers_trainer(recipe_document, builtin_registry, chatml, [turn_ids(tokenizer, "7")])
    with pytest.warns(EnvironmentFault, match=said):
        batch, metrics = rollout_with(trainer, [record], samples_per_prompt=1)
    assert metrics["env/status_error"] == 1.0 and int(batch.loss_mask.sum()) == 0


def test_an_episode_rlkit_ended_is_cancelled_in_verifiers(recipe_document, builtin_registry, chatml):
    """A harness that hangs after its first answer: rlkit ends the episode as a timeout, and its
    close cancels verifiers' episode, so that nothing of it keeps running."""
    path, tokenizer = chatml
    trainer = verifiers_trainer(recipe_document, builtin_registry, chatml, [turn_ids(tokenizer, "7")], step_timeout_s=2.0,
                                env_args={"agent": {"harness": {"id": "rlkit_vf_echo", "hang": True}}})
    _, metrics = rollout_with(trainer, dataset(env_args={"taskset": {"num_tasks": 1}}), samples_per_prompt=1)
    assert metrics["env/status_timeout"] == 1.0
    runner = trainer.components.environment.runner

    async def running() -> list[str]:
        await asyncio.sleep(0.5)  # the cancelled episode unwinds
        return [task.get_coro().__qualname__ for task in asyncio.all_tasks()]  # type: ignore[union-attr]

    assert "Verifiers._episode" not in runner.submit(running()).result(timeout=30) and not trainer.components.environment.running


def test_an_environment_built_in_code_is_named_by_its_callable(recipe_document, builtin_registry, chatml):
    path, tokenizer = chatml
    records = dataset(env_id="", environment="rlkit_vf_echo:build", env_args={"num_tasks": 2})
    assert [r["task"]["answer"] for r in records] == ["7", "8"]
    trainer = verifiers_trainer(recipe_document, builtin_registry, chatml, [turn_ids(tokenizer, "8")], env_id="",
                                environment=f"{FIXTURES / 'rlkit_vf_echo.py'}:build", env_args={"harness": {"stream": True}})
    batch, _ = rollout_with(trainer, records, samples_per_prompt=1)
    assert batch.scores.tolist() == [0.0, 1.0]


def test_a_streamed_answer_is_the_whole_one_as_events():
    """What the relay answers a streamed request with parses as OpenAI's chunks: the message in one
    delta, each tool call with its index, the usage only when asked for and known, then [DONE]."""
    from openai.types.chat import ChatCompletionChunk

    call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    completion = {"id": "c", "object": "chat.completion", "created": 1, "model": "policy", "usage": {"prompt_tokens": 1,
                  "completion_tokens": 2, "total_tokens": 3},
                  "choices": [{"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [call]},
                               "finish_reason": "tool_calls", "logprobs": None, "token_ids": [5, 6]}]}
    events = server_sent(completion, include_usage=True).decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    first, usage = (ChatCompletionChunk.model_validate(json.loads(event.removeprefix("data: "))) for event in events[:2])
    assert first.choices[0].delta.tool_calls[0].index == 0 and first.choices[0].delta.tool_calls[0].id == "call_1"
    assert first.choices[0].finish_reason == "tool_calls" and usage.usage is not None and usage.usage.total_tokens == 3
    assert len(server_sent(completion, include_usage=False).decode().split("\n\n")) == 3


def check(recipe_document, write_recipe, capsys, environment: dict, data: dict | None = None, out: bool = False) -> tuple[int, str]:
    recipe_document.pop("reward")
    recipe_document["environment"] = {"type": "verifiers", **environment}
    recipe_document["data"] = {"type": "verifiers-dataset", **(environment if data is None else data)}
    code = main(["check", "--offline", write_recipe(recipe_document)])
    captured = capsys.readouterr()
    return code, captured.out if out else captured.err


def test_rlkit_check_plays_episodes_of_an_installed_environment(recipe_document, write_recipe, capsys):
    """The environment is a HarnessEnvironment, so `rlkit check` plays a few of its episodes with the
    policy, each verifiers' own, through the endpoint."""
    code, out = check(recipe_document, write_recipe, capsys, {"env_id": "rlkit_vf_echo"}, out=True)
    assert code == 0, out
    assert "played as a run plays them: the verifiers environment's agent through the endpoint" in out
    assert out.count("    requests          1, 0 refused") == 2
    assert "[environment] imports verifiers' environment 'rlkit_vf_echo'" in out


def test_rlkit_check_notes_data_of_another_environment(recipe_document, write_recipe, capsys):
    code, out = check(recipe_document, write_recipe, capsys, {"env_id": "rlkit_vf_echo"}, data={"environment": "rlkit_vf_echo:build"}, out=True)
    assert code == 0 and "$.environment: names another verifiers environment than data does (env_id, environment)" in out, out


CHECKED = {
    "unknown id": ({"env_id": "rlkit_vf_ech"}, "$.environment.env_id: verifiers has no environment 'rlkit_vf_ech': no installed package "
                                               "'rlkit_vf_ech' (prime env install <owner>/<name>, or pip install the environment's package)"),
    "named twice": ({"env_id": "rlkit_vf_echo", "environment": "rlkit_vf_echo:build"},
                    "$.environment: name the verifiers environment as exactly one of 'env_id'"),
    "not named": ({}, "$.environment: name the verifiers environment as exactly one of 'env_id'"),
}


@pytest.mark.parametrize("case", CHECKED)
def test_rlkit_check_locates_a_bad_environment_table(recipe_document, write_recipe, capsys, case):
    environment, line = CHECKED[case]
    code, err = check(recipe_document, write_recipe, capsys, environment)
    assert code == 2 and f"  {line}" in err and line.replace("$.environment", "$.data") in err and "Traceback" not in err, err


BUILT = {
    "unknown id": ({"env_id": "rlkit_vf_ech"}, r"\$\.data\.env_id: verifiers has no environment 'rlkit_vf_ech': taskset 'rlkit_vf_ech' not found"),
    "unknown setting": ({"env_id": "rlkit_vf_echo", "env_args": {"taskset": {"num_taks": 3}}},
                        r"\$\.data\.env_args\.taskset\.num_taks: Extra inputs are not permitted"),
    "id in the table": ({"env_id": "rlkit_vf_echo", "env_args": {"taskset": {"id": "x"}}}, r"\$\.data\.env_args: leave 'id' out"),
    "no callable": ({"environment": "rlkit_vf_echo:missing"}, r"\$\.data\.environment: 'rlkit_vf_echo' has no callable 'missing'"),
    "no module": ({"environment": "no/such/file.py:build"}, r"\$\.data\.environment: 'no/such/file.py' could not be loaded"),
    "not an env": ({"environment": "json:dumps", "env_args": {"obj": 1}}, r"\$\.data\.environment: 'json:dumps' returned str, not a vf\.Env"),
    "infinite": ({"env_id": "rlkit_vf_echo", "env_args": {"taskset": {"infinite": True}}},
                 r"\$\.data\.size: the taskset EchoTaskset is infinite; set how many tasks to take"),
}


@pytest.mark.parametrize("case", BUILT)
def test_a_bad_environment_is_a_located_error_when_built(case):
    source, message = BUILT[case]
    with pytest.raises(RecipeError, match=message):
        VerifiersDataset(VerifiersDatasetConfig(**source), where_context()).load()


def where_context():
    class Context:
        where = "$.data"

    return Context()


def test_the_plugin_registers_without_verifiers_and_says_how_to_install_it(recipe_document, write_recipe, capsys, monkeypatch):
    """`rlkit plugins` imports every plugin: this one must import without the package; a recipe
    that names it is told how to install it."""
    monkeypatch.setitem(sys.modules, "verifiers", None)
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)
    monkeypatch.delitem(sys.modules, "rlkit_plugins.verifiers_envs")
    importlib.import_module("rlkit_plugins.verifiers_envs")
    code, err = check(recipe_document, write_recipe, capsys, {"env_id": "rlkit_vf_echo"})
    assert code == 2, err
    for table, name in (("environment", "verifiers"), ("data", "verifiers-dataset")):
        assert f"  $.{table}.type: {name!r} needs the verifiers package (Python >= 3.11): pip install 'rlkit[verifiers]'" in err


@pytest.mark.slow
def test_a_recipe_trains_on_a_verifiers_environment_through_the_rlkit_command(tmp_path):
    """Two iterations of `rlkit run` on a tiny model that ends its turns early, the environment
    found by its id (tests/data on PYTHONPATH, as an installed package would be)."""
    from rlkit_core.testing import recipe_toml
    from tests.test_episodes import ending_model

    model = ending_model(tmp_path / "model", "gpt2")
    source = {"env_id": "rlkit_vf_echo", "env_args": {"taskset": {"num_tasks": 24}}}
    recipe = {"run": {"steps": 2, "seed": 0, "output_dir": str(tmp_path / "run"), "threads": 1},
              "ppo": {"batch_size": 8, "minibatch_size": 4, "epochs": 1, "samples_per_prompt": 2},
              "policy": {"type": "hf", "model": str(model)}, "generator": {"max_new_tokens": 6},
              "environment": {"type": "verifiers", "max_turns": 2, "step_timeout_s": 60.0, **source},
              "data": {"type": "verifiers-dataset", **source}, "eval": {"size": 4, "every": 0}, "tracker": {"type": "none"}}
    (tmp_path / "recipe.toml").write_text(recipe_toml(recipe))
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FIXTURES), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([str(Path(sys.executable).with_name("rlkit")), "run", str(tmp_path / "recipe.toml"), "--quiet"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path, env=environment)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [row for row in rows if "train/approx_kl" in row]
    assert len(trained) == 2 and all(row["env/status_ok"] > 0 and "env/correct" in row and "env/words" in row for row in trained)


SHIPPED = Path(__file__).resolve().parents[1] / "recipes" / "grpo_verifiers.toml"


def rlkit(*arguments: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """The `rlkit` command from the repository root, where the shipped recipe's environment path starts."""
    return subprocess.run([str(Path(sys.executable).with_name("rlkit")), *arguments], capture_output=True, text=True, timeout=timeout,
                          cwd=SHIPPED.parents[1])


@pytest.mark.slow
def test_the_shipped_recipe_plays_its_environment_and_trains(tmp_path):
    """recipes/grpo_verifiers.toml as a user would shrink it to try it: `rlkit check --offline`
    passes, its episodes not played without the hub model (a note); with a tiny model in place of the hub one,
    `rlkit check` plays two of its environment's episodes (examples/verifiers/sort_numbers.py, built
    by its path) and `rlkit run` trains two iterations scored by the taskset's reward and metric."""
    checked = rlkit("check", "--offline", str(SHIPPED))
    assert checked.returncode == 0, checked.stdout[-2000:] + checked.stderr[-3000:]
    assert "$.policy: no agent episode played: 'Qwen/Qwen2.5-0.5B-Instruct' is a hub name not in the local cache" in checked.stdout
    assert "[environment] imports the file" in checked.stdout and "sort_numbers.py' for its function 'build'" in checked.stdout
    from tests.test_episodes import ending_model

    model = ending_model(tmp_path / "model", "gpt2")  # ends its reply after a token or three
    small = {"run.steps": 2, "run.output_dir": str(tmp_path / "run"), "run.threads": 1, "policy.model": str(model), "policy.dtype": "float32",
             "ppo.batch_size": 8, "ppo.samples_per_prompt": 4, "ppo.minibatch_size": 4, "generator.max_new_tokens": 8,
             "environment.env_args.num_tasks": 24, "data.env_args.num_tasks": 24, "eval.size": 4, "eval.every": 0, "tracker.type": "none"}
    overrides = [f"--set={key}={value!r}" if isinstance(value, str) else f"--set={key}={value}" for key, value in small.items()]
    played = rlkit("check", "--offline", str(SHIPPED), *overrides)
    assert played.returncode == 0, played.stdout[-2000:] + played.stderr[-3000:]
    assert "played as a run plays them: the verifiers environment's agent through the endpoint" in played.stdout
    assert played.stdout.count("    requests          1, 0 refused") == 2, played.stdout
    done = rlkit("run", str(SHIPPED), *overrides, "--quiet", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [row for row in rows if "train/approx_kl" in row]
    assert len(trained) == 2, rows
    for row in trained:
        assert row["env/status_ok"] > 0 and 0.0 <= row["env/correct"] <= 1.0 and 0.0 <= row["env/in_place"] <= 1.0
    assert any("eval/score" in row for row in rows)
