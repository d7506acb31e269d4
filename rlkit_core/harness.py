"""An environment whose episodes an outside agent plays (a harness): it runs the agent once per
episode against the endpoint (`rlkit_core.endpoint`), and turns what the agent asks and returns
into what the runner reads (`Reset`, `Step`).

A subclass says how to run its agent for one episode: `play(record, client)`, called in a thread
of its own with an `openai.OpenAI` client bound to the episode's session, returning the reward or a
dict with `"reward"` and other figures; or `command(record)`, a program to run instead, given
`OPENAI_BASE_URL`, `OPENAI_API_KEY` and `RLKIT_RECORD` (the record as JSON) in its environment and
the record on stdin, whose last line of output is that result.

The agent's first request opens the episode; each later one answers the model's turn; its end
pays the reward. An agent that raises, exits non-zero or ends with no reward ends its episode with
status "error" (`HarnessFailed`); one that neither sends a request nor ends within `step_timeout_s`
(or what is left of `episode_timeout_s`) ends it as a "timeout" (`TimeoutError`, naming the limit).
Neither is scored, and both are counted. Every ending closes the session (a late request is
refused) and kills the command's process; when the runner ended the episode first (a turn cut
off), what the agent returns then still gives the episode its figures (`close`).

A command's start (an interpreter, its imports) has a budget of its own, `start_timeout_s` from its
launch to its first request (`HarnessSettings`), and at most `max_starting` commands start at once:
started all at once, a batch of them shares the CPU cores and each start takes as long as all of
them. A callable's thread that outlives its episode (Python cannot stop a thread) is counted as a
hung call of the environment by the runtime's call pool, through `hold_thread`.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import attrs

from rlkit_core.config import at_least, setting
from rlkit_core.context import BuildContext
from rlkit_core.endpoint import HarnessEnded, Limits, Session, Turn, agent_endpoint
from rlkit_core.episode_limits import StandardEpisode
from rlkit_core.interfaces import Environment
from rlkit_core.messages import Reply, Reset, Step


class HarnessFailed(RuntimeError):
    """The agent raised, exited non-zero or ended without a reward: the episode's status is "error"."""


@attrs.frozen
class HarnessSettings(StandardEpisode):
    """An episode's bounds, and how a command's start is bounded (see the module)."""

    start_timeout_s: float = setting(30.0, help="seconds a command's agent may take from its launch to its first request (its "
                                                "interpreter and imports start; step_timeout_s counts from then; 0: no limit)",
                                     validator=at_least(0), kw_only=True)
    max_starting: int = setting(0, help="commands starting at once, each from its launch to its first request, the others waiting "
                                        "their turn (0: 8 for each CPU core this process may use, the cores shared among a torchrun's "
                                        "processes on the machine)", validator=at_least(0), kw_only=True)


STARTS_PER_CORE = 8  # a start is not all CPU work: 16 at once on 2 cores started a batch 3x sooner than 2 (docs/results.md)


def cores_per_process() -> int:
    """The CPU cores this process may use, over the processes torchrun started on this machine."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


@attrs.define(eq=False)
class HarnessEpisode:
    session: Session
    started: float
    process: subprocess.Popen | None = None
    thread: threading.Thread | None = None  # a callable agent's
    playing: bool = False  # that thread has not returned
    returned: Callable[[], None] | None = None  # tells the call pool it has, once it outlived the episode (`hold_thread`)


OUTLIVING_S = 1.0  # how long a closed episode's callable agent may take to return (its pending request refused) before it counts as hung
STDLIB = sysconfig.get_paths()["stdlib"] + os.sep  # Python's own modules: the import machinery's frames are no agent's


def failure_text(exc: BaseException) -> str:
    """`Type: message`, then the frames of the agent's own code (not the libraries' it called, nor
    Python's own)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "site-packages" not in f.filename and f.filename != __file__
              and not f.filename.startswith(("<frozen ", STDLIB))]
    return "\n".join([f"{type(exc).__name__}: {exc}", *(line.rstrip("\n") for line in traceback.format_list(frames[-3:]))])


def outcome_of(result: Any) -> HarnessEnded:
    """What an agent returned (or printed, read as JSON): a reward, or a dict of 'reward' and figures.
    The figures go on as returned, for the runner to check as it checks every environment's `info`:
    one that is not a finite number (text, None, a nested value, NaN) makes the episode an error."""
    figures = result if isinstance(result, dict) else {"reward": result}
    reward = figures.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        return HarnessEnded(failure=f"ended with {result!r}: a finite reward, or a dict with 'reward', is expected")
    return HarnessEnded(reward=float(reward), info={k: v for k, v in figures.items() if k != "reward"})


