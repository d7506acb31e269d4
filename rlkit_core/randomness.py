"""Where a run's randomness comes from: seeded streams that depend only on (seed, index), and none
in the forward pass.

A resumed run must draw exactly what the interrupted one would have drawn next, so every random
stream besides torch's global one is derived from the run's seed and a counter (the data epoch,
the iteration), never carried over from earlier draws.
"""

from __future__ import annotations

import torch

# A large prime keeps the streams of neighbouring seeds apart (seed 1's stream 0 is not seed 0's stream 1).
SEED_STRIDE = 1_000_003
EVALUATION_OFFSET = 7_919  # evaluation's streams stay apart from the run seed's


def seeded_generator(seed: int, index: int) -> torch.Generator:
    """A CPU generator for stream `index` of a run seeded with `seed`."""
    return torch.Generator().manual_seed(seed * SEED_STRIDE + index)


def data_order_generator(seed: int, data_epoch: int) -> torch.Generator:
    """The order of the training prompts in `data_epoch`."""
    return seeded_generator(seed, data_epoch)


def minibatch_order_generator(seed: int, iteration: int) -> torch.Generator:
    """The order of the rollouts in the minibatches of iteration `iteration`'s update (counted from
    0). It is seeded as `data_order_generator` of the same number, as it always was: the figures of
    every run depend on it."""
    return seeded_generator(seed, iteration)


def sampling_seed(seed: int, process_index: int) -> int:
    """The seed of torch's global stream (sampling) in process `process_index`. Process 0 keeps the
    run seed (a single process samples as it always did); the others get their own streams, derived
    from it, so that they do not draw the same responses."""
    return seed + SEED_STRIDE * process_index


def evaluation_seed(seed: int) -> int:
    """The seed of torch's global stream while the held-out prompts are evaluated, in a forked
    stream, so that evaluation changes nothing the training run draws."""
    return seed + EVALUATION_OFFSET


def held_out_generator(seed: int) -> torch.Generator:
    """The choice of the held-out prompts, the same on every resume."""
    return torch.Generator().manual_seed(evaluation_seed(seed))


def switch_off_dropout(model: torch.nn.Module) -> None:
    """RL wants π_θ and π_old to differ only by the update, not by random masks."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def extra_prompts_seed(seed: int) -> int:
    """The seed of dynamic sampling's extra prompt stream (`PromptStream`), apart from the training
    prompts' stream (it shares evaluation's offset, which seeds a stream of another kind)."""
    return seed + EVALUATION_OFFSET
