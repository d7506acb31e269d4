"""OpenEnv's environments as the rlkit environment `openenv`: each episode opens its own session on
an OpenEnv environment server (a WebSocket, which is where OpenEnv keeps an episode's state; its
HTTP /reset and /step make a fresh environment per request), resets it, and turns each of the
model's turns into one of the environment's actions. So the rewards are the environment's own and
rlkit adds no scoring rule.

The recipe names the environment by `url`, the base URL of a running server (a container, a Space,
`uvicorn server.app:app`), or by `factory`, a Python callable called once per episode that returns
an OpenEnv client (an `EnvClient`, or its `.sync()` wrapper) or an OpenEnv `Environment` to play in
this process. The reply becomes the action in one of two ways (`action`): "text" puts the reply's
text into one field of the action (`text_field`, "message" by default, as OpenEnv's echo template
and TextArena's actions have it); "tool_call" sends each tool call of the reply as MCP's
`CallToolAction`, for the MCP environments, whose tools (from `ListToolsAction`) the model is shown.

A server that does not answer when the run starts is a located `RecipeError` naming the URL; once
the run is going, a session that cannot be opened, an error the server sends back and a request
that times out are the episode's status ("error", "timeout"), never a reward. The package is
imported only when the environment is checked or built, so that `rlkit plugins` works without it.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import attrs

from rlkit_core import (
    Environment,
    RecipeError,
    Reply,
    Reset,
    StandardEpisode,
    Step,
    building_at,
    greater_than,
    hookimpl,
    load_module,
    one_of,
    setting,
)

INSTALL = "pip install 'rlkit[openenv]'"
SCHEMES = ("http://", "https://", "ws://", "wss://")
# the fields of an OpenEnv observation that are not what it says: the wire format's own
NOT_SAID = ("metadata", "reward", "done")


@attrs.frozen
class OpenEnvConfig(StandardEpisode):
    url: str = setting("", help="base URL of a running OpenEnv environment server, e.g. 'http://localhost:8000' (each episode opens a "
                                "WebSocket session on it)")
    factory: str = setting("", help="instead of url: a Python callable 'package.module:function' or 'path/to/file.py:function', called once "
                                    "per episode, returning an OpenEnv client (EnvClient or its .sync()) or an OpenEnv Environment to "
                                    "play in this process")
    action: str = setting("text", help="how a reply becomes the environment's action: 'text' (the reply's text in `text_field`) or "
                                       "'tool_call' (each tool call as MCP's CallToolAction, for MCP environments)",
                          validator=one_of("text", "tool_call"))
    text_field: str = setting("message", help="the action's field the reply's text goes into (action = 'text')")
    action_fields: dict[str, Any] = setting(factory=dict, help="fixed fields every action gets besides the text (action = 'text')")
    action_class: str = setting("", help="the environment's Action class, 'package.module:Class': the action is built and validated "
                                         "here (needed for an in-process Environment and for a typed client; with url the server "
                                         "validates a plain JSON action)")
    observation_field: str = setting("", help="the observation's field whose text the model reads ('a.b' reaches into a nested one; "
                                              "a value that is not a string is shown as JSON); '': the whole observation but its "
                                              "metadata, as JSON")
    prompt_role: str = setting("none", help="where the record's prompt goes: 'none' (the reset observation alone opens the episode), "
                                            "'system' (a system message before it) or 'user' (the same user message, before it)",
                               validator=one_of("none", "system", "user"))
    reset_kwargs: dict[str, Any] = setting(factory=dict, help="keyword arguments every reset gets (the server passes on those its "
                                                              "environment's reset takes)")
    reset_columns: list[str] = setting(factory=list, help="record columns passed to reset as keyword arguments, e.g. a task's split "
                                                          "and index")
    send_seed: bool = setting(True, help="pass the episode's seed to reset as `seed`")
    connect_timeout_s: float = setting(10.0, help="seconds to open an episode's session (and to probe the server at the start)",
                                       validator=greater_than(0))


def import_openenv(where: str):
    """openenv.core, or a located error saying how to install it."""
    try:
        import openenv.core  # noqa: F401  (the package, with its client and server side)
        from openenv.core import env_server
    except ImportError:
        raise RecipeError([f"{where}.type: 'openenv' needs the openenv package: {INSTALL}"]) from None
    return env_server


def load_object(spec: str, where: str) -> Any:
    """What 'package.module:name' or 'path/to/file.py:name' names, or a located error."""
    module_name, _, name = spec.rpartition(":")
    if not module_name or not name:
        raise RecipeError([f"{where}: {spec!r} is not 'package.module:name' or 'path/to/file.py:name'"])
    try:
        module = load_module(module_name, "rlkit_openenv")
    except Exception as exc:
        raise RecipeError([f"{where}: {module_name!r} could not be loaded ({type(exc).__name__}: {exc})"]) from None
    if not hasattr(module, name):
        raise RecipeError([f"{where}: {module_name!r} has no {name!r}"])
    return getattr(module, name)


def http_url(url: str) -> str:
    """The server's base URL over HTTP (OpenEnv clients take http:// and ws:// alike)."""
    url = url.rstrip("/")
    return "http" + url[2:] if url.startswith(("ws://", "wss://")) else url