def printed_outcome(stdout: str) -> HarnessEnded:
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        return HarnessEnded(failure="printed no reward (its last line of output should be the reward)")
    try:
        return outcome_of(json.loads(lines[-1]))
    except json.JSONDecodeError:
        return HarnessEnded(failure=f"printed {lines[-1][:200]!r} last, which is not a reward (a number or a JSON object)")


class HarnessEnvironment(Environment):
    """An agent per episode, through the endpoint (see the module). `settings` are the episode's
    bounds (a `HarnessSettings` bounds a command's start too, else its defaults do); `context` gives
    the run's sampling (what a request may ask for) and the tokenizer (the pieces of a turn's
    log-probs); `model` is the name the endpoint answers as."""

    def __init__(self, settings: StandardEpisode, context: BuildContext | None = None, model: str = "policy"):
        self.settings = settings
        generator = context.recipe["generator"].config if context is not None else None
        self.limits = Limits(max_turns=settings.max_turns, max_new_tokens=getattr(generator, "max_new_tokens", 1),
                             temperature=getattr(generator, "temperature", 1.0), model=model,
                             top_p=getattr(generator, "top_p", 1.0), top_k=getattr(generator, "top_k", 0))
        self.tokenizer = context.tokenizer if context is not None else None
        self.lock, self.shared = threading.Lock(), None
        start = settings if isinstance(settings, HarnessSettings) else HarnessSettings()
        self.start_timeout_s, self.max_starting = start.start_timeout_s, start.max_starting or STARTS_PER_CORE * cores_per_process()
        self.starting = threading.BoundedSemaphore(self.max_starting)  # held by a command from its launch to its first request
        # counts a callable agent's thread that outlived its episode and returns the function to call when it returns: the
        # runtime gives its call pool's (`CallPool.held`), so that such threads are bounded by call_threads; not counted without
        self.hold_thread: Callable[[], Callable[[], None]] | None = None

    def play(self, record: dict[str, Any], client: Any) -> Any:
        """Run the agent for the episode of `record` with `client`; return its reward (or a dict
        with 'reward' and figures). A subclass implements this or `command`."""
        raise NotImplementedError(f"{type(self).__name__} implements neither play() nor command()")

    def command(self, record: dict[str, Any]) -> list[str] | None:
        """A program that plays the episode of `record` instead of `play` (see the module); None: `play`."""
        return None

    def reset(self, record: dict[str, Any], seed: int) -> Reset:
        command = self.command(record)
        episode = HarnessEpisode(agent_endpoint().open(self.limits), started=time.monotonic())
        try:
            if command is None:
                self._launch(episode, record, None)
                event = self._next(episode, *self._wait(episode))
            else:
                with self.starting:  # a place among max_starting, from the launch to the first request
                    episode.started = time.monotonic()
                    self._launch(episode, record, command)
                    event = self._next(episode, *self._start_wait())
            if isinstance(event, HarnessEnded):
                raise HarnessFailed(f"the harness ended before its first request: {event.failure or 'it sent none'}")
        except BaseException:
            self.close(episode)
            raise
        return Reset(messages=event.messages, state=episode, tools=event.tools, info=self._counts(episode))

    def step(self, state: HarnessEpisode, reply: Reply) -> Step:
        session = state.session
        tokenizer = self.tokenizer
        pieces = None if tokenizer is None else lambda: [tokenizer.decode([i]) for i in reply.ids]
        seen = session.respond(reply, reply.message, pieces)
        event = self._next(state, *self._wait(state))
        if isinstance(event, HarnessEnded):
            if event.failure:
                raise HarnessFailed(f"the harness {event.failure}")
            if not seen and not session.turns:
                raise HarnessFailed("the harness returned before the model's first turn was answered: it saw no "
                                    "turn to reward")
            # a turn the harness returned before it was answered is cut from the episode, untrained
            return Step(reward=event.reward, done=True, info={**self._counts(state), **event.info}, unseen=not seen)
        return self._turn(state, event)

    def close(self, state: HarnessEpisode) -> dict[str, float] | None:
        """End the session and the command's process. When the runner ended the episode while its
        harness waited on a request (a turn cut off, the tokens or the time ran out), that request is
        answered `episode_ended`, and the figures of what the harness returns then, within the wait a
        step has, are the episode's (never its reward: a cut-off turn's is its status's); a harness
        that fails or does not return in time reports none."""
        session = state.session
        waiting = session.in_flight is not None
        session.end("closed")
        late = session.returned(self._wait(state)[0]) if waiting else None
        if state.thread is not None and (late is not None or not waiting):  # within half the close's limit (step_timeout_s)
            step = self.settings.step_timeout_s
            state.thread.join(min(OUTLIVING_S, step / 2) if step else OUTLIVING_S)
        with self.lock:
            if state.playing and state.returned is None and self.hold_thread is not None:  # its agent goes on: a hung call
                state.returned = self.hold_thread()
        process = state.process
        if process is not None and process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait(timeout=5)
        return late.info if late is not None and late.failure is None else None

    def _turn(self, state: HarnessEpisode, turn: Turn) -> Step:
        info = self._counts(state)
        if turn.new is None:  # the harness changed what came before: a new sample, counted
            return Step(history=turn.messages, info=info)
        return Step(messages=turn.new, info=info)

    def _counts(self, state: HarnessEpisode) -> dict[str, float]:
        session = state.session
        return {"agent_requests": float(session.requests), "agent_refused": float(session.refused),
                "agent_rewrites": float(session.rewrites), "agent_tool_calls": float(len(session.calls)),
                "agent_tool_results": float(len(session.answered))}

    def _wait(self, state: HarnessEpisode) -> tuple[float | None, str]:
        """How long a step (or a callable's first request) waits on the agent, and the limit that says
        so: within step_timeout_s (a little less, so that it gives up before the call pool does) and
        what is left of episode_timeout_s."""
        settings, limits = self.settings, []
        if settings.step_timeout_s:
            limits.append((settings.step_timeout_s * 0.95, f"environment.step_timeout_s = {settings.step_timeout_s:g} s"))
        if settings.episode_timeout_s:
            limits.append((max(0.0, settings.episode_timeout_s - (time.monotonic() - state.started)),
                           f"what was left of environment.episode_timeout_s = {settings.episode_timeout_s:g} s"))
        return min(limits) if limits else (None, "")

    def _start_wait(self) -> tuple[float | None, str]:
        """How long a command's start waits for its first request, and the limit that says so."""
        return self.start_timeout_s or None, (f"environment.start_timeout_s = {self.start_timeout_s:g} s from the command's launch, "
                                              f"with up to environment.max_starting = {self.max_starting} starting at once")

    def _next(self, state: HarnessEpisode, seconds: float | None, limit: str) -> Turn | HarnessEnded:
        """The agent's next request or its end; a TimeoutError names the `limit` it ran past."""
        try:
            return state.session.next_event(seconds)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc} ({limit})") from None

    def start_times(self, records: list[dict[str, Any]]) -> list[float | None]:
        """A command per record launched at once, as a run launches `max_starting` of them: the
        seconds from its launch to its first request, None for one that sent none within
        start_timeout_s; one that ended before its first request (a failure of its own, which its
        episodes show) is left out. Each is ended then, its process killed."""
        episodes = [HarnessEpisode(agent_endpoint().open(self.limits), started=time.monotonic()) for _ in records]
        try:
            for episode, record in zip(episodes, records):
                episode.started = time.monotonic()
                self._launch(episode, record, self.command(record))
            deadline = time.monotonic() + self.start_timeout_s if self.start_timeout_s else None
            times: list[float | None] = []
            for episode in episodes:
                try:
                    event = episode.session.next_event(None if deadline is None else max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    event = None
                if not isinstance(event, HarnessEnded):
                    times.append(None if event is None else time.monotonic() - episode.started)
            return times
        finally:
            for episode in episodes:
                self.close(episode)

    def _launch(self, episode: HarnessEpisode, record: dict[str, Any], command: list[str] | None) -> None:
        if command is None:
            episode.playing = True
            episode.thread = threading.Thread(target=self._call, args=(episode, record), daemon=True, name="rlkit-harness")
            episode.thread.start()
            return
        environment = {**os.environ, "OPENAI_BASE_URL": episode.session.base_url, "OPENAI_API_KEY": episode.session.key,
                       "RLKIT_RECORD": json.dumps(record, default=str)}
        process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env=environment, start_new_session=True)
        episode.process = process
        threading.Thread(target=self._wait_for, args=(episode.session, process, record), daemon=True, name="rlkit-harness").start()

    def _call(self, episode: HarnessEpisode, record: dict[str, Any]) -> None:
        session = episode.session
        ended = None  # stays None for a SystemExit, which ends the thread: the episode times out
        try:
            client = self._client().with_options(base_url=session.base_url, api_key=session.key)
            ended = outcome_of(self.play(dict(record), client))
        except Exception as exc:
            ended = HarnessEnded(failure=f"raised {failure_text(exc)}")
        finally:
            with self.lock:  # not playing before the episode reads its end, so that its close does not count it as hung
                episode.playing, returned = False, episode.returned
            if ended is not None:
                session.harness_ended(ended)
            if returned is not None:  # it outlived its episode, counted as a hung call until now
                returned()

    def _client(self):
        """One `openai.OpenAI` for every episode, each given a copy bound to its session: the copies
        share its connections, and a client of its own per episode would cost more than the request."""
        with self.lock:
            if self.shared is None:
                from openai import OpenAI

                self.shared = OpenAI(base_url=agent_endpoint().url, api_key="rlkit", max_retries=0,
                                     timeout=self.settings.episode_timeout_s or None)
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
