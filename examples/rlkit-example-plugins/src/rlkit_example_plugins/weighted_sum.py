"""Reward `weighted-sum`: Σ_i weight_i · score_i over other registered rewards, named like recipe tables.

    [reward]
    type = "weighted-sum"

    [[reward.parts]]
    type = "python"
    function = "rewards.py:brevity"
    weight = 0.5

    [[reward.parts]]
    type = "reward-model"
    model = "models/reward"

Each part is a reward table: `type`, an optional `weight` (default 1), and that reward's own
settings, checked by its own config class when the recipe is read, so `rlkit check` finds a
misspelled part before anything is built.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from rlkit_core import hookimpl
from rlkit_core.config import setting
from rlkit_core.errors import RecipeError, RunError
from rlkit_core.interfaces import RewardSource
from rlkit_core.plugins import load_registry
from rlkit_core.recipe import structure_table
from rlkit_core.registry import Component, Registry


@attrs.frozen
class Part:
    type: str
    weight: float
    component: Component
    config: Any


def resolve_parts(parts: list[dict], registry: Registry) -> tuple[list[Part], list[str]]:
    """Each part table → its registered reward and structured config, or problems located as `[i].key`."""
    resolved, problems = [], []
    if not parts:
        problems.append("needs at least one part: [[reward.parts]] tables with a type")
    for index, table in enumerate(parts):
        where = f"[{index}]"
        options = dict(table)
        weight = options.pop("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            problems.append(f"{where}.weight: expected a finite number, got {weight!r}")
            continue
        name = options.pop("type", None)
        if not isinstance(name, str):
            problems.append(f"{where}.type: required: the name of a registered reward ({', '.join(registry.names('reward'))})")
            continue
        try:
            component = registry.get("reward", name, f"{where}.type")
        except RecipeError as exc:
            problems += exc.problems
            continue
        config, found = structure_table(options, component.config_class, where)
        problems += found
        if not found:
            resolved.append(Part(name, float(weight), component, config))
    return resolved, problems


def _parts_resolve(instance, attribute, parts):
    """Validator: a recipe with a broken part fails when it is read, not halfway into building."""
    _, problems = resolve_parts(parts, load_registry())
    if problems:
        raise ValueError("; ".join(problems))


@attrs.frozen
class WeightedSumConfig:
    parts: list[dict] = setting(help="rewards to add up: tables with a type, an optional weight (default 1) and that reward's own settings",
                                validator=_parts_resolve)


class WeightedSum(RewardSource):
    def __init__(self, config: WeightedSumConfig, context):
        parts, problems = resolve_parts(config.parts, load_registry())
        if problems:  # the validator passed, so the installed plugins changed in between
            raise RecipeError([f"$.reward.parts: {problem}" for problem in problems])
        self.parts = [(part, part.component.factory(part.config, context)) for part in parts]

    def score(self, prompts, responses, **columns):
        totals = [0.0] * len(responses)
        for part, reward in self.parts:
            scores = reward.score(prompts, responses, **columns)
            if len(scores) != len(responses):
                raise RunError(f"weighted-sum part {part.type!r} returned {len(scores)} scores for {len(responses)} responses")
            totals = [total + part.weight * float(score) for total, score in zip(totals, scores)]
        if not all(math.isfinite(total) for total in totals):
            raise RunError(f"weighted-sum: a part returned a non-finite score: {totals}")
        return totals


@hookimpl
def register_rewards(register):
    register("weighted-sum", WeightedSum, WeightedSumConfig)
