# pyright: standard
"""How a set of rollouts splits into forward passes: by length, so that each piece, trimmed to its
own longest prompt and response (`RolloutBatch.trimmed`), computes little padding.

Two ways to split: a fixed number of pieces of equal size (`gradient_accumulation_steps`,
`forward_batch_size`), or a token budget, where a piece holds as many rollouts as fit in the
positions it computes ≤ budget: rows × (longest prompt + longest response), or, packed
(`ppo.pack_sequences`), its packed rows × their width. Either way the pieces are groups of rollouts
of similar length: the rows are sorted by length first. Which rollouts share a piece changes
nothing but float rounding, since every row's outputs depend on that row alone and the losses are
sums over global counts.
"""

from __future__ import annotations

import attrs
import torch


@attrs.frozen
class TooLong(Exception):
    """One rollout is longer than the token budget on its own."""

    tokens: int
    budget: int


def by_length(index: torch.Tensor, lengths: list[int]) -> list[int]:
    """`index`'s entries (rows of the batch) sorted by their total length, longest first (stable)."""
    rows = index.tolist()
    return sorted(rows, key=lambda row: -lengths[row])


def fixed_pieces(index: torch.Tensor, lengths: list[int], size: int) -> list[torch.Tensor]:
    """`index` sorted by length and cut into pieces of `size` rows (the last may be shorter)."""
    rows = by_length(index, lengths)
    return [torch.tensor(rows[start:start + size], device=index.device) for start in range(0, len(rows), size)]


class FirstFit:
    """Rows of `width` positions filled first fit: each length goes into the first row with room
    (fed longest first, as pieces are, this is first-fit decreasing)."""

    def __init__(self, width: int):
        self.width, self.free = width, []  # room left in each row

    def row_for(self, length: int) -> int:
        return next((i for i, room in enumerate(self.free) if room >= length), len(self.free))

    def place(self, length: int) -> tuple[int, int]:
        """(row, offset) of a run of `length` positions."""
        row = self.row_for(length)
        if row == len(self.free):
            self.free.append(self.width)
        offset = self.width - self.free[row]
        self.free[row] -= length
        return row, offset


class PieceSize:
    """The positions a piece computes as rollouts join it: padded, rows × (longest prompt +
    longest response); packed (`rlkit_core.runtime.packing`), rows as wide as its first (longest)
    rollout, filled first fit in the order the rollouts join."""

    def __init__(self, packed: bool):
        self.packed, self.rows = packed, None
        self.rollouts, self.longest_prompt, self.longest_response = 0, 0, 0

    @property
    def positions(self) -> int:
        if self.packed:
            return self.rows.width * len(self.rows.free) if self.rows else 0
        return self.rollouts * (self.longest_prompt + self.longest_response)

    def with_(self, prompt: int, response: int) -> int:
        """The size with one more rollout of these lengths."""
        if not self.packed:
            return (self.rollouts + 1) * (max(self.longest_prompt, prompt) + max(self.longest_response, response))
        if self.rows is None:
            return prompt + response
        return self.rows.width * max(len(self.rows.free), self.rows.row_for(prompt + response) + 1)

    def add(self, prompt: int, response: int) -> None:
        if self.packed:
            self.rows = self.rows or FirstFit(prompt + response)
            self.rows.place(prompt + response)
        self.rollouts += 1
        self.longest_prompt, self.longest_response = max(self.longest_prompt, prompt), max(self.longest_response, response)


def budget_pieces(index: torch.Tensor, prompt_lengths: list[int], response_lengths: list[int], budget: int,
                  at_least: int = 1, packed: bool = False) -> list[torch.Tensor]:
    """`index` sorted by length and cut greedily into pieces whose computed size (`PieceSize`)
    stays within `budget` tokens; packed, the ends of a piece's rows then take the shortest
    rollouts left that fit there. Then the largest pieces are halved until there are `at_least` of
    them (processes that must take the same number of steps). Each piece lists its rollouts in the
    order they joined it (`PackedRows` places them so). Raises `TooLong`."""
    lengths = [p + r for p, r in zip(prompt_lengths, response_lengths)]
    left = by_length(index, lengths)
    if lengths[left[0]] > budget:
        raise TooLong(lengths[left[0]], budget)
    pieces = []
    while left:
        piece, size = [], PieceSize(packed)
        while left and (not piece or size.with_(prompt_lengths[left[0]], response_lengths[left[0]]) <= budget):
            piece.append(left.pop(0))
            size.add(prompt_lengths[piece[-1]], response_lengths[piece[-1]])
        while packed and left and size.with_(prompt_lengths[left[-1]], response_lengths[left[-1]]) == size.positions:
            piece.append(left.pop())  # fits beside a longer rollout: no new row
            size.add(prompt_lengths[piece[-1]], response_lengths[piece[-1]])
        pieces.append(piece)
    while len(pieces) < min(at_least, len(index)):
        widest = max(range(len(pieces)), key=lambda i: len(pieces[i]))
        half = (len(pieces[widest]) + 1) // 2
        pieces[widest:widest + 1] = [pieces[widest][:half], pieces[widest][half:]]
    return [torch.tensor(rows, device=index.device) for rows in pieces]


def padded_to(value: torch.Tensor, width: int, fill: float = 0.0) -> torch.Tensor:
    """[b, r] -> [b, width]: a trimmed piece's per-response-token output, filled out after its end."""
    return torch.nn.functional.pad(value, (0, width - value.shape[1]), value=fill)
