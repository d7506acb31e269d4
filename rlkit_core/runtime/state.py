# pyright: standard
"""The run's state between iterations: the counters a checkpoint saves and a resumed run restores.

Everything else a run continues from lives elsewhere and needs no copy here: the weights,
optimiser, schedule and random states are accelerate's (the engine's), the KL controller keeps
its own state, and the prompt stream and rlkit's seeded streams are functions of (seed, iteration).
"""

from __future__ import annotations

import attrs


@attrs.frozen
class RunState:
    iteration: int = 0  # iterations completed (trained or skipped)
    nonfinite_in_a_row: int = 0  # optimiser steps with a non-finite loss or gradient, the latest ones
    skips_in_a_row: int = 0  # batches skipped for a failed reward, the latest ones
    skipped_batches: int = 0  # batches skipped for a failed reward over the whole run
    untrained_in_a_row: int = 0  # batches with no token to train (every episode kept out of training), the latest ones
    untrained_batches: int = 0  # such batches over the whole run

    def trained(self, nonfinite_in_a_row: int) -> RunState:
        """The state after an iteration that trained on its batch."""
        return attrs.evolve(self, iteration=self.iteration + 1, nonfinite_in_a_row=nonfinite_in_a_row, skips_in_a_row=0,
                            untrained_in_a_row=0)

    def reward_failed(self) -> RunState:
        """The count of failed batches in a row, one more, before deciding whether to skip or stop."""
        return attrs.evolve(self, skips_in_a_row=self.skips_in_a_row + 1)

    def skipped(self) -> RunState:
        """The state after an iteration whose batch was skipped (after `reward_failed`)."""
        return attrs.evolve(self, iteration=self.iteration + 1, skipped_batches=self.skipped_batches + 1)

    def untrained(self) -> RunState:
        """The state after an iteration whose batch had no token to train (nothing was updated)."""
        return attrs.evolve(self, iteration=self.iteration + 1, untrained_in_a_row=self.untrained_in_a_row + 1,
                            untrained_batches=self.untrained_batches + 1)
