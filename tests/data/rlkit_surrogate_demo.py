"""A third-party plugin module that adds a policy-gradient surrogate (tests/test_surrogates.py
loads it as an `rlkit` entry point would): registering it is calling the decorator at import,
and a recipe then picks it with `[loss] type = "ppo-clip"`, `surrogate = "demo-reinforce"`."""

from rlkit_core import SurrogateTerms, surrogate


@surrogate("demo-reinforce")
def reinforce(log_ratio, advantages, mask, settings):
    """Plain on-policy REINFORCE: -A·log π_θ per token (written over the log-ratio, whose gradient
    is the same), no ratio weighting and no clip."""
    return SurrogateTerms(-advantages * log_ratio)
