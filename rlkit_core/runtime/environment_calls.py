# pyright: standard
"""The threads that run an environment's `reset` and `step` calls, within a bound.

An environment is someone else's code, and a call may hang. Python cannot stop a thread, so a call
past its timeout ends its episode (status "timeout") and is left running in its daemon thread. Left
unbounded, such threads pile up: one per hung call, for the whole run. Here every call runs in a
thread of its environment's `CallPool`, which runs at most `size` calls at once (the environment's
`call_threads` setting); a call waits for a free thread and its timeout counts from when it starts.
The threads are kept and reused, call after call (a multi-turn batch makes hundreds of calls), and
end when their environment is collected. A hung call holds its thread until it returns (`hung`, logged as `env/hung_calls`). A
thread the environment started itself and left running after its episode ended (a callable agent's,
`rlkit_core.harness`) is `held` against the same bound and counted the same way. When every thread
is held by a hung call, no episode can go on: the run ends (`CallsHung`), located, with a checkpoint,
rather than ending every later episode as a timeout that never ran.

`run` gives a batch's calls and waits for them all (a turn with the barrier); `submit` gives one
call and `ended` tells which have ended, so that episodes without the barrier step in the same
pool, each as its turn ends, with no thread of their own waiting on it.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, cast

import attrs

from rlkit_core.errors import RecipeError, RunError
from rlkit_core.runtime.faults import failure_text


class CallsHung(RunError):
    """Every thread of an environment's pool is held by a call that hung past its timeout."""


@attrs.define(eq=False)
class Call:
    """One call given to a pool (`CallPool.submit`): its outcome once it returned or ran past its timeout."""

    function: Callable
    args: tuple
    started: float | None = None  # when a thread took it (monotonic); None while it waits for one
    outcome: tuple[str, Any] | None = None  # ("ok", result), ("error", text) or ("timeout", text or None); None while it runs
    recipe_error: RecipeError | None = None  # bad input it raised: the run stops, not only the episode
    overdue: bool = False  # past its timeout and still running: its thread is held (`CallPool.hung`)


