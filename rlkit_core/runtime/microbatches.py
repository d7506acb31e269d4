"""How a set of rollouts splits into forward passes: by length, so that each piece, trimmed to its
own longest prompt and response (`RolloutBatch.trimmed`), computes little padding.

Two ways to split: a fixed number of pieces of equal size (`gradient_accumulation_steps`,
`forward_batch_size`), or a token budget, where a piece holds as many rollouts as fit in
rows × (longest prompt + longest response) ≤ budget. Either way the pieces are groups of rollouts
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


def budget_pieces(index: torch.Tensor, prompt_lengths: list[int], response_lengths: list[int], budget: int,
                  at_least: int = 1) -> list[torch.Tensor]:
    """`index` sorted by length and cut greedily into pieces whose padded size, rows × (longest prompt +
    longest response), stays within `budget` tokens; then the largest pieces are halved until there are
    `at_least` of them (processes that must take the same number of steps). Raises `TooLong`."""
    lengths = [p + r for p, r in zip(prompt_lengths, response_lengths)]
    pieces, current, longest_prompt, longest_response = [], [], 0, 0
    for row in by_length(index, lengths):
        if lengths[row] > budget:
            raise TooLong(lengths[row], budget)
        prompt, response = max(longest_prompt, prompt_lengths[row]), max(longest_response, response_lengths[row])
        if current and (len(current) + 1) * (prompt + response) > budget:
            pieces.append(current)
            current, prompt, response = [], prompt_lengths[row], response_lengths[row]
        current.append(row)
        longest_prompt, longest_response = prompt, response
    pieces.append(current)
    while len(pieces) < min(at_least, len(index)):
        widest = max(range(len(pieces)), key=lambda i: len(pieces[i]))
        half = (len(pieces[widest]) + 1) // 2
        pieces[widest:widest + 1] = [pieces[widest][:half], pieces[widest][half:]]
    return [torch.tensor(rows, device=index.device) for rows in pieces]


def padded_to(value: torch.Tensor, width: int, fill: float = 0.0) -> torch.Tensor:
    """[b, r] -> [b, width]: a trimmed piece's per-response-token output, filled out after its end."""
    return torch.nn.functional.pad(value, (0, width - value.shape[1]), value=fill)
