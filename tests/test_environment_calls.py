"""The threads of an environment's calls (`rlkit_core.runtime.environment_calls`): every result
or fault, a timeout that counts from when a call starts, at most `size` threads however many calls
hang, and the run ended, located, when every thread is held."""

from __future__ import annotations

import threading
import time

import pytest

from rlkit_core.errors import RecipeError
from rlkit_core.runtime.environment_calls import CallPool, CallsHung, pool_for


def test_each_call_gives_its_result_or_its_fault():
    def slow():
        time.sleep(5)

    def boom():
        raise KeyError("x")

    started = time.monotonic()
    results = CallPool(8).run([(lambda: 3, ()), (slow, ()), (boom, ())], timeout=0.3)
    assert time.monotonic() - started < 2
    assert results[0] == ("ok", 3) and results[1] == ("timeout", None)
    assert results[2][0] == "error" and "KeyError" in results[2][1]


def test_a_call_waits_for_a_thread_and_its_timeout_counts_from_its_start():
    pool = CallPool(2)
    running = []

    def quarter_second(index):
        running.append(pool.running)
        time.sleep(0.25)
        return index

    # six calls of 0.25 s, two threads, a timeout of 0.4 s: none times out, though the last start after 0.5 s
    started = time.monotonic()
    results = pool.run([(quarter_second, (i,)) for i in range(6)], timeout=0.4)
    assert results == [("ok", i) for i in range(6)]
    assert max(running) <= 2 and 0.7 < time.monotonic() - started < 3


def test_hung_calls_hold_their_threads_and_never_pile_up():
    release = threading.Event()
    pool = CallPool(4)
    before = threading.active_count()

    def hangs_on_even(index):
        if index % 2 == 0:
            release.wait()
        return index

    try:
        first = pool.run([(hangs_on_even, (i,)) for i in range(3)], timeout=0.2)  # calls 0 and 2 hang
        assert [status for status, _ in first] == ["timeout", "ok", "timeout"] and pool.hung == 2
        second = pool.run([(hangs_on_even, (i,)) for i in (1, 3, 5)], timeout=0.2)  # two threads left: they run in turn
        assert second == [("ok", 1), ("ok", 3), ("ok", 5)]
        assert threading.active_count() - before <= 4
        with pytest.raises(CallsHung, match=r"every one of the environment's 4 call threads \(environment.call_threads\)"):
            pool.run([(hangs_on_even, (i,)) for i in (4, 6, 7)], timeout=0.2)  # 4 and 6 hang too: none left for 7
        assert threading.active_count() - before <= 4
    finally:
        release.set()
    deadline = time.monotonic() + 5
    while pool.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.hung == 0 and pool.running == 0  # released calls give their threads back


def test_a_recipe_error_is_bad_input_not_an_episodes_fault():
    def bad_record():
        raise RecipeError(["$.data: a record has no 'secret' column"])

    with pytest.raises(RecipeError, match="no 'secret' column"):
        CallPool(4).run([(lambda: 1, ()), (bad_record, ())], timeout=1)


def test_one_pool_per_environment_for_the_process():
    class Environment:
        pass

    first, second = Environment(), Environment()
    assert pool_for(first, 4) is pool_for(first, 8) and pool_for(first, 8).size == 8
    assert pool_for(second, 4) is not pool_for(first, 4)


def test_threads_are_kept_between_calls_and_end_with_their_environment():
    import gc
    import sys

    class Environment:
        pass

    environment = Environment()
    pool = pool_for(environment, 3)
    before = threading.active_count()
    idents = set()

    def where():
        time.sleep(0.01)
        idents.add(threading.get_ident())

    for _ in range(20):  # 120 calls, three at a time
        assert pool.run([(where, ()) for _ in range(6)], timeout=5) == [("ok", None)] * 6
    assert len(idents) == 3 and pool.threads == 3 and threading.active_count() - before == 3
    # a call that exits the interpreter's way is an error, and its thread serves the next calls
    status, text = pool.run([(sys.exit, (4,))], timeout=5)[0]
    assert status == "error" and "SystemExit" in text
    assert pool.run([(where, ()) for _ in range(3)], timeout=5) == [("ok", None)] * 3 and len(idents) == 3
    del environment
    gc.collect()
    deadline = time.monotonic() + 5
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() == before
