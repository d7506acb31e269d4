# pyright: standard
"""How a piece's rollouts lie in the rows of one forward pass: one rollout per row, padded
(`PaddedRows`), or several end to end in a row (`PackedRows`, `ppo.pack_sequences`).

Packed, each rollout's real tokens (its prompt without the left padding, then its response up to
its end) are placed first fit in rows about as wide as the piece's longest rollout (`packed_layout`).
Position ids restart at 0 where a rollout starts and no attention mask is passed: a policy that
declares `packs_sequences` keeps attention within each run of positions (transformers builds
that block-diagonal mask from restarting position ids), so every real position computes what it
does alone. The rest of a row is filler: a real token id at position 0, each filler token a run
of its own, whose outputs are never read.

Both layouts answer the same questions, so the trainer reads the response positions alike.
"""

from __future__ import annotations

import torch

from rlkit_core.batch import RolloutBatch
from rlkit_core.runtime.microbatches import FirstFit


class PaddedRows:
    """One rollout per row: left-padded prompt, right-padded response (`RolloutBatch.sequence`)."""

    def __init__(self, batch: RolloutBatch):
        self.inputs = batch.sequence()
        self.start = batch.prompt_length - 1  # the first position whose logits the loop reads
        self.computed = batch.prompt_mask.numel() + batch.response_mask.numel()

    def response_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[b, L - start, V] -> [b, R, V]: the positions that predict the response tokens."""
        return logits[:, :-1]

    def at_response(self, per_position: torch.Tensor) -> torch.Tensor:
        """[b, L] -> [b, R]: position t's output is about token t + 1."""
        return per_position[:, self.start:-1]


WIDER = 1.25  # how much wider than the longest rollout a packed row may be made, to need fewer rows


def first_fit(lengths: list[int], width: int, order: list[int]) -> list[tuple[int, int]]:
    """(row, offset) of each of `lengths` in rows of `width`, placed first fit in `order`."""
    fill, places = FirstFit(width), [(0, 0)] * len(lengths)
    for i in order:
        places[i] = fill.place(lengths[i])
    return places


def row_count(places: list[tuple[int, int]]) -> int:
    return 1 + max(row for row, _ in places)


def packed_layout(lengths: list[int]) -> tuple[int, list[tuple[int, int]]]:
    """(width, (row, offset) of each rollout): first fit in the piece's order in rows as wide as its
    longest rollout, as `PieceSize` counted it; or, where that leaves rows part empty, the narrowest
    width up to `WIDER` × the longest at which first fit, longest first, needs fewer rows and
    computes fewer positions (rows as wide as the longest rollout pack poorly: what is left of a
    row is often too short for the next rollout)."""
    longest, total = max(lengths), sum(lengths)
    width, places = longest, first_fit(lengths, longest, list(range(len(lengths))))
    longest_first = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    positions = width * row_count(places)
    for rows in range(row_count(places) - 1, 0, -1):
        candidate, step = max(longest, -(-total // rows)), max(1, longest // 100)  # the narrowest that might do
        while candidate <= WIDER * longest and candidate * rows < positions:
            tried = first_fit(lengths, candidate, longest_first)
            if row_count(tried) <= rows:
                width, places, positions = candidate, tried, candidate * row_count(tried)
                break
            candidate += step
        else:
            break  # no width within reach does it in `rows`: fewer rows would need wider ones still
    return width, places


class PackedRows:
    """Several rollouts per row (see the module docstring)."""

    start = 0  # logits at every position: the response positions lie anywhere in a row

    def __init__(self, batch: RolloutBatch, prompt_lengths: list[int], response_lengths: list[int]):
        width, places = packed_layout([p + r for p, r in zip(prompt_lengths, response_lengths)])
        rows = row_count(places)
        device = batch.prompt_ids.device
        # where each rollout's first real token goes, as a flat index into rows × width
        base = torch.tensor([row * width + offset for row, offset in places], device=device)
        input_ids, mask, positions = batch.sequence()
        real = mask.bool()
        target = base[:, None] + positions  # real tokens are contiguous and their positions count from 0
        # filler: the piece's first real token (not PAD: transformers warns of PAD without a mask, and
        # an added PAD may lie past a separate critic's embedding table)
        packed_ids = input_ids[real][0].repeat(rows * width)
        packed_positions = torch.zeros(rows * width, dtype=positions.dtype, device=device)
        packed_ids[target[real]] = input_ids[real]
        packed_positions[target[real]] = positions[real]
        self.inputs = (packed_ids.view(rows, width), None, packed_positions.view(rows, width))
        # response token j of a rollout sits at base + prompt + j; the position before predicts it
        before = base + torch.tensor(prompt_lengths, device=device) - 1
        index = before[:, None] + torch.arange(batch.response_ids.shape[1], device=device)
        self.response_index = torch.where(batch.response_mask.bool(), index, 0)  # [b, R]; padding reads position 0
        self.computed = rows * width

    def response_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[rows, width, V] -> [b, R, V]."""
        return self.at_response(logits)

    def at_response(self, per_position: torch.Tensor) -> torch.Tensor:
        """[rows, width, ...] -> [b, R, ...]: the outputs of the positions that predict each response token."""
        return per_position.flatten(0, 1)[self.response_index]
