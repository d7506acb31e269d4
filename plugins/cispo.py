"""Surrogate `cispo`, with its one setting of its own: a whole surrogate in one module.

CISPO (MiniMax, "MiniMax-M1", 2025, arXiv:2506.13585, section 3.1) clips the importance-sampling
weight instead of the update: every token's gradient is -A·∇log π_θ weighted by its ratio clipped
to [1 - ε_low, 1 + ε_high] and detached, so a token past the bound still learns (PPO's clip would
drop its gradient) while the weight stays bounded. The paper sets no lower bound (ε_low large) and
tunes ε_high; so does this module by default. `ppo-clip` registers it (`register_surrogates`): a
third-party module would hold that hook itself and be its plugin's entry point.
"""

import attrs

from rlkit_core import RatioClip, SurrogateTerms, between, greater_than, setting
from rlkit_core.functional import masked_mean


@attrs.frozen
class CISPOConfig:
    eps_high_is: float = setting(0.2, help="ε_high: a token's weight is its ratio capped at 1 + eps_high_is", validator=greater_than(0))
    eps_low_is: float = setting(1.0, help="ε_low: the weight is at least 1 - eps_low_is (1: no lower bound, as the paper trains)",
                                validator=between(0, 1))


def cispo(log_ratio, advantages, mask, settings: CISPOConfig, clip: RatioClip) -> SurrogateTerms:
    """loss_t = -sg(clip(r_t, 1 - eps_low_is, 1 + eps_high_is))·A_t·log r_t: its gradient is the
    paper's, -sg(r̂_t)·A_t·∇log π_θ (log π_old is a constant), and its value is 0 on-policy. It
    bounds the weight by its own settings, not by the loss's `clip`; clipfrac is the share of
    tokens whose weight was clipped."""
    ratio = log_ratio.detach().exp()
    weight = ratio.clamp(1.0 - settings.eps_low_is, 1.0 + settings.eps_high_is)
    return SurrogateTerms(-weight * advantages * log_ratio, {"clipfrac": masked_mean((weight != ratio).float(), mask)})
