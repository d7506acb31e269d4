"""Where a run's randomness comes from: seeded streams that depend only on (seed, index), and none
in the forward pass.

A resumed run must draw exactly what the interrupted one would have drawn next, so every random
stream besides torch's global one is derived from the run's seed and a counter (the data epoch,
the iteration), never carried over from earlier draws.
"""

from __future__ import annotations

import torch

SEED_STRIDE = 1_000_003


def sampling_seed(seed: int, process_index: int) -> int:
    """Process 0 keeps the run seed (a single process samples as it always did); the others get
    their own streams, derived from it, so that they do not draw the same responses."""
    return seed + SEED_STRIDE * process_index


def seeded_generator(seed: int, index: int) -> torch.Generator:
    """A CPU generator for stream `index` of a run seeded with `seed`. The large prime keeps the
    streams of neighbouring seeds apart (seed 1's stream 0 is not seed 0's stream 1)."""
    return torch.Generator().manual_seed(seed * 1_000_003 + index)


def switch_off_dropout(model: torch.nn.Module) -> None:
    """RL wants π_θ and π_old to differ only by the update, not by random masks."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