def get_json(url: str, timeout: float) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as answer:  # noqa: S310 (the recipe's own server)
        return json.loads(answer.read().decode("utf-8"))


def server_problem(config: OpenEnvConfig, where: str) -> str | None:
    """Why the server at `config.url` cannot be reached (GET /health), or None."""
    base = http_url(config.url)
    try:
        get_json(f"{base}/health", config.connect_timeout_s)
    except urllib.error.HTTPError as exc:
        return (f"{where}.url: the server at {config.url} answered GET /health with HTTP {exc.code}: is it an OpenEnv environment "
                "server (create_app)?")
    except (OSError, ValueError) as exc:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        return (f"{where}.url: no OpenEnv server answers at {config.url} (GET /health: {type(reason).__name__}: {reason}); start the "
                "environment's server (`uvicorn server.app:app --port 8000` in its folder, or `docker run -p 8000:8000 IMAGE`) or fix the URL")
    return None


def dig(observation: dict[str, Any], path: str, where: str) -> Any:
    """The value at 'a.b' in an observation, or a located error naming the fields there are."""
    value: Any = observation
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            fields = ", ".join(sorted(value)) if isinstance(value, dict) else f"a {type(value).__name__}, not an object"
            raise RecipeError([f"{where}.observation_field: the environment's observation has no {path!r} (at {part!r} it has: "
                               f"{fields})"])
        value = value[part]
    return value


def as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)


def numbers(table: Any) -> dict[str, float]:
    """The finite numbers (bools as 0/1) of an observation's metadata: what `info` takes."""
    if not isinstance(table, dict):
        return {}
    return {str(key): float(value) for key, value in table.items()
            if isinstance(value, (bool, int, float)) and math.isfinite(float(value))}


@attrs.frozen
class Outcome:
    """One answer of the environment, from a client or in process alike."""

    observation: dict[str, Any]
    reward: float | None
    done: bool
    metadata: dict[str, Any]


def outcome_of(result: Any) -> Outcome:
    """An `Outcome` from a client's StepResult (its observation a dict or a typed Observation)."""
    observation = result.observation
    if hasattr(observation, "model_dump"):
        observation = observation.model_dump(exclude={"reward", "done"})
    observation = dict(observation or {})
    metadata = result.metadata if isinstance(result.metadata, dict) else observation.get("metadata")
    reward = result.reward
    return Outcome(observation, None if reward is None else float(reward), bool(result.done), metadata if isinstance(metadata, dict) else {})


