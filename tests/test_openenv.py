"""OpenEnv's environments as the rlkit environment `openenv` (plugins/openenv_envs.py), against
real OpenEnv servers on loopback: the echo environment that OpenEnv's `openenv init` scaffolds (its
template, served with uvicorn as its README says), and two written with OpenEnv's server API
(tests/openenv_servers.py: a text environment that can hang, an MCP environment with tools).
Episodes go through rlkit's runner with a scripted generator, so the rows, rewards and figures are
known exactly; a server that is down at the start is a located error, one that dies or hangs during
the run ends episodes as "error" or "timeout". Skipped without the openenv package."""

from __future__ import annotations

import importlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import attrs
import pytest

pytest.importorskip("openenv.core")

from rlkit_plugins.openenv_envs import OpenEnv, OpenEnvConfig  # noqa: E402 (after the skip)

from rlkit_core.errors import RecipeError  # noqa: E402
from rlkit_core.runtime.cli import main  # noqa: E402
from rlkit_core.testing.contracts import EnvironmentContract, read_reply  # noqa: E402
from tests.test_agents import rows_of, sampled_of, turn_ids  # noqa: E402
from tests.test_episodes import Scripted, ending_model, render_ids  # noqa: E402
from tests.test_trainer import make_trainer, rollout_with  # noqa: E402

TESTS = Path(__file__).parent
READY = "Echo Env environment ready!"  # the template's reset for an env named echo_env


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """`uvicorn APP` in a process of its own on a free loopback port, until `stop`."""

    def __init__(self, app: str, app_dir: Path, health: str = "/health"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen([sys.executable, "-m", "uvicorn", app, "--app-dir", str(app_dir), "--host", "127.0.0.1",
                                         "--port", str(self.port), "--log-level", "warning"], cwd=app_dir,
                                        env={**os.environ, "PYTHONPATH": str(TESTS.parent)}, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}{health}", timeout=1):
                    return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"the server {app} did not start: {self.process.stderr.read() if self.process.stderr else ''}") from None
                time.sleep(0.2)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture(scope="module")
