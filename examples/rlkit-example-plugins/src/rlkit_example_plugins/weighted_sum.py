"""Reward `weighted-sum`: Σ_i weight_i · score_i over other registered rewards, each a nested reward table.

    [reward]
    type = "weighted-sum"

    [[reward.parts]]
    type = "python"
    function = "rewards.py:brevity"
    weight = 0.5

    [[reward.parts]]
    type = "reward-model"
    model = "models/reward"

Each part is a reward table: `type`, that reward's own settings and an optional `weight` (default
1). rlkit checks every part against its own reward's config class when it reads the recipe, so
`rlkit check` finds a misspelled part (`$.reward.parts[1].wieght`) before anything is built, and
runs each part's own checks at its place (`$.reward.parts[0].function: no file ...`).
"""

from __future__ import annotations

import math

import attrs

from rlkit_core import ComponentChoice, RewardSource, RunError, hookimpl, nested_components, setting


def _finite(instance, attribute, value):
    if not math.isfinite(value):
        raise ValueError(f"must be a finite number, got {value!r}")


def _not_empty(instance, attribute, value):
    if not value:
        raise ValueError("needs at least one part: [[reward.parts]] tables with a type")


@attrs.frozen
class PartWeight:
    """What weighted-sum reads from each part table besides the part's own settings."""

    weight: float = setting(1.0, help="the part's score is multiplied by this", validator=_finite)


@attrs.frozen
class WeightedSumConfig:
    parts: list[ComponentChoice] = nested_components("reward", extra=PartWeight, validator=_not_empty,
                                                     help="rewards to add up: reward tables, each with an optional weight")


class WeightedSum(RewardSource):
    def __init__(self, config: WeightedSumConfig, context):
        self.parts = [(part.component.name, part.extra.weight, context.build(part)) for part in config.parts]

    def score(self, prompts, responses, **columns):
        totals = [0.0] * len(responses)
        for name, weight, reward in self.parts:
            scores = reward.score(prompts, responses, **columns)
            if len(scores) != len(responses):
                raise RunError(f"weighted-sum part {name!r} returned {len(scores)} scores for {len(responses)} responses")
            totals = [total + weight * float(score) for total, score in zip(totals, scores)]
        if not all(math.isfinite(total) for total in totals):
            raise RunError(f"weighted-sum: a part returned a non-finite score: {totals}")
        return totals


@hookimpl
def register_rewards(register):
    register("weighted-sum", WeightedSum, WeightedSumConfig)
