"""The order in which prompts are used: a fresh seeded shuffle per pass over the data.

The prompts of iteration i depend only on (seed, i), so a resumed run picks up exactly where the
interrupted one left off, with no position to store and nothing skipped or repeated.
"""

from __future__ import annotations

from typing import Any

import torch

from rlkit_core.randomness import data_order_generator


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
