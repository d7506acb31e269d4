"""verifiers' environments (Prime Intellect's `verifiers` 0.4.0, its `verifiers.v1` stack) as the
rlkit environment `verifiers` and the prompt source `verifiers-dataset`.

A verifiers environment drives the model itself: its harness (an agent program, or a loop in
process) calls an OpenAI-compatible model through verifiers' interception server, which records the
trace; then the task's `@vf.reward` and `@vf.metric` functions (and any judges) score it. So this
environment is a `HarnessEnvironment`: per episode, `play` rebuilds the record's verifiers task and
runs verifiers' own episode (`Env.run_slot`) with the run's model behind the interception, and
returns the weighted reward with every reward's score and metric as a figure. rlkit adds no
scoring rule, and keeps every token the policy sampled as sampled.

The model verifiers reaches is a relay in this process (`Relay`): each request verifiers sends
upstream names its trace (`X-Session-ID`), which the relay maps to the episode's session of
rlkit's endpoint; it forwards the request there without `stream` and `stream_options` (the
endpoint answers whole) and answers a streamed request as server-sent events. The run's sampling
is verifiers' sampling for the episode (`temperature`, `max_tokens`), which verifiers imposes on
every request, so a harness's own values never reach the endpoint.

The package is imported only when a part is checked or built, so that `rlkit plugins` works
without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import json
import math
import os
import secrets
import socket
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import attrs

from rlkit_core import (
    HarnessEnvironment,
    PromptLengthLimit,
    PromptSource,
    RecipeError,
    StandardEpisode,
    at_least,
    building_at,
    hookimpl,
    load_module,
    setting,
)

INSTALL = "pip install 'rlkit[verifiers]'"
# the environment variable that holds the relay's key, read by verifiers' client (`api_key_var`);
# its name holds API_KEY, so verifiers' subprocess runtime keeps it from the harness's programs
KEY_VARIABLE = "RLKIT_VERIFIERS_RELAY_API_KEY"
STARTUP_S = 120.0  # the most the relay and verifiers' serving resources may take to come up


@attrs.frozen(slots=False)  # a base beside StandardEpisode or PromptLengthLimit, whose slots would clash
class VerifiersSource:
    """Which verifiers environment: by id, as verifiers loads one, or built by a callable."""

    env_id: str = setting("", help="a verifiers environment id: its taskset's id (an installed package that exports a vf.Taskset, e.g. "
                                   "'gsm8k-v1'), or 'env+taskset' to pair an Env id with it (e.g. 'best-of-n+gsm8k-v1'), as vf-eval takes it",
                          kw_only=True)
    environment: str = setting("", help="instead of env_id: a Python callable 'package.module:function' or 'path/to/file.py:function' that "
                                        "returns a vf.Env, called with env_args as keyword arguments", kw_only=True)
    env_args: dict[str, Any] = setting(factory=dict, help="with env_id: the rest of verifiers' [env] table (e.g. {taskset = {num_tasks = 100}, "
                                                           "agent = {max_turns = 4}}); with environment: the callable's keyword arguments",
                                       kw_only=True)


@attrs.frozen
class VerifiersConfig(StandardEpisode, VerifiersSource):
    model: str = setting("policy", help="the model name verifiers asks for and the endpoint answers as", kw_only=True)


@attrs.frozen
class VerifiersDatasetConfig(PromptLengthLimit, VerifiersSource):
    size: int = setting(0, help="tasks to take from the taskset, in its order (0: all of them; an infinite taskset needs a size)",
                        validator=at_least(0), kw_only=True)


def import_verifiers(where: str, type_name: str):
    """`verifiers.v1`, or a located error saying how to install it."""
    try:
        import verifiers.v1 as vf  # pyright: ignore[reportMissingImports] (an optional extra)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != "verifiers":
            raise RecipeError([f"{where}.type: the verifiers package failed to import: {exc}"]) from None
        raise RecipeError([f"{where}.type: {type_name!r} needs the verifiers package (Python >= 3.11): {INSTALL}"]) from None
    return vf


def load_callable(spec: str, where: str) -> Callable:
    """The callable `spec` names: 'package.module:function' or 'path/to/file.py:function'."""
    module_name, _, name = spec.rpartition(":")
    if not module_name or not name:
        raise RecipeError([f"{where}: {spec!r} is not 'package.module:function' or 'path/to/file.py:function'"])
    try:
        module = load_module(module_name, "rlkit_verifiers")
    except Exception as exc:
        raise RecipeError([f"{where}: {module_name!r} could not be loaded ({type(exc).__name__}: {exc}); name an importable module or a file "
                           "relative to the working directory"]) from None
    function = getattr(module, name, None)
    if not callable(function):
        raise RecipeError([f"{where}: {module_name!r} has no callable {name!r}"])
    return function


def validation_problems(exc: Exception, where: str) -> list[str]:
    """A pydantic ValidationError as located lines (other errors as one)."""
    from pydantic import ValidationError

    if not isinstance(exc, ValidationError):
        return [f"{where}: {type(exc).__name__}: {exc}"]
    return [f"{where}{''.join(f'.{part}' for part in error['loc'] if isinstance(part, str))}: {error['msg']}" for error in exc.errors()]


def source_problems(config: VerifiersSource, where: str) -> list[str]:
    if bool(config.env_id) == bool(config.environment):
        return [f"{where}: name the verifiers environment as exactly one of 'env_id' (an id verifiers loads) and 'environment' "
                "(a Python callable that returns a vf.Env)"]
    return []


def load_environment(config: VerifiersSource, where: str, type_name: str):
    """The vf.Env `config` names (see `VerifiersSource`), or a located error."""
    problems = source_problems(config, where)
    if problems:
        raise RecipeError(problems)
    vf = import_verifiers(where, type_name)
    if config.environment:
        build = load_callable(config.environment, f"{where}.environment")
        try:
            env = build(**config.env_args)
        except Exception as exc:
            raise RecipeError([f"{where}.environment: {config.environment!r} raised {type(exc).__name__}: {exc}"]) from None
        if not isinstance(env, vf.Env):
            raise RecipeError([f"{where}.environment: {config.environment!r} returned {type(env).__name__}, not a vf.Env"])
        return env
    pair, _, taskset = config.env_id.rpartition("+")
    if not taskset:
        raise RecipeError([f"{where}.env_id: {config.env_id!r} names no taskset (an id, or 'env+taskset')"])
    try:
        vf.import_taskset(taskset)
    except ModuleNotFoundError as exc:
        raise RecipeError([f"{where}.env_id: verifiers has no environment {config.env_id!r}: {exc} (prime env install <owner>/<name>, or pip "
                           "install the environment's package)"]) from None
    except Exception as exc:
        raise RecipeError([f"{where}.env_id: the package of {taskset!r} failed to import: {type(exc).__name__}: {exc}"]) from None
    table = dict(config.env_args)
    if "id" in table or "id" in (table.get("taskset") or {}):
        raise RecipeError([f"{where}.env_args: leave 'id' out; env_id names the environment ({config.env_id!r})"])
    table["taskset"] = {**(table.get("taskset") or {}), "id": taskset}
    if pair:
        table["id"] = pair
    try:
        env_config = with_local_runtimes(vf.resolve_env_config(table), config.env_args)
        return vf.load_environment(env_config)
    except Exception as exc:
        raise RecipeError(validation_problems(exc, f"{where}.env_args")) from None


def with_local_runtimes(env_config, table: dict[str, Any]):
    """Each agent whose runtime is verifiers' default (a Prime sandbox, which needs an account and
    a tunnel) and not set in `table` runs in a local subprocess instead."""
    from verifiers.v1 import PrimeConfig, SubprocessConfig  # pyright: ignore[reportMissingImports] (an optional extra)
    from verifiers.v1.configs.agent import agent_config_fields  # pyright: ignore[reportMissingImports] (an optional extra)

    local = {}
    for name, agent in agent_config_fields(env_config).items():
        if isinstance(agent.runtime, PrimeConfig) and "runtime" not in (table.get(name) or {}):
            local[name] = agent.model_copy(update={"runtime": SubprocessConfig()})
    return env_config.model_copy(update=local) if local else env_config


def check_source(config: VerifiersSource, where: str, type_name: str) -> list[str]:
    """What `rlkit check` can say without building the environment or importing what it names:
    the package is there, the environment is named once, and an id's package is installed."""
    problems = source_problems(config, where)
    if problems:
        return problems
    try:
        vf = import_verifiers(where, type_name)
    except RecipeError as exc:
        return exc.problems
    if config.env_id:
        taskset = config.env_id.rpartition("+")[2]
        if not taskset:
            return [f"{where}.env_id: {config.env_id!r} names no taskset (an id, or 'env+taskset')"]
        module = taskset.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()  # as verifiers imports an id
        if not installed(module) and not (Path(vf.__file__ or ".").parent / "tasksets" / module).is_dir():
            return [f"{where}.env_id: verifiers has no environment {config.env_id!r}: no installed package {module!r} (prime env install "
                    "<owner>/<name>, or pip install the environment's package)"]
    return []


