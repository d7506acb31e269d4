# pyright: standard
"""The policy's forward pass over rollouts, shared by the no-grad passes and the update: how a
batch is cut into chunks that fit a forward pass, how a chunk lies in the rows of the pass, and
what the pass returns for the response tokens."""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlkit_core.batch import RolloutBatch
from rlkit_core.errors import RecipeError
from rlkit_core.functional import entropy_from_logits, logprobs_from_logits
from rlkit_core.recipe.assemble import Components
from rlkit_core.runtime.distributed import Processes
from rlkit_core.runtime.microbatches import TooLong, budget_pieces, fixed_pieces
from rlkit_core.runtime.packing import PackedRows, PaddedRows

# told of every forward pass: (phase, the chunk, its rows); `PositionCount` is one
ForwardObserver = Callable[[str, RolloutBatch, "PackedRows | PaddedRows"], None]


def lengths_of(batch: RolloutBatch) -> tuple[list[int], list[int]]:
    """Each rollout's prompt and response length in tokens (one read from the device)."""
    prompt, response = torch.stack([batch.prompt_mask.sum(dim=1), batch.response_mask.sum(dim=1)]).tolist()
    return prompt, response


def rows_of(chunk: RolloutBatch, packed: bool) -> PackedRows | PaddedRows:
    """How `chunk` (a trimmed one) lies in the rows of its forward pass: packed when the recipe
    asks (`rlkit_core.runtime.packing`), else one rollout per row."""
    if packed:
        return PackedRows(chunk, *lengths_of(chunk))
    return PaddedRows(chunk)


def response_view(components: Components, batch: RolloutBatch, rows, grad: bool):
    """(logprobs, values, entropy, response logits) of the current parameters on `batch`, laid
    out as `rows` (`rows_of`).

    In the update (`grad`) the loss's declared needs decide: entropy keeps its graph only when
    the loss optimises it (otherwise it is a detached diagnostic, so no [b, R, V] buffers are
    held for a backward that never uses them), and the logits are kept only when it reads them."""
    policy, value_head = components.policy, components.value_head
    out = policy.forward(*rows.inputs, start=rows.start)
    logits = rows.response_logits(out.logits)
    temperature, suppressed = components.generator.temperature, policy.suppressed_token_ids
    logprobs = logprobs_from_logits(logits, batch.response_ids, temperature, suppressed)
    values = None
    if value_head is not None:
        values = rows.at_response(value_head.values(out, *rows.inputs))
    entropy = None
    if grad and components.loss.needs_entropy_grad:
        entropy = entropy_from_logits(logits, temperature, suppressed)
    elif grad:
        with torch.no_grad():
            entropy = entropy_from_logits(logits.detach(), temperature, suppressed)
    return logprobs, values, entropy, logits if not grad or components.loss.needs_logits else None


def chunks_of(index: torch.Tensor, lengths: tuple[list[int], list[int]], budget: int, size: int, setting: str, packed: bool,
              processes: Processes | None = None) -> list[torch.Tensor]:
    """`index`'s rollouts as forward passes, grouped by length: within `budget` tokens each when
    one is set, else `size` rows each. With `processes`, every process gets as many chunks as the
    process that needs most (collective calls in the backward must pair up)."""
    if not budget:
        return fixed_pieces(index, [p + r for p, r in zip(*lengths)], size)
    try:
        chunks = budget_pieces(index, *lengths, budget, packed=packed)
        if processes is not None and processes.count > 1:
            count = max(processes.gather_objects(len(chunks)))
            chunks = budget_pieces(index, *lengths, budget, at_least=count, packed=packed)
    except TooLong as too_long:
        raise RecipeError([f"$.ppo.{setting}: a rollout of {too_long.tokens} tokens (prompt and response) does not fit in "
                           f"the budget of {too_long.budget}; raise it to at least data.max_prompt_tokens + "
                           "generator.max_new_tokens, or limit the prompts with data.max_prompt_tokens"]) from None
    return chunks


class PositionCount:
    """Positions computed and positions that are real tokens, per phase, summed over the run (the
    benchmark's padding share); a `ForwardObserver`. The real count stays a device tensor: reading
    it at every chunk would wait for each one."""

    def __init__(self):
        self.positions: dict[str, tuple] = {"forward": (0, 0), "train": (0, 0)}

    def __call__(self, phase: str, chunk: RolloutBatch, rows) -> None:
        computed, real = self.positions[phase]
        self.positions[phase] = (computed + rows.computed, real + chunk.prompt_mask.sum() + chunk.response_mask.sum())
