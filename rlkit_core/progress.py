"""A one-line progress display for a person at a terminal; silent when output is piped or --quiet."""

from __future__ import annotations

import sys
import time


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"


class Progress:
    def __init__(self, total: int, start: int = 0, quiet: bool = False, stream=None):
        self.stream = stream or sys.stderr
        self.enabled = not quiet and self.stream.isatty()
        self.total = total
        self.start = start
        self.started = time.perf_counter()

    def update(self, iteration: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        done = iteration - self.start
        per_iteration = (time.perf_counter() - self.started) / max(done, 1)
        eta = per_iteration * (self.total - iteration)
        line = (f"iter {iteration}/{self.total}  {metrics['time/iteration']:.1f} s/it  ETA {_clock(eta)}  "
                f"score {metrics['score/mean']:.4f}  KL {metrics['kl/ref']:.3f}  β {metrics['kl/beta']:.4f}")
        self.stream.write("\r\033[K" + line)
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()
