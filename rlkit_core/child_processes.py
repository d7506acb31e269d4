"""Processes a run starts (a producer's workers, vLLM servers) end with it, however it ends."""

from __future__ import annotations

import contextlib
import ctypes
import signal


def end_with_parent() -> None:
    """In a child process: SIGTERM when its parent dies, a SIGKILL included (Linux's
    PR_SET_PDEATHSIG), so that nothing a run started outlives it. Elsewhere nothing is done."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