class InProcess:
    """An OpenEnv `Environment` played in this process, behind the calls a sync client makes."""

    def __init__(self, environment: Any):
        self.environment = environment

    def reset(self, **kwargs: Any) -> Outcome:
        signature = inspect.signature(self.environment.reset)
        takes_all = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
        kwargs = {k: v for k, v in kwargs.items() if takes_all or k in signature.parameters}  # as OpenEnv's server passes them
        return self._outcome(self.environment.reset(**kwargs))

    def step(self, action: Any) -> Outcome:
        return self._outcome(self.environment.step(action))

    def close(self) -> None:
        self.environment.close()

    @staticmethod
    def _outcome(observation: Any) -> Outcome:
        from openenv.core.env_server.serialization import serialize_observation

        wire = serialize_observation(observation)
        reward = wire.get("reward")
        return Outcome(dict(wire["observation"]), None if reward is None else float(reward), bool(wire.get("done")),
                       dict(wire.get("metadata") or {}))


@attrs.define
class Episode:
    """One episode's session (a sync client, or an in-process environment), closed by `close`."""

    session: Any
    # a step is still waiting for its answer (rlkit closes an episode whose step ran past its timeout), or it failed (a
    # timeout: the client dropped its socket): `close` then waits for nothing
    unanswered: bool = False
    tool_calls: int = 0
    tool_errors: int = 0