def imports_of(config: VerifiersSource, where: str) -> list[str]:
    """The code a part imports for its environment (listed by `rlkit check`)."""
    if config.environment:
        target, _, name = config.environment.rpartition(":")
        what = f"the file {str(Path(target).resolve())!r}" if target.endswith(".py") else f"the module {target!r}"
        return [f"{what} for its function {name!r} ({where}.environment)"]
    if config.env_id:
        return [f"verifiers' environment {config.env_id!r}: its taskset's package and those its [env] table names ({where}.env_id)"]
    return []


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def task_of(env, record: dict[str, Any], where: str):
    """The verifiers task of a record: its `task` column (the task's data as verifiers-dataset
    wrote it), else the record's columns that name the task data's fields, its `messages` (a chat
    record) or `prompt` as the task's prompt."""
    task_type = type(env.taskset).task_type()
    data_type = task_type.data_type()
    if isinstance(record.get("task"), dict):
        fields = dict(record["task"])
    else:
        fields = {key: value for key, value in record.items() if key in data_type.model_fields and value is not None}
        prompt = record.get("messages") if record.get("messages") is not None else record.get("prompt")
        if prompt is not None:
            fields["prompt"] = prompt
    try:
        data = data_type.model_validate(fields)
    except Exception as exc:
        columns = ", ".join(sorted(record)) or "none"
        raise RecipeError([f"{where}: a record (columns: {columns}) does not make a {data_type.__name__}: "
                           + "; ".join(validation_problems(exc, "task"))
                           + "; use data.type = 'verifiers-dataset', or give the columns the task's fields"]) from None
    return task_type(data, env.config.taskset.task)


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def outcome(episode) -> dict[str, float]:
    """The episode's reward and figures, from the traces of its trainable agents (all of them when
    none is): the weighted reward, each reward's score and each metric, averaged over them. An
    episode verifiers did not complete raises, with verifiers' error."""
    traces = [trace for trace in episode.traces if trace.agent.trainable] or list(episode.traces)
    if not episode.ok or not traces:
        errors = [*episode.errors, *(error for trace in episode.traces for error in trace.errors)]
        why = f"{errors[-1].type}: {errors[-1].message}" if errors else "it produced no trace"
        raise RuntimeError(f"verifiers' episode failed: {why[:1500]}")
    figures: dict[str, list[float]] = {}
    for trace in traces:
        scores = {name: reward.score for name, reward in trace.rewards.items() if reward is not None}
        scores |= {name: value for name, value in trace.metrics.items() if value is not None and name not in scores}
        for name, value in scores.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                figures.setdefault(name, []).append(float(value))
    return {**{name: mean(values) for name, values in figures.items()}, "reward": mean([trace.reward for trace in traces])}


