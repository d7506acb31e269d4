"""A one-line progress display for a person at a terminal; silent when output is piped or --quiet."""

from __future__ import annotations

import sys
import time


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"


class Progress:
    def __init__(self, total: int, start: int = 0, quiet: bool = False, stream=None, label: str = "iter"):
        self.stream = stream or sys.stderr
        self.enabled = not quiet and self.stream.isatty()
        self.total = total
        self.start = start
        self.label = label
        self.started = time.perf_counter()

    def update(self, iteration: int, metrics: dict[str, float]) -> None:
        """A PPO iteration's line: score, KL and β."""
        self.show(iteration, f"score {metrics['score/mean']:.4f}  KL {metrics['kl/ref']:.3f}  β {metrics['kl/beta']:.4f}")

    def show(self, done: int, details: str) -> None:
        """`label done/total`, seconds per step, time left, then `details`."""
        if not self.enabled:
            return
        per_step = (time.perf_counter() - self.started) / max(done - self.start, 1)
        eta = per_step * (self.total - done)
        self.stream.write(f"\r\033[K{self.label} {done}/{self.total}  {per_step:.2f} s/it  ETA {_clock(eta)}  {details}")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()