class OpenEnv(Environment):
    """An OpenEnv environment, one session per episode (see the module)."""

    requires = {"openenv": "rlkit[openenv]"}

    def __init__(self, config: OpenEnvConfig, context=None):
        self.config = config
        self.where = where = building_at(context, "environment")
        problems = self.settings_problems(config, where)
        if problems:
            raise RecipeError(problems)
        self.server = import_openenv(where)
        self.factory = load_object(config.factory, f"{where}.factory") if config.factory else None
        if self.factory is not None and not callable(self.factory):
            raise RecipeError([f"{where}.factory: {config.factory!r} is not callable"])
        self.action_class = load_object(config.action_class, f"{where}.action_class") if config.action_class else None
        if self.action_class is not None and not (isinstance(self.action_class, type) and issubclass(self.action_class, self.server.Action)):
            raise RecipeError([f"{where}.action_class: {config.action_class!r} is not an OpenEnv Action class (openenv.core.Action)"])
        if self.action_class is not None and config.action == "text":
            self.check_fields(set(self.action_class.model_fields), {n for n, f in self.action_class.model_fields.items() if f.is_required()},
                              f"{config.action_class}")
        if config.url:
            if problem := server_problem(config, where):
                raise RecipeError([problem])
            if config.action == "text":
                self.check_schema()
        self._tools: list[dict[str, Any]] = self.list_tools() if config.action == "tool_call" else []

    @staticmethod
    def settings_problems(config: OpenEnvConfig, where: str) -> list[str]:
        problems = []
        if bool(config.url) == bool(config.factory):
            problems.append(f"{where}: name the OpenEnv environment by exactly one of 'url' (a running server) and 'factory' (a Python "
                            "callable that returns a client or an Environment)")
        if config.url and not config.url.startswith(SCHEMES):
            problems.append(f"{where}.url: {config.url!r} is not an http://, https://, ws:// or wss:// URL")
        if config.action == "text" and not config.text_field:
            problems.append(f"{where}.text_field: name the action's field the reply's text goes into")
        if config.action == "text" and config.text_field in config.action_fields:
            problems.append(f"{where}.action_fields: sets {config.text_field!r}, the field the reply's text goes into (text_field)")
        return problems

    @staticmethod
    def check(config: OpenEnvConfig, recipe, where: str) -> tuple[list[str], list[str]]:
        """(problems, notes): the settings agree and the package is there; no request is made."""
        problems = OpenEnv.settings_problems(config, where)
        try:
            import_openenv(where)
        except RecipeError as exc:
            problems += exc.problems
        return problems, []

    @staticmethod
    def imports(config: OpenEnvConfig, where: str) -> list[str]:
        """The code `rlkit run` imports for the factory and the action class (listed by `rlkit check`)."""
        found = []
        for setting_name, spec, what in (("factory", config.factory, "its factory"), ("action_class", config.action_class, "its action class")):
            target, _, name = spec.rpartition(":")
            if target:
                module = f"the file {str(Path(target).resolve())!r}" if target.endswith(".py") else f"the module {target!r}"
                found.append(f"{module} for {what} {name!r} ({where}.{setting_name})")
        return found

    @staticmethod
    def probe(config: OpenEnvConfig, where: str) -> list[str]:
        """`rlkit check` without --offline: the server answers GET /health."""
        if not config.url or not config.url.startswith(SCHEMES):
            return []
        problem = server_problem(config, where)
        return [problem] if problem else []

    def check_fields(self, fields: set[str], required: set[str], whose: str) -> None:
        """The action has `text_field`, and every field it requires is given."""
        config = self.config
        if config.text_field not in fields:
            raise RecipeError([f"{self.where}.text_field: {whose}'s action has no field {config.text_field!r}; its fields: "
                               f"{', '.join(sorted(fields - {'metadata'})) or 'none'}"])
        unknown = sorted(set(config.action_fields) - fields)
        if unknown:
            raise RecipeError([f"{self.where}.action_fields: {whose}'s action has no field {', '.join(map(repr, unknown))}; its fields: "
                               f"{', '.join(sorted(fields - {'metadata'}))}"])
        missing = sorted(required - {config.text_field} - set(config.action_fields))
        if missing:
            raise RecipeError([f"{self.where}.action_fields: {whose}'s action requires {', '.join(map(repr, missing))} besides "
                               f"{config.text_field!r}: set them in action_fields, or choose another text_field"])

    def check_schema(self) -> None:
        """The server's action schema (GET /schema) against text_field and action_fields; a server
        without the endpoint is left to its first step."""
        try:
            schema = get_json(f"{http_url(self.config.url)}/schema", self.config.connect_timeout_s).get("action")
        except (OSError, ValueError, AttributeError):
            return
        if not isinstance(schema, dict) or not isinstance(schema.get("properties"), dict):
            return
        self.check_fields(set(schema["properties"]), set(schema.get("required") or []), f"the server at {self.config.url}")

    # one session

    def open(self) -> Any:
        """A connected session: a sync client, or an in-process environment."""
        if self.factory is None:
            from openenv.core import GenericEnvClient

            timeout = self.config.step_timeout_s or 600.0
            client: Any = GenericEnvClient(base_url=self.config.url, connect_timeout_s=self.config.connect_timeout_s,
                                           message_timeout_s=timeout)
            session = client.sync()
        else:
            made = self.factory()
            from openenv.core import EnvClient, SyncEnvClient

            if isinstance(made, self.server.Environment):
                if self.action_class is None and self.config.action == "text":
                    raise RecipeError([f"{self.where}.action_class: {self.config.factory!r} returns an in-process OpenEnv Environment, "
                                       "which takes its own Action objects: name its Action class ('package.module:Class')"])
                return InProcess(made)
            if isinstance(made, EnvClient):
                session = made.sync()
            elif isinstance(made, SyncEnvClient):
                session = made
            else:
                raise RecipeError([f"{self.where}.factory: {self.config.factory!r} returned {type(made).__name__}, not an OpenEnv client "
                                   "(EnvClient, or its .sync()) or an OpenEnv Environment"])
        try:
            self.guarded("the OpenEnv session", session.connect)
        except BaseException:
            self._quietly_close(session)
            raise
        return session

    @staticmethod
    def _quietly_close(session: Any, wait: bool = True) -> None:
        """Close a session, its failure ignored; `wait` False: in a thread of its own, for a session
        whose call timed out (the client waits for the dropped socket's close handshake with a
        server that may still be busy with the call, up to websockets' close timeout)."""
        if not wait:
            threading.Thread(target=OpenEnv._quietly_close, args=(session,), daemon=True, name="rlkit-openenv-close").start()
            return
        try:
            session.close()
        except Exception:
            pass

    def call(self, session: Any, what: str, *args: Any, **kwargs: Any) -> Outcome:
        """`session.reset(**kwargs)` or `session.step(action)` as an Outcome (see `guarded`)."""
        result = self.guarded(f"the OpenEnv {what}", getattr(session, what), *args, **kwargs)
        return result if isinstance(result, Outcome) else outcome_of(result)

    def guarded(self, what: str, function: Any, *args: Any, **kwargs: Any) -> Any:
        """`function(*args, **kwargs)`: a timeout raised as TimeoutError (the episode's "timeout"),
        any other failure as a RuntimeError that names the server (the episode's "error")."""
        try:
            return function(*args, **kwargs)
        except RecipeError:
            raise
        except (TimeoutError, asyncio.TimeoutError):
            raise TimeoutError(f"{what} got no answer within {self.config.step_timeout_s or 600.0:g} s") from None
        except Exception as exc:
            hint = ("; the server runs fewer sessions at once than the episodes rlkit plays at once (every episode of a batch holds "
                    "one): raise max_concurrent_envs in its create_app" if "CAPACITY_REACHED" in str(exc) else "")
            place = f" at {self.config.url}" if self.config.url else ""
            verb = "could not be opened" if what.endswith("session") else "failed"
            raise RuntimeError(f"{what}{place} {verb}: {type(exc).__name__}: {exc}{hint}") from exc

    # the episode

    def tools(self) -> list[dict[str, Any]]:
        return [dict(schema) for schema in self._tools]

    def list_tools(self) -> list[dict[str, Any]]:
        """The MCP environment's tools (ListToolsAction on a session of its own) as the schemas the
        chat template shows; an environment that cannot list them is a located error."""
        from openenv.core.env_server.mcp_types import ListToolsAction

        session = None
        try:
            session = self.open()
            answer = self.call(session, "step", self.action(session, ListToolsAction()))
        except RecipeError:
            raise
        except Exception as exc:
            raise RecipeError([f"{self.where}.action: 'tool_call' needs an MCP environment, one that answers ListToolsAction, and "
                               f"listing its tools failed: {exc}"]) from None
        finally:
            if session is not None:
                self._quietly_close(session)
        tools = answer.observation.get("tools")
        if not isinstance(tools, list) or not tools:
            error = answer.metadata.get("error") or answer.observation.get("metadata", {}).get("error")
            raise RecipeError([f"{self.where}.action: 'tool_call' needs an MCP environment's tools, and its ListToolsAction "
                               f"answered {as_text(tools) if tools is not None else 'no tools field'}" + (f" ({error})" if error else "")])
        return [{"type": "function", "function": {"name": tool["name"], "description": tool.get("description") or "",
                                                  "parameters": tool.get("input_schema") or {"type": "object", "properties": {}}}}
                for tool in tools]

    def action(self, session: Any, action: Any) -> Any:
        """What goes to `session.step`: an Action object for an in-process environment or a typed
        client, else the plain JSON the server validates."""
        if isinstance(action, dict) and self.action_class is not None:
            return self.action_class.model_validate(action)
        return action

    def said(self, outcome: Outcome) -> str:
        """The text of an observation the model reads."""
        field = self.config.observation_field
        if field:
            return as_text(dig(outcome.observation, field, self.where))
        return as_text({key: value for key, value in outcome.observation.items() if key not in NOT_SAID})

    def reset(self, record: dict[str, Any], seed: int) -> Reset:
        config = self.config
        kwargs = dict(config.reset_kwargs)
        if config.send_seed:
            kwargs["seed"] = int(seed)
        for column in config.reset_columns:
            if column not in record:
                raise RecipeError([f"{self.where}.reset_columns: a record has no column {column!r} (its columns: "
                                   f"{', '.join(sorted(record))})"])
            kwargs[column] = record[column]
        session = self.open()
        try:
            opening = self.call(session, "reset", **kwargs)
            text = self.said(opening)
        except BaseException as exc:
            self._quietly_close(session, wait=not isinstance(exc, TimeoutError))
            raise
        prompt = str(record.get("prompt") or "")
        if config.prompt_role == "system" and prompt:
            messages = [{"role": "system", "content": prompt}, {"role": "user", "content": text}]
        elif config.prompt_role == "user" and prompt:
            messages = [{"role": "user", "content": f"{prompt}\n\n{text}"}]
        else:
            messages = [{"role": "user", "content": text}]
        episode = Episode(session)
        return Reset(messages, episode, info=self.info(episode, opening))

    def info(self, episode: Episode, outcome: Outcome) -> dict[str, float]:
        counts = {"tool_calls": float(episode.tool_calls), "tool_errors": float(episode.tool_errors)} if self.config.action == "tool_call" else {}
        return {**numbers(outcome.metadata), **counts}

    def step(self, state: Episode, reply: Reply) -> Step:
        state.unanswered = True
        answer = self.answer(state, reply)
        state.unanswered = False
        return answer

    def answer(self, state: Episode, reply: Reply) -> Step:
        if self.config.action == "tool_call":
            return self.call_tools(state, reply)
        action = {**self.config.action_fields, self.config.text_field: reply.text}
        outcome = self.call(state.session, "step", self.action(state.session, action))
        return Step(messages=[] if outcome.done else [{"role": "user", "content": self.said(outcome)}], reward=outcome.reward,
                    done=outcome.done, info=self.info(state, outcome))

    def call_tools(self, state: Episode, reply: Reply) -> Step:
        """Each tool call of the reply as a CallToolAction, in order, until one ends the episode:
        one tool message per call, the rewards summed. A reply without a call ends the episode (the
        model answered instead of acting); one whose calls could not be read is told so."""
        from openenv.core.env_server.mcp_types import CallToolAction

        if reply.parse_error:
            return Step(messages=[{"role": "tool", "name": "", "content": f"Error: your tool call could not be read: {reply.parse_error}. "
                                                                          "No tool was called; write the call again."}])
        if not reply.tool_calls:
            return Step(done=True)
        messages, rewards, done, last = [], [], False, None
        for call in reply.tool_calls:
            outcome = self.call(state.session, "step", CallToolAction(tool_name=call.name, arguments=dict(call.arguments)))
            state.tool_calls += 1
            error = outcome.observation.get("error")
            if error:
                state.tool_errors += 1
            messages.append({"role": "tool", "name": call.name, "content": tool_text(outcome.observation)})
            if outcome.reward is not None:
                rewards.append(outcome.reward)
            done, last = outcome.done, outcome
            if done:
                break
        assert last is not None
        return Step(messages=[] if done else messages, reward=sum(rewards) if rewards else None, done=done, info=self.info(state, last))

    def close(self, state: Episode) -> None:
        if state.unanswered:
            self._quietly_close(state.session, wait=False)
        else:
            state.session.close()


def tool_text(observation: dict[str, Any]) -> str:
    """A CallToolObservation as the tool message's text: the error's message, else the result's
    text content (MCP's CallToolResult), else the result as JSON."""
    error = observation.get("error")
    if error:
        return f"Error: {error.get('message', error) if isinstance(error, dict) else error}"
    result = observation.get("result")
    if isinstance(result, dict) and isinstance(result.get("content"), list):
        texts = [item["text"] for item in result["content"] if isinstance(item, dict) and isinstance(item.get("text"), str)]
        if texts:
            return "\n".join(texts)
        if "data" in result:
            return as_text(result["data"])
    return as_text(result)


@hookimpl
def register_environments(register):
    register("openenv", OpenEnv, OpenEnvConfig)