def server_sent(completion: dict[str, Any], include_usage: bool) -> bytes:
    """A whole chat completion as the events of a streamed one: one chunk with the message as its
    delta (tool calls with their index), the usage when asked for and known, then [DONE]."""
    choice = completion["choices"][0]
    message = dict(choice.get("message") or {})
    delta: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        delta["tool_calls"] = [{**call, "index": index} for index, call in enumerate(message["tool_calls"])]
    head = {key: value for key, value in completion.items() if key not in ("choices", "usage", "object")}
    chunks = [{**head, "object": "chat.completion.chunk",
               "choices": [{**{k: v for k, v in choice.items() if k != "message"}, "delta": delta}]}]
    if include_usage and completion.get("usage") is not None:
        chunks.append({**head, "object": "chat.completion.chunk", "choices": [], "usage": completion["usage"]})
    return b"".join(f"data: {json.dumps(chunk)}\n\n".encode() for chunk in chunks) + b"data: [DONE]\n\n"


class Relay:
    """The OpenAI-compatible server verifiers' client reaches (see the module): on loopback, in the
    runner's event loop, keyed by a secret of this process. `routes` maps a verifiers trace id to
    the (base URL, key) of its episode's session."""

    def __init__(self, model: str, key: str):
        self.model, self.key = model, key
        self.routes: dict[str, tuple[str, str]] = {}
        self.url = ""  # set by `start`, with aiohttp's `web` and the client that forwards
        self.web: Any = None
        self.http: Any = None

    async def start(self, stack: contextlib.AsyncExitStack) -> None:
        import httpx
        from aiohttp import web  # pyright: ignore[reportMissingImports] (verifiers' dependency)

        self.web = web
        self.http = await stack.enter_async_context(httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)))
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        listener.bind(("127.0.0.1", 0))
        await web.SockSite(runner, listener).start()
        self.url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1"

    def refused(self, status: int, message: str, code: str):
        return self.web.json_response({"error": {"message": message, "type": "invalid_request_error", "code": code}}, status=status)

    def authorized(self, request) -> bool:
        return secrets.compare_digest(request.headers.get("Authorization", ""), f"Bearer {self.key}")

    async def models(self, request):
        if not self.authorized(request):
            return self.refused(401, "not this relay's key", "invalid_api_key")
        return self.web.json_response({"object": "list", "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": "rlkit"}]})

    async def chat(self, request):
        if not self.authorized(request):
            return self.refused(401, "not this relay's key", "invalid_api_key")
        route = self.routes.get(request.headers.get("X-Session-ID", ""))
        if route is None:
            return self.refused(410, "this request's verifiers trace belongs to no open episode", "episode_ended")
        try:
            body = await request.json()
        except ValueError:
            return self.refused(400, "the request body is not JSON", "invalid_request")
        if not isinstance(body, dict):
            return self.refused(400, "the request body is not a JSON object", "invalid_request")
        stream = bool(body.pop("stream", False))
        include_usage = bool((body.pop("stream_options", None) or {}).get("include_usage"))
        base_url, key = route
        try:
            answer = await self.http.post(f"{base_url}/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        except Exception as exc:  # the endpoint is this process's: it went away only as the run ends
            return self.refused(502, f"rlkit's endpoint did not answer: {type(exc).__name__}: {exc}", "endpoint_unreachable")
        if answer.status_code != 200 or not stream:
            return self.web.Response(body=answer.content, status=answer.status_code, content_type="application/json")
        return self.web.Response(body=server_sent(answer.json(), include_usage), content_type="text/event-stream")


class Runner:
    """An event loop in a thread of its own, in which verifiers' serving resources (its
    interception, the env's shared tools) and the relay stay up, and episodes run, until `close`."""

    def __init__(self, env, model: str, key: str):
        self.env = env
        self.relay = Relay(model, key)
        self.loop = asyncio.new_event_loop()
        self.serving: asyncio.Task | None = None  # the task that holds the resources up
        self.stop: asyncio.Event | None = None
        self.thread = threading.Thread(target=self._run, daemon=True, name="rlkit-verifiers")
        self.thread.start()
        ready: Future = Future()
        asyncio.run_coroutine_threadsafe(self._serve(ready), self.loop)
        try:
            ready.result(timeout=STARTUP_S)
        except BaseException:
            self.close()
            raise

    def _run(self) -> None:
        self.loop.run_forever()
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()

    async def _serve(self, ready: Future) -> None:
        """Holds the resources up until `close`: entered and left in this one task, as verifiers'
        context managers want."""
        self.serving, self.stop = asyncio.current_task(), (stop := asyncio.Event())
        try:
            async with contextlib.AsyncExitStack() as stack:
                await self.relay.start(stack)
                await stack.enter_async_context(self.env.serving())
                ready.set_result(None)
                await stop.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
            raise

    def submit(self, coroutine) -> Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def close(self) -> None:
        """Cancels the episodes still running, takes the resources down and ends the thread."""
        if self.loop.is_closed():
            return

        async def finish() -> None:
            episodes = [task for task in asyncio.all_tasks() if task not in (asyncio.current_task(), self.serving)]
            for task in episodes:
                task.cancel()
            await asyncio.gather(*episodes, return_exceptions=True)
            if self.stop is not None and self.serving is not None:
                self.stop.set()
                await asyncio.gather(self.serving, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(finish(), self.loop).result(timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


class Verifiers(HarnessEnvironment):
    """A verifiers environment's episode per record, through the endpoint (see the module)."""

    requires = {"verifiers": "rlkit[verifiers]", "starlette": "rlkit[verifiers]", "uvicorn": "rlkit[verifiers]"}

    def __init__(self, config: VerifiersConfig, context=None):
        self.where = building_at(context, "environment")
        self.vf_env = load_environment(config, self.where, "verifiers")
        super().__init__(config, context, model=config.model)
        self.config = config
        self.runner: Runner | None = None
        self.starting = threading.Lock()
        self.running: dict[str, Future] = {}  # by the session's key: the episode verifiers runs for it

    @staticmethod
    def check(config: VerifiersConfig, recipe, where: str) -> tuple[list[str], list[str]]:
        problems = check_source(config, where, "verifiers")
        data = recipe.components.get("data")
        notes = []
        if not problems and data is not None and data.component.factory is VerifiersDataset:
            if (config.env_id, config.environment) != (data.config.env_id, data.config.environment):
                notes.append(f"{where}: names another verifiers environment than data does (env_id, environment): the records' tasks must be "
                             "of the environment's task type")
        return problems, notes

    @staticmethod
    def imports(config: VerifiersConfig, where: str) -> list[str]:
        return imports_of(config, where)

    def reset(self, record, seed):
        task_of(self.vf_env, record, self.where)  # a record that makes no task stops the run, located, before any episode starts
        return super().reset(record, seed)

    def play(self, record: dict[str, Any], client: Any) -> Any:
        task = task_of(self.vf_env, record, self.where)
        future = self._runner().submit(self._episode(task, str(client.base_url).rstrip("/"), client.api_key))
        self.running[client.api_key] = future
        try:
            return outcome(future.result())
        finally:
            self.running.pop(client.api_key, None)

    def close(self, state) -> None:
        super().close(state)
        future = self.running.pop(state.session.key, None)
        if future is not None:
            future.cancel()  # the episode ended on rlkit's side: verifiers' is cut short (its trace is not scored)

    def _runner(self) -> Runner:
        with self.starting:
            if self.runner is None:
                key = os.environ.setdefault(KEY_VARIABLE, secrets.token_urlsafe(24))  # what verifiers' client sends
                self.runner = Runner(self.vf_env, self.limits.model, key)
                weakref.finalize(self, self.runner.close)  # when the environment goes, or at exit
            return self.runner

    async def _episode(self, task, base_url: str, key: str):
        from verifiers.v1 import EvalClientConfig, ModelContext, SamplingConfig  # pyright: ignore[reportMissingImports] (an optional extra)

        runner = self.runner
        assert runner is not None
        relay = runner.relay
        traces: list[str] = []

        def route(trace) -> None:  # each trace verifiers mints for the episode (one per agent run), before its first request
            traces.append(trace.id)
            relay.routes[trace.id] = (base_url, key)

        context = ModelContext(model=self.limits.model, client=EvalClientConfig(base_url=relay.url, api_key_var=KEY_VARIABLE),
                               sampling=SamplingConfig(temperature=self.limits.temperature, max_tokens=self.limits.max_new_tokens))
        (slot,) = self.vf_env.slots(task)
        try:
            return await self.vf_env.run_slot(slot, context, on_trace=route)
        finally:
            for trace_id in traces:
                relay.routes.pop(trace_id, None)


class VerifiersDataset(PromptSource):
    """The environment's taskset as records: `prompt` (the task's prompt as text) and `task` (the
    task's data as verifiers serialises it, from which the `verifiers` environment rebuilds it)."""

    requires = {"verifiers": "rlkit[verifiers]"}

    def __init__(self, config: VerifiersDatasetConfig, context=None):
        self.config = config
        self.where = building_at(context, "data")

    @staticmethod
    def check(config: VerifiersDatasetConfig, recipe, where: str) -> tuple[list[str], list[str]]:
        return check_source(config, where, "verifiers-dataset"), []

    @staticmethod
    def imports(config: VerifiersDatasetConfig, where: str) -> list[str]:
        return imports_of(config, where)

    def load(self) -> list[dict[str, Any]]:
        taskset = load_environment(self.config, self.where, "verifiers-dataset").taskset
        if self.config.size:
            taskset = taskset.take(self.config.size)
        elif not taskset.bounded:
            raise RecipeError([f"{self.where}.size: the taskset {type(taskset).__name__} is infinite; set how many tasks to take"])
        records = [record_of(task) for task in taskset]
        if not records:
            raise RecipeError([f"{self.where}: the taskset {type(taskset).__name__} has no task"])
        return records


def record_of(task) -> dict[str, Any]:
    return {"prompt": task.data.prompt_text, "task": task.data.model_dump(mode="json", exclude_defaults=True)}


@hookimpl
def register_environments(register):
    register("verifiers", Verifiers, VerifiersConfig)


@hookimpl
def register_prompt_sources(register):
    register("verifiers-dataset", VerifiersDataset, VerifiersDatasetConfig)
