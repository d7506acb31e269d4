"""A one-line progress display (tqdm's) for a person at a terminal; silent when output is piped or --quiet."""

from __future__ import annotations

import sys

from tqdm import tqdm


class Progress:
    """`label done/total`, seconds per step and time left (averaged since `start`), then the
    caller's details."""

    def __init__(self, total: int, start: int = 0, quiet: bool = False, stream=None, label: str = "iter"):
        stream = stream or sys.stderr
        self.bar = tqdm(total=total, initial=start, desc=label, file=stream, disable=quiet or not stream.isatty(),
                        smoothing=0, bar_format="{desc} {n_fmt}/{total_fmt}  {rate_inv_fmt}  ETA {remaining}{postfix}")

    def update(self, iteration: int, metrics: dict[str, float]) -> None:
        """A PPO iteration's line: score, KL and β."""
        self.show(iteration, f"score {metrics['score/mean']:.4f}  KL {metrics['kl/ref']:.3f}  β {metrics['kl/beta']:.4f}")

    def show(self, done: int, details: str) -> None:
        """`done` steps of `total` are done; `details` after the time left."""
        self.bar.set_postfix_str(details, refresh=False)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        self.bar.close()
