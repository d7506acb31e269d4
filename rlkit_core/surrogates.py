"""Policy-gradient surrogates: what each token's loss is, given its importance ratio and advantage.

A surrogate is one function over a fixed signature (`Surrogate`) with a settings class of its own
(a frozen attrs class, empty when it has none), registered like any component by a plugin's hook:

    @hookimpl
    def register_surrogates(register):
        register("my-surrogate", my_surrogate, MySurrogateConfig)

A recipe picks it in the built-in `ppo-clip` loss's nested table, `[loss.surrogate]` with `type =
"my-surrogate"` and its settings (or `surrogate = "my-surrogate"` for its default settings). The
loss owns what every surrogate shares: aggregation, importance correction, masking, the value,
entropy and KL terms, the skip. It calls `my_surrogate(log_ratio, advantages, mask, settings, clip)`:

- `log_ratio` [B, R]: log π_θ - log π_old of each counted token, 0 on padding, with gradient
  (`functional.token_log_ratio`); its gradient is that of log π_θ.
- `advantages` [B, R]; `mask` [B, R], nonzero on counted tokens (values elsewhere may be garbage).
- `settings`: an instance of the surrogate's own config class, from `[loss.surrogate]`.
- `clip`: the loss's ratio clip (`RatioClip`, ppo-clip's `clip_low`, `clip_high`, `dual_clip`),
  which the recipes set on `[loss]`; a surrogate that bounds its ratio its own way ignores it.

It returns each token's loss before weighting and aggregation (the loss minimises its aggregate),
and diagnostics as means over the counted tokens.
"""

from __future__ import annotations

from typing import Any, Protocol

import attrs
import torch


@attrs.frozen
class RatioClip:
    """The ratio clip [1 - low, 1 + high] of the loss a surrogate runs in, and the dual-clip constant
    c > 1 bounding a token with A < 0 at -c·A (0: off)."""

    low: float
    high: float
    dual: float = 0.0


@attrs.frozen
class SurrogateTerms:
    """A surrogate's output. `per_token` [B, R]: each token's loss (garbage on padding is fine: the
    loss selects counted tokens). `diagnostics`: detached means over counted tokens, logged as
    `train/<name>`. `log_ratio`: the log-ratios the surrogate weighed, when not the ones it was
    given (GSPO's one per response); the loss's ratio diagnostics, its skip and the loop's
    `train/approx_kl` read them."""

    per_token: torch.Tensor
    diagnostics: dict[str, torch.Tensor] = attrs.field(factory=dict)
    log_ratio: torch.Tensor | None = None


class Surrogate(Protocol):
    """The signature of a registered surrogate (see the module)."""

    def __call__(self, log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, settings: Any,
                 clip: RatioClip) -> SurrogateTerms: ...
