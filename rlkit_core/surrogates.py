"""Policy-gradient surrogates: what each token's loss is, given its importance ratio and advantage.

A surrogate is one function over a fixed signature, registered under the name a recipe gives
(`[loss] surrogate = "..."` with the built-in `ppo-clip` loss, which owns what every surrogate
shares: aggregation, importance correction, masking, the value, entropy and KL terms, the skip):

    @surrogate("my-surrogate")
    def my_surrogate(log_ratio, advantages, mask, settings) -> SurrogateTerms:
        ...

- `log_ratio` [B, R]: log π_θ - log π_old of each counted token, 0 on padding, with gradient
  (`functional.token_log_ratio`); its gradient is that of log π_θ.
- `advantages` [B, R]; `mask` [B, R], nonzero on counted tokens (values elsewhere may be garbage).
- `settings`: the loss's config (ppo-clip's `clip_low`, `clip_high`, `dual_clip`, ...).

It returns each token's loss before weighting and aggregation (the loss minimises its aggregate),
and diagnostics as means over the counted tokens. A plugin registers its own surrogate by
calling the decorator when its module is imported: the module its `rlkit` entry point names is
imported before a recipe is checked, so the recipe may then name it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch

from rlkit_core.functional import clipped_surrogate, masked_mean, response_mean


@attrs.frozen
class SurrogateTerms:
    """A surrogate's output. `per_token` [B, R]: each token's loss (garbage on padding is fine: the
    loss selects counted tokens). `diagnostics`: detached means over counted tokens, logged as
    `train/<name>`. `log_ratio`: the log-ratios the surrogate weighed, when not the ones it was
    given (GSPO's one per response); the loss's ratio diagnostics and its skip read them."""

    per_token: torch.Tensor
    diagnostics: dict[str, torch.Tensor] = attrs.field(factory=dict)
    log_ratio: torch.Tensor | None = None


Surrogate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any], SurrogateTerms]
SURROGATES: dict[str, Surrogate] = {}


def surrogate(name: str) -> Callable[[Surrogate], Surrogate]:
    """Register the decorated function as surrogate `name`; a name taken by another function is an
    error that names both (the same function registered again, as a module imported twice, is not)."""

    def register(function: Surrogate) -> Surrogate:
        known = SURROGATES.get(name)
        if known is not None and _origin(known) != _origin(function):
            raise ValueError(f"surrogate {name!r} is registered twice: by {_origin(known)} and by {_origin(function)}; rename one")
        SURROGATES[name] = function
        return function

    return register


def _origin(function: Surrogate) -> str:
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', repr(function))}"


def registered_surrogate(instance, attribute, value) -> None:
    """attrs validator: `value` names a registered surrogate (checked when the recipe is, after the
    plugins that register theirs were imported)."""
    if value not in SURROGATES:
        raise ValueError(f"no surrogate {value!r} is registered; registered: {', '.join(sorted(SURROGATES))}")


@surrogate("ppo")
def ppo(log_ratio, advantages, mask, settings) -> SurrogateTerms:
    """PPO's clipped surrogate (Schulman et al. 2017) with its ratio clipped to [1 - clip_low,
    1 + clip_high] (a larger clip_high is DAPO's clip-higher) and optional dual-clip; clipfrac is
    the share of tokens whose clipped branch sets the loss."""
    per_token, clipped, dual_active = clipped_surrogate(log_ratio.exp(), advantages, settings.clip_low, settings.clip_high,
                                                        settings.dual_clip)
    diagnostics = {"clipfrac": masked_mean(clipped.float(), mask)}
    if dual_active is not None:
        diagnostics["dual_clipfrac"] = masked_mean(dual_active.float(), mask)
    return SurrogateTerms(per_token, diagnostics)


@surrogate("gspo")
def gspo(log_ratio, advantages, mask, settings) -> SurrogateTerms:
    """GSPO (Zheng et al. 2025, arXiv:2507.18071): PPO's clipped surrogate over one length-normalised
    ratio per response, exp of the mean of its tokens' log-ratios (`functional.sequence_log_ratio`);
    its clip is far narrower than PPO's (3e-4..4e-4). The ratio is 1 on padding, so that garbage
    advantages there cannot reach the response's gradient through its mean."""
    sequence = torch.where(mask.bool(), response_mean(log_ratio, mask), torch.zeros_like(log_ratio))
    return attrs.evolve(ppo(sequence, advantages, mask, settings), log_ratio=sequence)


@surrogate("cispo")
def cispo(log_ratio, advantages, mask, settings) -> SurrogateTerms:
    """CISPO (MiniMax 2025, arXiv:2506.13585): every token's gradient is -A·∇log π_θ weighted by its
    ratio capped at 1 + clip_high and detached, so a token past the cap still learns (PPO's clip
    would drop its gradient) while the weight stays bounded. The loss is -sg(min(ratio, 1 +
    clip_high))·A·log ratio, whose gradient is that (log π_old is a constant) and whose value is 0
    on-policy; clipfrac is the share of tokens whose weight was capped."""
    ratio = log_ratio.detach().exp()
    weight = ratio.clamp(max=1.0 + settings.clip_high)
    return SurrogateTerms(-weight * advantages * log_ratio, {"clipfrac": masked_mean((ratio > 1.0 + settings.clip_high).float(), mask)})