class CallPool:
    """At most `size` calls of one environment at once, in daemon threads kept between calls (see the module)."""

    def __init__(self, size: int):
        self.size = size
        self.changed = threading.Condition()
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()  # calls for the threads to run; None ends a thread
        self.queued: deque[Call] = deque()  # calls submitted while every thread was running one
        self.threads = 0  # threads started and not ended: at least `running`, the others wait on `jobs`
        self.running = 0  # calls whose thread has not returned, this batch's and hung ones alike
        self.hung = 0  # calls past their timeout whose thread has not returned, and the environment's own threads `held`
        self.outside = 0  # of those, the environment's own threads: each takes the place of one of the pool's
        self.said: set[str] = set()  # what was said of this environment's faults already, each said once (`EpisodeRunner._say_once`)
        self.owner: Any = None  # the environment, kept alive where it cannot be weakly referenced (`pool_for`)

    def run(self, calls: list[tuple[Callable, tuple]], timeout: float, what: str = "call") -> list[tuple[str, Any]]:
        """Each `(function, args)` run in a thread of the pool: ("ok", result), ("error", text) or
        ("timeout", None) once it has run `timeout` seconds (0: no limit), ("timeout", its message) when
        it raised TimeoutError. A `RecipeError` is bad
        input, not an episode's fault: the first one is raised once every call has ended or timed
        out. `what` names the calls in the error that ends the run when every thread is held."""
        submitted = [self.submit(function, args) for function, args in calls]
        running = submitted
        while running:
            self.ended(running, timeout, what)
            running = [call for call in running if call.outcome is None]
        if errors := [call.recipe_error for call in submitted if call.recipe_error]:
            raise errors[0]
        return [cast(tuple[str, Any], call.outcome) for call in submitted]  # every one has ended

    def submit(self, function: Callable, args: tuple) -> Call:
        """Start `function(*args)` in a free thread of the pool, or once one is free; `ended` tells when it has."""
        call = Call(function, args)
        with self.changed:
            self.queued.append(call)
            self._start_queued()
        return call

    def ended(self, calls: list[Call], timeout: float, what: str = "call", wait: bool = True) -> list[Call]:
        """Those of `calls` that have ended: returned, or run `timeout` seconds (0: no limit), which
        gives them the outcome ("timeout", None) and leaves them running, counted in `hung`. With
        `wait`, waits until one has. Raises `CallsHung` (dropping the queued ones of `calls`) when
        one of them waits for a thread and every thread is held by a hung call."""
        with self.changed:
            while True:
                now = time.monotonic()
                for call in calls:
                    if timeout and call.outcome is None and call.started is not None and now - call.started >= timeout:
                        call.overdue, call.outcome = True, ("timeout", None)
                        self.hung += 1
                done = [call for call in calls if call.outcome is not None]
                if done or not wait:
                    return done
                if self.hung >= self.size and any(call.started is None for call in calls):
                    self.queued = deque(call for call in self.queued if call not in calls)
                    outlived = f" ({self.outside} of them an agent still running after its episode ended)" if self.outside else ""
                    limit = f" = {timeout:g} s" if timeout else ""  # a call without a limit of its own waits on the others' (a harness's reset)
                    raise CallsHung(f"every one of the environment's {self.size} call threads (environment.call_threads) is held by "
                                    f"a call that did not return within environment.step_timeout_s{limit} and is still "
                                    f"running{outlived}, so the next {what} cannot start; the environment hangs on some calls: find "
                                    "the call that never returns (a lock, a request without a timeout)")
                deadlines = [call.started + timeout for call in calls if timeout and call.started is not None]
                self.changed.wait(max(0.0, min(deadlines) - now) if deadlines else None)

    def held(self) -> Callable[[], None]:
        """A thread the environment started itself is still running after its episode ended: it is
        counted as a hung call and takes one of the `size` places until the function returned is called
        (when it returns)."""
        with self.changed:
            self.hung += 1
            self.outside += 1

        def returned() -> None:
            with self.changed:
                self.hung -= 1
                self.outside -= 1
                self._start_queued()
                self.changed.notify_all()

        return returned

    def _start_queued(self) -> None:
        """Give queued calls to threads while fewer than `size` run (under `changed`); a call's timeout counts from here."""
        while self.queued and self.running + self.outside < self.size:
            call = self.queued.popleft()
            call.started = time.monotonic()
            self.running += 1
            if self.threads < self.running:  # every thread is running a call: one more
                self.threads += 1
                threading.Thread(target=self._serve, daemon=True, name="rlkit-environment-call").start()
            self.jobs.put(functools.partial(self._call, call))

    def _call(self, call: Call) -> None:
        """Run one call in a pool thread and record how it ended (unless it was already counted as a timeout)."""
        try:
            outcome: tuple[str, Any] = ("ok", call.function(*call.args))
        except RecipeError as exc:
            call.recipe_error = exc
            outcome = ("error", str(exc))
        except TimeoutError as exc:  # the call gave up waiting on what it called (a socket, an agent's harness): a timeout
            outcome = ("timeout", str(exc) or "TimeoutError")
        except BaseException as exc:  # the environment's code (a sys.exit too): its failure is the episode's status, the thread lives on
            outcome = ("error", failure_text(exc))
        with self.changed:
            self.running -= 1
            if call.overdue:
                self.hung -= 1
            else:
                call.outcome = outcome
            self._start_queued()
            self.changed.notify_all()

    def _serve(self) -> None:
        """A thread of the pool: the calls it is given, one after another, until it is given None."""
        while (job := self.jobs.get()) is not None:
            job()

    def close(self) -> None:
        """End the pool's threads once each has returned from the call it runs (a hung one, when it returns)."""
        for _ in range(self.threads):
            self.jobs.put(None)
        self.threads = 0


_POOLS: dict[int, CallPool] = {}


def pool_for(environment: Any, size: int) -> CallPool:
    """The pool of `environment`'s calls, of `size` threads: one per environment for the process,
    so that calls hung in one batch still count in the next (the trainer's and a producer's alike)."""
    key = id(environment)
    pool = _POOLS.get(key)
    if pool is None:
        pool = _POOLS[key] = CallPool(size)
        try:
            weakref.finalize(environment, _forget, key)
        except TypeError:  # not weakly referenceable: the pool keeps it, so its id is never reused
            pool.owner = environment
    pool.size = size
    return pool


def _forget(key: int) -> None:
    """The environment of the pool `key` was collected: its pool and threads go too."""
    pool = _POOLS.pop(key, None)
    if pool is not None:
        pool.close()
