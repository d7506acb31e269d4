"""The `agent` environment: an agent rlkit did not write (a harness) plays each episode through
the OpenAI-compatible endpoint (`rlkit_core.endpoint`), unchanged.

The harness is either a Python callable, `harness = "package.module:function"` or
`"path/to/agent.py:function"`, called once per episode as `function(record, client)` with the prompt
record and an `openai.OpenAI` client bound to the episode's session; or a command, `command =
["python", "agent.py"]`, run once per episode with `OPENAI_BASE_URL`, `OPENAI_API_KEY` and
`RLKIT_RECORD` (the record as JSON) in its environment and the record on its stdin. The callable
returns the episode's reward, or a dict with `"reward"` and other figures (each averaged into
`env/<name>`); the command prints that as its last line (a number, or a JSON object).

The harness's first request opens the episode; each later one answers the model's turn; its end
pays the reward. A harness that raises, exits non-zero or ends with no reward ends its episode with
status "error"; one that neither sends a request nor ends within `step_timeout_s` (or what is left
of `episode_timeout_s`) ends it as a "timeout". Neither is scored, and both are counted. Every
ending closes the session (a late request is refused) and stops the command's process.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from rlkit_core import (
    Environment,
    HarnessEnded,
    Limits,
    RecipeError,
    Reset,
    Session,
    StandardEpisode,
    Step,
    Turn,
    agent_endpoint,
    building_at,
    hookimpl,
    setting,
)


@attrs.frozen
class AgentConfig(StandardEpisode):
    harness: str = setting("", help="the agent as a Python callable 'package.module:function' or 'path/to/agent.py:function' (from the "
                               "working directory), called once per episode with the record and an openai.OpenAI client; it returns "
                               "the reward, or a dict with 'reward' and other figures")
    command: list[str] = setting(factory=list, help="the agent as a command run once per episode, with OPENAI_BASE_URL, OPENAI_API_KEY "
                                                    "and RLKIT_RECORD set and the record as JSON on stdin; its last line of output is "
                                                    "the reward (a number or a JSON object with 'reward')")
    model: str = setting("policy", help="the model name the endpoint lists and answers as")


STDLIB = sysconfig.get_paths()["stdlib"] + os.sep  # Python's own modules: the import machinery's frames are no agent's


class HarnessFailed(RuntimeError):
    """The harness raised, exited non-zero or ended without a reward: the episode's status is "error"."""


@attrs.define(eq=False)
class AgentEpisode:
    session: Session
    started: float
    process: subprocess.Popen | None = None


def load_harness(spec: str, where: str) -> Callable:
    """The callable `spec` names: 'package.module:function' or 'path/to/file.py:function'."""
    module_name, _, name = spec.rpartition(":")
    if not module_name or not name:
        raise RecipeError([f"{where}.harness: {spec!r} is not 'package.module:function' or 'path/to/agent.py:function'"])
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise FileNotFoundError(f"no file {path.resolve()}")
            loader = importlib.util.spec_from_file_location(f"rlkit_harness_{path.stem}", path)
            assert loader is not None and loader.loader is not None
            module = importlib.util.module_from_spec(loader)
            sys.modules[loader.name] = module
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except Exception as exc:
        raise RecipeError([f"{where}.harness: {module_name!r} could not be loaded ({failure_text(exc)}); "
                           f"{loading_hint(module_name, name, exc)}"]) from None
    function = getattr(module, name, None)
    if not callable(function):
        raise RecipeError([f"{where}.harness: {module_name!r} has no callable {name!r}"])
    return function


def loading_hint(module_name: str, name: str, exc: Exception) -> str:
    """The fix for a harness that did not load. A module that is not found although it is in the
    working directory: the `rlkit` command (a console script) does not put the working directory on
    Python's path, as `python -m` and pytest do."""
    missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
    here = Path(*module_name.split("."))
    found = next((f for f in (here.with_suffix(".py"), here / "__init__.py") if f.is_file()), None) if not module_name.endswith(".py") else None
    if missing and found is not None and (module_name == missing or module_name.startswith(f"{missing}.")):
        return (f"it is in the working directory ({found}), which the rlkit command does not put on Python's path: run with "
                f"PYTHONPATH=. or name the file, harness = '{here.with_suffix('.py')}:{name}'")
    return "name an importable module or a file relative to the working directory"


