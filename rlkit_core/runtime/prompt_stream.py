# pyright: standard
"""The order in which prompts are used: a fresh seeded shuffle per pass over the data.

The prompts of iteration i depend only on (seed, i), so a resumed run picks up exactly where the
interrupted one left off, with no position to store and nothing skipped or repeated.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from rlkit_core.randomness import data_order_generator


@attrs.frozen
class Prompts:
    """A run's prompts, rendered and within the length limit, split before training."""

    train: list[dict[str, Any]]
    held_out: list[dict[str, Any]]  # `[eval] size` of them, never in a training batch
    counts: dict[str, int]  # loaded, cut, skipped (too long), empty: for the report
    max_tokens: int  # the longest prompt in tokens, longer ones cut from the left (0: no limit)


class PromptStream:
    def __init__(self, records: list[dict[str, Any]], prompts_per_iteration: int, seed: int):
        self.records = records
        self.per_iteration = prompts_per_iteration
        self.seed = seed
        self._orders: dict[int, list[int]] = {}

    def _order(self, data_epoch: int) -> list[int]:
        if data_epoch not in self._orders:
            order = torch.randperm(len(self.records), generator=data_order_generator(self.seed, data_epoch))
            self._orders = {data_epoch: order.tolist()}
        return self._orders[data_epoch]

    def batch(self, iteration: int) -> list[dict[str, Any]]:
        """The records of iteration `iteration` (0-based)."""
        n = len(self.records)
        start = iteration * self.per_iteration
        return [self.records[self._order(k // n)[k % n]] for k in range(start, start + self.per_iteration)]
