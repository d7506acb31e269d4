"""A third-party plugin module that adds a policy-gradient surrogate with a setting of its own
(tests/test_surrogates.py loads it as an `rlkit` entry point would): its hook registers the
function with its config class, and a recipe then picks it with `[loss] type = "ppo-clip"` and
`[loss.surrogate] type = "demo-reinforce"`."""

import attrs

from rlkit_core import SurrogateTerms, at_least, hookimpl, setting


@attrs.frozen
class ReinforceConfig:
    scale: float = setting(1.0, help="multiplies every token's loss", validator=at_least(0))


def reinforce(log_ratio, advantages, mask, settings, clip):
    """Plain on-policy REINFORCE: -scale·A·log π_θ per token (written over the log-ratio, whose
    gradient is the same), no ratio weighting and no clip (the loss's `clip` goes unread)."""
    return SurrogateTerms(-settings.scale * advantages * log_ratio)


@hookimpl
def register_surrogates(register):
    register("demo-reinforce", reinforce, ReinforceConfig)