def failure_text(exc: BaseException) -> str:
    """`Type: message`, then the frames of the agent's own code (not the libraries' it called, nor
    the import machinery's)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "site-packages" not in f.filename and f.filename != __file__
              and not f.filename.startswith(("<frozen ", STDLIB))]
    return "\n".join([f"{type(exc).__name__}: {exc}", *(line.rstrip("\n") for line in traceback.format_list(frames[-3:]))])


def outcome_of(result: Any) -> HarnessEnded:
    """What a harness returned (or printed, read as JSON): a reward, or a dict of 'reward' and figures."""
    figures = result if isinstance(result, dict) else {"reward": result}
    reward = figures.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        return HarnessEnded(failure=f"ended with {result!r}: a finite reward, or a dict with 'reward', is expected")
    info = {k: float(v) for k, v in figures.items() if k != "reward" and isinstance(v, (int, float)) and not isinstance(v, bool)}
    return HarnessEnded(reward=float(reward), info=info)


def printed_outcome(stdout: str) -> HarnessEnded:
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        return HarnessEnded(failure="printed no reward (its last line of output should be the reward)")
    try:
        return outcome_of(json.loads(lines[-1]))
    except json.JSONDecodeError:
        return HarnessEnded(failure=f"printed {lines[-1][:200]!r} last, which is not a reward (a number or a JSON object)")


class Agent(Environment):
    """A harness per episode, through the endpoint (see the module)."""

    def __init__(self, config: AgentConfig, context=None):
        self.config, where = config, building_at(context, "environment")
        if bool(config.harness) == bool(config.command):
            raise RecipeError([f"{where}: name the agent as exactly one of 'harness' (a Python callable) and 'command' (a program)"])
        self.function = load_harness(config.harness, where) if config.harness else None
        recipe = getattr(context, "recipe", None)
        generator = recipe["generator"].config if recipe is not None else None
        self.limits = Limits(max_turns=config.max_turns, max_new_tokens=getattr(generator, "max_new_tokens", 1),
                             temperature=getattr(generator, "temperature", 1.0), model=config.model)
        self.tokenizer = getattr(context, "tokenizer", None)
        self.lock, self.shared = threading.Lock(), None
        if self.function is not None:
            try:
                import openai  # noqa: F401
            except ImportError:
                raise RecipeError([f"{where}.harness: a Python harness is handed an openai.OpenAI client, and the openai package is "
                                   "not installed; pip install 'rlkit[agents]' (or use 'command')"]) from None

    def reset(self, record: dict[str, Any], seed: int) -> Reset:
        episode = AgentEpisode(agent_endpoint().open(self.limits), started=time.monotonic())
        try:
            self._launch(episode, record)
            event = episode.session.next_event(self._wait(episode))
            if isinstance(event, HarnessEnded):
                raise HarnessFailed(f"the harness ended before its first request: {event.failure or 'it sent none'}")
        except BaseException:
            self.close(episode)
            raise
        return Reset(messages=event.messages, state=episode, tools=event.tools, info=self._counts(episode))

    def step(self, state: AgentEpisode, reply) -> Step:
        session = state.session
        pieces = [self.tokenizer.decode([i]) for i in reply.ids] if self.tokenizer is not None else None
        session.respond(reply, reply.message, pieces)
        event = session.next_event(self._wait(state))
        if isinstance(event, HarnessEnded):
            if event.failure:
                raise HarnessFailed(f"the harness {event.failure}")
            return Step(reward=event.reward, done=True, info={**self._counts(state), **event.info})
        return self._turn(state, event)

    def close(self, state: AgentEpisode) -> None:
        state.session.end("closed")
        process = state.process
        if process is not None and process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait(timeout=5)

    def _turn(self, state: AgentEpisode, turn: Turn) -> Step:
        info = self._counts(state)
        if turn.new is None:  # the harness changed what came before: a new sample, counted
            return Step(history=turn.messages, info=info)
        return Step(messages=turn.new, info=info)

    def _counts(self, state: AgentEpisode) -> dict[str, float]:
        session = state.session
        return {"agent_requests": float(session.requests), "agent_refused": float(session.refused),
                "agent_rewrites": float(session.rewrites)}

    def _wait(self, state: AgentEpisode) -> float | None:
        """How long a reset or step waits on the harness: within step_timeout_s (a little less, so
        that it gives up before the call pool does) and what is left of episode_timeout_s."""
        limits = []
        if self.config.step_timeout_s:
            limits.append(self.config.step_timeout_s * 0.95)
        if self.config.episode_timeout_s:
            limits.append(max(0.0, self.config.episode_timeout_s - (time.monotonic() - state.started)))
        return min(limits) if limits else None

    def _launch(self, episode: AgentEpisode, record: dict[str, Any]) -> None:
        if self.function is not None:
            threading.Thread(target=self._call, args=(episode.session, record), daemon=True, name="rlkit-harness").start()
            return
        environment = {**os.environ, "OPENAI_BASE_URL": episode.session.base_url, "OPENAI_API_KEY": episode.session.key,
                       "RLKIT_RECORD": json.dumps(record, default=str)}
        process = subprocess.Popen(self.config.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env=environment, start_new_session=True)
        episode.process = process
        threading.Thread(target=self._wait_for, args=(episode.session, process, record), daemon=True, name="rlkit-harness").start()

    def _call(self, session: Session, record: dict[str, Any]) -> None:
        client = self._client().with_options(base_url=session.base_url, api_key=session.key)
        try:
            result = self.function(dict(record), client)  # type: ignore[misc]
        except Exception as exc:
            session.harness_ended(HarnessEnded(failure=f"raised {failure_text(exc)}"))
            return
        session.harness_ended(outcome_of(result))

    def _client(self):
        """One `openai.OpenAI` for every episode, each given a copy bound to its session: the copies
        share its connections, and a client of its own per episode would cost more than the request."""
        with self.lock:
            if self.shared is None:
                from openai import OpenAI

                self.shared = OpenAI(base_url=agent_endpoint().url, api_key="rlkit", max_retries=0,
                                     timeout=self.config.episode_timeout_s or None)
            return self.shared

    def _wait_for(self, session: Session, process: subprocess.Popen, record: dict[str, Any]) -> None:
        try:
            stdout, stderr = process.communicate(json.dumps(record, default=str))
        except (OSError, ValueError) as exc:
            session.harness_ended(HarnessEnded(failure=f"could not be given its record: {exc}"))
            return
        if process.returncode != 0:
            tail = " | ".join(stderr.strip().splitlines()[-3:])
            session.harness_ended(HarnessEnded(failure=f"exited with status {process.returncode}" + (f": {tail}" if tail else "")))
            return
        session.harness_ended(printed_outcome(stdout))


@hookimpl
def register_environments(register):
    register("agent", Agent, AgentConfig)
