"""Small real inputs for tests, built offline in a moment: a tiny causal LM on disk, a scored
rollout batch, the inputs the loop feeds a policy. Plugin authors' test suites use them as well as
rlkit's own; the pytest contract classes built on them are in `rlkit_core.testing.contracts`. Needs no
pytest, so importing it never fails in an environment without the test extra.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlkit_core.batch import RolloutBatch, sequence_inputs
from rlkit_core.recipe.document import toml_literal
from rlkit_core.testing.offline_models import write_tiny_model

__all__ = ["EPISODE_LOSS_MASK", "RESPONSE_MASK", "policy_inputs", "recipe_toml", "rollout_batch", "write_tiny_causal_lm"]

RESPONSE_MASK = [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
# within RESPONSE_MASK, with holes where an episode's environment tokens would lie: inside a
# response, and at the end of the last one (an episode cut off during a tool's output)
EPISODE_LOSS_MASK = [[1, 1, 0, 0, 1], [1, 0, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 0, 1, 0], [1, 1, 1, 0, 0]]


def rollout_batch(with_values: bool = True, seed: int = 0, loss_mask: torch.Tensor | None = None) -> RolloutBatch:
    """A scored batch as the loop hands it to the advantage estimator: 6 rollouts in 3 groups of 2,
    5 response positions, responses of 1 to 5 tokens. Every response token counts, unless
    `loss_mask` (within `RESPONSE_MASK`) says which do, as an episode's would. Positions that do not
    count hold NaN, as garbage may: a component must select counted positions (see
    `rlkit_core.functional`), not multiply by the mask."""
    generator = torch.Generator().manual_seed(seed)
    response_mask = torch.tensor(RESPONSE_MASK)
    mask = response_mask if loss_mask is None else loss_mask
    assert not (mask.bool() & ~response_mask.bool()).any(), "a loss mask lies within the response mask"
    batch_size, width = mask.shape

    def per_token(scale=1.0, shift=0.0):
        values = torch.randn(batch_size, width, generator=generator) * scale + shift
        return torch.where(mask.bool(), values, torch.full_like(values, float("nan")))

    return RolloutBatch(
        prompts=[f"prompt {i // 2}" for i in range(batch_size)],
        columns={"reference": [f"ref {i // 2}" for i in range(batch_size)]},
        group_ids=torch.arange(batch_size) // 2,
        prompt_ids=torch.randint(3, 100, (batch_size, 3), generator=generator),
        prompt_mask=torch.ones(batch_size, 3, dtype=torch.long),
        response_ids=torch.randint(3, 100, (batch_size, width), generator=generator),
        response_mask=response_mask,
        loss_mask=mask,
        sampled_logprobs=per_token(0.5, -2.0),
        responses=[f"response {i}" for i in range(batch_size)],
        ended=torch.tensor([False, True, True, True, True, False]),
        scores=torch.randn(batch_size, generator=generator),
        old_logprobs=per_token(0.5, -2.0),
        ref_logprobs=per_token(0.5, -2.0),
        values=per_token() if with_values else None,
        kl=per_token(0.1),
        rewards=per_token(),
        advantages=per_token(),
        returns=per_token(),
        baseline_scores=torch.randn(batch_size, generator=generator),
    )


def write_tiny_causal_lm(path: Path) -> Path:
    """A two-layer, 32-wide GPT-2 with the byte-level ByT5 tokenizer: real transformers classes,
    built offline in a moment, so contract tests need no hub."""
    return write_tiny_model(path, "byt5")


def recipe_toml(document: dict) -> str:
    """A recipe document (tables of settings, as `rlkit_core.recipe.document` parses them) as TOML text, for
    tests that run `rlkit` on a recipe file."""
    lines = []
    for table, body in document.items():
        lines.append(f"[{table}]")
        lines += [f"{key} = {toml_literal(value)}" for key, value in body.items()]
    return "\n".join(lines) + "\n"


def policy_inputs(tokenizer, prompts=("ab", "abcdef")):
    """(input_ids, attention_mask, position_ids) of left-padded prompts, as the loop feeds them."""
    from rlkit_core.prompts import encode_prompts

    return sequence_inputs(*encode_prompts(tokenizer, [{"prompt": p} for p in prompts], "cpu"))