def echo(tmp_path_factory) -> Server:
    """OpenEnv's own example: `openenv init echo_env` (run offline: no uv on the PATH, so it makes
    no lock file), its sessions raised from 1 in server/app.py as the template's comment says: to
    256, as the contract's checks open episodes they never close (rlkit's runner closes every one)."""
    folder = tmp_path_factory.mktemp("openenv")
    done = subprocess.run([sys.executable, "-m", "openenv.cli", "init", "echo_env", "--output-dir", str(folder)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PATH": str(Path(sys.executable).parent), "UV_OFFLINE": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    app = folder / "echo_env" / "server" / "app.py"
    source = app.read_text()
    assert "max_concurrent_envs=1," in source
    app.write_text(source.replace("max_concurrent_envs=1,", "max_concurrent_envs=256,"))
    server = Server("server.app:app", folder / "echo_env")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def servers() -> Server:
    """tests/openenv_servers.py's environments under /slow, /one and /tools of one server."""
    server = Server("openenv_servers:app", TESTS, health="/slow/health")
    yield server
    server.stop()


def trainer_for(document, registry, model, tokenizer, turns: list[list[int]], **environment):
    """A trainer whose episodes play `environment`, the model's turns `turns` in order."""
    document["policy"]["model"] = str(model)
    document.pop("reward")
    document["generator"]["max_new_tokens"] = 24
    document["environment"] = {"type": "openenv", "max_turns": 2, "max_episode_tokens": 400, "step_timeout_s": 30.0, **environment}
    trainer = make_trainer(document, registry)
    trainer.components = attrs.evolve(trainer.components, generator=Scripted(turns, tokenizer.pad_token_id))
    return trainer


def openenv(**settings) -> OpenEnv:
    return OpenEnv(OpenEnvConfig(**settings))


def play(environment: OpenEnv, record: dict, texts: list[str]):
    opening = environment.reset(record, 0)
    try:
        return opening, [environment.step(opening.state, read_reply(text, turn)) for turn, text in enumerate(texts, 1)]
    finally:
        environment.close(opening.state)


RECORDS = [{"prompt": "Talk to the echo."}] * 2


def test_the_echo_template_plays_through_the_runner_with_its_own_rewards(recipe_document, builtin_registry, chatml, echo):
    """Two turns of "hello" against the echo: the row is the template's render of the whole
    conversation (the observation's `echoed_message` as the user's turns), only the model's ids are
    sampled, and each turn earns the echo's reward, min(0.1 * length, 1) = 0.5; the numbers of its
    metadata are the episode's figures (`step`, the last step's)."""
    path, tokenizer = chatml
    turn = turn_ids(tokenizer, "hello")
    trainer = trainer_for(recipe_document, builtin_registry, path, tokenizer, [turn], url=echo.url, observation_field="echoed_message")
    batch, metrics = rollout_with(trainer, RECORDS)
    conversation = [{"role": "user", "content": READY}, {"role": "assistant", "content": "hello"},
                    {"role": "user", "content": "hello"}, {"role": "assistant", "content": "hello"}]
    assert (metrics["env/status_ok"], metrics["env/turns"], metrics["env/reward"], metrics["env/step"]) == (1.0, 2.0, 1.0, 2.0)
    assert rows_of(batch)[0] == render_ids(tokenizer, conversation)[:-1]
    assert sampled_of(batch) == [turn * 2] * 2
    assert batch.scores.tolist() == [1.0, 1.0]


def test_an_observation_without_a_field_named_is_json_and_the_prompt_can_come_first(echo):
    """No observation_field: the observation's fields but its metadata, as JSON. prompt_role puts
    the record's prompt before it: a system message, or the start of the same user message."""
    opening, [step] = play(openenv(url=echo.url), RECORDS[0], ["hi"])
    assert opening.messages == [{"role": "user", "content": json.dumps({"echoed_message": READY, "message_length": 0})}]
    assert step.messages == [{"role": "user", "content": json.dumps({"echoed_message": "hi", "message_length": 2})}]
    assert (step.reward, step.done, step.info) == (pytest.approx(0.2), False, {"step": 1.0})
    system, _ = play(openenv(url=echo.url, observation_field="echoed_message", prompt_role="system"), RECORDS[0], [])
    assert system.messages == [{"role": "system", "content": "Talk to the echo."}, {"role": "user", "content": READY}]
    user, _ = play(openenv(url=echo.url, observation_field="echoed_message", prompt_role="user"), RECORDS[0], [])
    assert user.messages == [{"role": "user", "content": f"Talk to the echo.\n\n{READY}"}]


def test_each_episode_has_a_session_of_its_own_and_close_ends_it(echo):
    """Interleaved episodes on one instance: each its own WebSocket session (the echo counts each
    session's steps), and close releases it."""
    environment = openenv(url=echo.url, observation_field="echoed_message")
    first, second = environment.reset(RECORDS[0], 0), environment.reset(RECORDS[0], 1)
    try:
        steps = [environment.step(state, read_reply(text, 1)) for state, text in ((first.state, "a"), (second.state, "b"),
                                                                                   (first.state, "c"))]
    finally:
        environment.close(first.state)
        environment.close(second.state)
    assert [(s.messages[0]["content"], s.info["step"]) for s in steps] == [("a", 1.0), ("b", 1.0), ("c", 2.0)]


def test_a_server_with_fewer_sessions_than_episodes_says_so_and_close_frees_a_session(servers):
    """/one runs one session at a time (OpenEnv's default): a second episode at once fails, saying
    what to raise; once the first is closed its session is free for the next."""
    environment = openenv(url=f"{servers.url}/one", observation_field="text")
    first = environment.reset(RECORDS[0], 0)
    with pytest.raises(RuntimeError, match=r"CAPACITY_REACHED\); the server runs fewer sessions at once than the episodes rlkit "
                                           "plays at once .*: raise max_concurrent_envs in its create_app"):
        environment.reset(RECORDS[0], 1)
    environment.close(first.state)
    deadline = time.monotonic() + 5
    while True:  # the server ends the session once it has read the close
        try:
            second = environment.reset(RECORDS[0], 1)
            break
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    assert second.messages == [{"role": "user", "content": "say something"}]
    environment.close(second.state)


class TestEchoContract(EnvironmentContract):
    component = "openenv"

    @pytest.fixture
    def component_config(self, echo):
        return {"url": echo.url, "observation_field": "echoed_message"}


# the located errors of a recipe that cannot work, raised when the environment is built
def test_a_server_that_does_not_answer_at_the_start_is_a_located_error_naming_the_url():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RecipeError, match=rf"\$\.environment\.url: no OpenEnv server answers at {url} \(GET /health: "
                                          r"ConnectionRefusedError: .*\); start the environment's server"):
        openenv(url=url)


def test_an_action_field_the_server_does_not_have_is_a_located_error(echo):
    with pytest.raises(RecipeError, match=rf"\$\.environment\.text_field: the server at {echo.url}'s action has no field 'text'; "
                                          "its fields: message$"):
        openenv(url=echo.url, text_field="text")
    with pytest.raises(RecipeError, match=r"\$\.environment\.action_fields: .* has no field 'mood'"):
        openenv(url=echo.url, action_fields={"mood": "calm"})


def test_an_observation_field_the_environment_does_not_have_is_a_located_error(echo):
    with pytest.raises(RecipeError, match=r"\$\.environment\.observation_field: the environment's observation has no 'text' \(at "
                                          r"'text' it has: echoed_message, message_length, metadata\)"):
        play(openenv(url=echo.url, observation_field="text"), RECORDS[0], [])


def test_tool_calls_need_an_environment_that_lists_tools(echo):
    with pytest.raises(RecipeError, match=r"\$\.environment\.action: 'tool_call' needs an MCP environment, one that answers "
                                          r"ListToolsAction, and listing its tools failed: .*Server error"):
        openenv(url=echo.url, action="tool_call")


@pytest.mark.parametrize("settings, line", [
    ({}, "$.environment: name the OpenEnv environment by exactly one of 'url' (a running server) and 'factory'"),
    ({"url": "localhost:8000"}, "$.environment.url: 'localhost:8000' is not an http://, https://, ws:// or wss:// URL"),
    ({"url": "http://localhost:8000", "action_fields": {"message": "x"}},
     "$.environment.action_fields: sets 'message', the field the reply's text goes into (text_field)"),
])
def test_rlkit_check_locates_settings_that_cannot_work(recipe_document, write_recipe, capsys, settings, line):
    recipe_document.pop("reward")
    recipe_document["environment"] = {"type": "openenv", **settings}
    code = main(["check", "--offline", write_recipe(recipe_document)])
    err = capsys.readouterr().err
    assert code == 2 and f"  {line}" in err and "Traceback" not in err, err


def test_rlkit_check_probes_the_server(recipe_document, write_recipe, capsys, echo):
    """Online, the probe asks GET /health (a dead URL is located); the first record's reset is the
    core's own probe, through the session."""
    recipe_document.pop("reward")
    recipe_document["environment"] = {"type": "openenv", "url": echo.url, "observation_field": "echoed_message"}
    code = main(["check", write_recipe(recipe_document)])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "on the first record of the data: 1 opening message(s), ok" in out.out
    dead = f"http://127.0.0.1:{free_port()}"
    recipe_document["environment"]["url"] = dead
    code = main(["check", write_recipe(recipe_document)])
    err = capsys.readouterr().err
    assert code == 2 and f"$.environment.url: no OpenEnv server answers at {dead}" in err, err


def test_without_the_package_rlkit_check_says_how_to_install_it(recipe_document, write_recipe, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "openenv.core", None)
    recipe_document.pop("reward")
    recipe_document["environment"] = {"type": "openenv", "url": "http://localhost:8000"}
    code = main(["check", "--offline", write_recipe(recipe_document)])
    err = capsys.readouterr().err
    assert code == 2 and "  $.environment.type: 'openenv' needs the openenv package: pip install 'rlkit[openenv]'" in err, err


def test_the_plugin_registers_without_openenv(monkeypatch):
    """`rlkit plugins` imports every plugin: this one must import without the package."""
    monkeypatch.setitem(sys.modules, "openenv", None)
    monkeypatch.delitem(sys.modules, "rlkit_plugins.openenv_envs")
    importlib.import_module("rlkit_plugins.openenv_envs")


# failures during the run: episode statuses, never a reward
def test_a_server_that_dies_during_the_run_ends_its_episodes_as_errors(recipe_document, builtin_registry, chatml):
    path, tokenizer = chatml
    server = Server("openenv_servers:slow_app", TESTS)
    try:
        trainer = trainer_for(recipe_document, builtin_registry, path, tokenizer, [turn_ids(tokenizer, "hi")], url=server.url,
                              observation_field="text")
    finally:
        server.stop()
    with pytest.warns(UserWarning, match=rf"the environment's reset raised RuntimeError: the OpenEnv session at {server.url} could not "
                                         r"be opened: ConnectionError: Failed to connect"):
        batch, metrics = rollout_with(trainer, RECORDS)
    assert metrics["env/status_error"] == 1.0 and not batch.loss_mask.any()


def test_a_step_the_server_does_not_answer_in_time_is_a_timeout(recipe_document, builtin_registry, chatml, servers):
    """/slow sleeps 30 s on "hang": the client gives up at step_timeout_s, and the episode ends as a timeout."""
    path, tokenizer = chatml
    trainer = trainer_for(recipe_document, builtin_registry, path, tokenizer, [turn_ids(tokenizer, "hang")], url=f"{servers.url}/slow",
                          observation_field="text", step_timeout_s=2.0)
    started = time.monotonic()
    batch, metrics = rollout_with(trainer, RECORDS)
    assert metrics["env/status_timeout"] == 1.0 and not batch.loss_mask.any()
    assert time.monotonic() - started < 20


def test_an_error_the_server_sends_back_ends_the_episode_as_an_error(servers):
    """A reset the environment refuses (a secret that is no number) comes back as the server's
    error frame: the step's exception, which the core makes the episode's "error"."""
    environment = openenv(url=f"{servers.url}/tools", action="tool_call", reset_columns=["secret"])
    with pytest.raises(RuntimeError, match=rf"the OpenEnv reset at {servers.url}/tools failed: RuntimeError: Server error: .*"
                                           r"\(code: EXECUTION_ERROR\)"):
        environment.reset({"prompt": "x", "secret": "five"}, 0)


# tool calls: the MCP environments
HINT = '<tool_call>\n{"name": "hint", "arguments": {"guess": 5}}\n</tool_call>'
SUBMIT = '<tool_call>\n{"name": "submit", "arguments": {"answer": 3}}\n</tool_call>'
SECRET = [{"prompt": "Find it.", "secret": 3}] * 2


def test_an_mcp_environments_tools_are_shown_and_each_call_is_a_call_tool_action(servers):
    environment = openenv(url=f"{servers.url}/tools", action="tool_call", reset_columns=["secret"], observation_field="prompt")
    assert [(t["function"]["name"], t["function"]["parameters"]["required"]) for t in environment.tools()] == [("hint", ["guess"]),
                                                                                                             ("submit", ["answer"])]
    opening, [hint, both] = play(environment, SECRET[0], [HINT, HINT + "\n" + SUBMIT])
    assert opening.messages == [{"role": "user", "content": "Find the number between 1 and 9."}]
    assert opening.info == {"tools": 2.0, "tool_calls": 0.0, "tool_errors": 0.0}
    assert (hint.messages, hint.reward, hint.done) == ([{"role": "tool", "name": "hint", "content": "lower"}], None, False)
    assert (both.reward, both.done, both.info) == (1.0, True, {"tool_calls": 3.0, "tool_errors": 0.0})


def test_a_reply_without_a_tool_call_ends_and_a_bad_call_is_told(servers):
    environment = openenv(url=f"{servers.url}/tools", action="tool_call")
    _, [unknown, unreadable, plain] = play(environment, SECRET[0], [
        '<tool_call>\n{"name": "shout", "arguments": {}}\n</tool_call>', '<tool_call>\n{"name": "hint"', "It is 3."])
    assert unknown.messages[0]["name"] == "shout" and unknown.messages[0]["content"].startswith("Error: ") and not unknown.done
    assert unknown.info["tool_errors"] == 1.0
    assert unreadable.messages[0]["content"].startswith("Error: your tool call could not be read") and not unreadable.done
    assert (plain.messages, plain.reward, plain.done) == ([], None, True)


def test_an_mcp_episode_through_the_runner_earns_the_submit_reward(recipe_document, builtin_registry, chatml, servers):
    path, tokenizer = chatml
    turns = [turn_ids(tokenizer, HINT), turn_ids(tokenizer, SUBMIT)]
    trainer = trainer_for(recipe_document, builtin_registry, path, tokenizer, turns, url=f"{servers.url}/tools", action="tool_call",
                          reset_columns=["secret"], observation_field="prompt")
    batch, metrics = rollout_with(trainer, SECRET)
    assert (metrics["env/status_ok"], metrics["env/turns"], metrics["env/reward"]) == (1.0, 2.0, 1.0)
    assert (metrics["env/tool_calls"], metrics["env/tool_errors"]) == (2.0, 0.0)
    assert batch.scores.tolist() == [1.0, 1.0] and sampled_of(batch) == [turns[0] + turns[1]] * 2


# the factory: an environment in this process, or a client made by the recipe's own code
def test_an_in_process_environment_plays_with_its_action_class():
    environment = openenv(factory="tests.openenv_servers:slow", action_class="tests.openenv_servers:SlowAction", observation_field="text")
    opening, [step] = play(environment, RECORDS[0], ["hi"])
    assert opening.messages == [{"role": "user", "content": "say something"}]
    assert (step.messages, step.reward, step.done) == ([{"role": "user", "content": "hi"}], 1.0, False)
    with pytest.raises(RecipeError, match=r"\$\.environment\.action_class: 'tests\.openenv_servers:slow' returns an in-process OpenEnv "
                                          "Environment, which takes its own Action objects"):
        openenv(factory="tests.openenv_servers:slow").reset(RECORDS[0], 0)
    with pytest.raises(RecipeError, match=r"\$\.environment\.text_field: tests\.openenv_servers:SlowAction's action has no field 'text'; "
                                          "its fields: message$"):
        openenv(factory="tests.openenv_servers:slow", action_class="tests.openenv_servers:SlowAction", text_field="text")


def test_an_in_process_mcp_environment_plays_its_tools():
    environment = openenv(factory="tests.openenv_servers:tools", action="tool_call", reset_columns=["secret"], observation_field="prompt")
    assert [t["function"]["name"] for t in environment.tools()] == ["hint", "submit"]
    _, [hint, submit] = play(environment, SECRET[0], [HINT, SUBMIT])
    assert hint.messages == [{"role": "tool", "name": "hint", "content": "lower"}] and (submit.reward, submit.done) == (1.0, True)


ECHO_URL: list[str] = []


def echo_client():
    """A factory that returns an OpenEnv client of its own making (the URL the test sets)."""
    from openenv.core import GenericEnvClient

    return GenericEnvClient(base_url=ECHO_URL[0])


def test_a_factory_may_return_a_client(echo, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ECHO_URL", [echo.url])
    environment = openenv(factory=f"{__name__}:echo_client", observation_field="echoed_message")
    opening, [step] = play(environment, RECORDS[0], ["hey"])
    assert opening.messages == [{"role": "user", "content": READY}] and step.messages == [{"role": "user", "content": "hey"}]
    with pytest.raises(RecipeError, match=r"\$\.environment\.factory: 'os:getcwd' returned str, not an OpenEnv client"):
        openenv(factory="os:getcwd").reset(RECORDS[0], 0)


@pytest.mark.slow
def test_an_echo_recipe_trains_through_the_rlkit_command(tmp_path, recipe_document, write_recipe, echo):
    """The echo template through the `rlkit` command: a tiny model made to end its turns early (so
    that episodes reach the echo), the echo's rewards alone (a turn earns 0.1 a character, up to 1),
    two iterations; each trained row carries the episodes' `env/` figures."""
    model = ending_model(tmp_path / "model")
    recipe_document.pop("reward")
    recipe_document["policy"] = {"type": "hf", "model": str(model), "dtype": "float32"}
    recipe_document["ppo"] = {"batch_size": 8, "minibatch_size": 4, "samples_per_prompt": 4, "epochs": 1}
    recipe_document["generator"] = {"max_new_tokens": 12}
    recipe_document["environment"] = {"type": "openenv", "url": echo.url, "observation_field": "echoed_message", "max_turns": 2}
    data = tmp_path / "episodes.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Episode {index}"}) + "\n" for index in range(8)))
    recipe_document["data"] = {"type": "jsonl", "path": str(data)}
    done = subprocess.run([str(Path(sys.executable).with_name("rlkit")), "run", write_recipe(recipe_document), "--quiet"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [row for row in rows if "score/mean" in row]
    assert len(trained) == 2, rows
    for row in trained:
        assert 0.0 <= row["score/mean"] <= 2.0 and row["env/status_ok"] > 0.0 and row["env/turns"] >= 1 and row["env/step"] >= 1.0
        assert row["env/status_error"] == row["env/status_timeout"] == 0.0


def test_rlkit_check_lists_the_factory_and_plays_its_first_record(recipe_document, write_recipe, capsys):
    recipe_document.pop("reward")
    recipe_document["environment"] = {"type": "openenv", "factory": "tests.openenv_servers:slow",
                                      "action_class": "tests.openenv_servers:SlowAction", "observation_field": "text"}
    code = main(["check", write_recipe(recipe_document)])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert ("[environment] imports the module 'tests.openenv_servers' for its factory 'slow' ($.environment.factory)" in out.out
            and "on the first record of the data: 1 opening message(s), ok" in out.out), out.out


@pytest.mark.slow
def test_the_shipped_recipe_plays_its_in_process_game_and_trains(tmp_path):
    """recipes/grpo_openenv.toml as a user would shrink it to try it, from the repository root (its
    factory is a path from there): `rlkit check --offline` passes; with a tiny model in place of the
    hub one, `rlkit check` resets the game on the first record, and `rlkit run` trains two
    iterations of the game (examples/openenv/guess_number.py, in process) whose episodes reach it."""
    recipe, root, rlkit = TESTS.parent / "recipes" / "grpo_openenv.toml", TESTS.parent, str(Path(sys.executable).with_name("rlkit"))
    checked = subprocess.run([rlkit, "check", "--offline", str(recipe)], capture_output=True, text=True, timeout=300, cwd=root)
    assert checked.returncode == 0, checked.stdout[-2000:] + checked.stderr[-3000:]
    model = ending_model(tmp_path / "model", "gpt2")  # ends its turns after a token or three, so the game answers them
    small = {"run.steps": 2, "run.output_dir": str(tmp_path / "run"), "run.threads": 1, "policy.model": str(model), "policy.dtype": "float32",
             "ppo.batch_size": 8, "ppo.samples_per_prompt": 4, "ppo.minibatch_size": 4, "generator.max_new_tokens": 6,
             "environment.max_turns": 3, "environment.max_episode_tokens": 120, "data.size": 32, "eval.size": 4, "eval.every": 0,
             "tracker.type": "none"}
    overrides = [f"--set={key}={value!r}" if isinstance(value, str) else f"--set={key}={value}" for key, value in small.items()]
    probed = subprocess.run([rlkit, "check", str(recipe), *overrides], capture_output=True, text=True, timeout=300, cwd=root)
    assert probed.returncode == 0 and "reset               on the first record of the data: 1 opening message(s), ok" in probed.stdout, \
        probed.stdout[-2000:] + probed.stderr[-3000:]
    done = subprocess.run([rlkit, "run", str(recipe), *overrides, "--quiet"], capture_output=True, text=True, timeout=600, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [row for row in rows if "score/mean" in row]
    assert len(trained) == 2, rows
    for row in trained:  # a return is at most 1 (a win) and at least -0.05 a guess
        assert -0.15 <= row["score/mean"] <= 1.0 and "train/approx_kl" in row and row["env/status_ok"] > 0.0 and row["env/guesses"] >= 1.0
        assert 0.0 <= row["env/won"] <= 1.0 and row["env/status_error"] == row["env/status_timeout"] == 0.0
    assert any("eval/score" in row for row in rows)
