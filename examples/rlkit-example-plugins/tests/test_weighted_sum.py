"""The weighted-sum reward: rlkit's reward contract, the sum itself, and located part errors."""

import math
from pathlib import Path

import pytest
import torch

from rlkit_core.context import BuildContext
from rlkit_core.errors import RecipeError
from rlkit_core.recipe.document import parse_recipe
from rlkit_core.recipe.plugins import load_registry
from rlkit_core.testing.contracts import RewardContract

TOY = Path(__file__).with_name("toy_rewards.py")
PARTS = [
    {"type": "python", "function": f"{TOY}:length", "weight": 0.5},
    {"type": "python", "function": f"{TOY}:exclamations"},
]


class TestWeightedSumContract(RewardContract):
    component = "weighted-sum"
    config = {"parts": PARTS}


def recipe_with(parts):
    """A recipe whose reward is a weighted sum of `parts`; only the reward is built from it."""
    document = {
        "run": {"steps": 1},
        "policy": {"type": "hf", "model": "not-built-here"},
        "data": {"type": "toy-summaries"},
        "reward": {"type": "weighted-sum", "parts": parts},
    }
    return parse_recipe(document, load_registry())


def weighted_sum(parts):
    recipe = recipe_with(parts)
    return BuildContext(recipe, torch.device("cpu"), "unused", 0).build(recipe["reward"])


def test_scores_are_the_weighted_sum_of_the_parts():
    # 0.5 · len + 1 · count("!")
    assert weighted_sum(PARTS).score(["p", "q"], ["hi!!", ""]) == [4.0, 0.0]


def test_a_part_can_itself_be_a_weighted_sum():
    nested = [{"type": "weighted-sum", "parts": PARTS, "weight": 2.0}]
    assert weighted_sum(nested).score(["p"], ["hi!!"]) == [8.0]


@pytest.mark.parametrize("parts, problem", [
    ([{"type": "pythn", "function": f"{TOY}:length"}], "$.reward.parts[0].type: unknown reward 'pythn'; registered:"),
    ([{"function": f"{TOY}:length"}], "$.reward.parts[0].type: required; one of "),
    ([PARTS[0], {"type": "python"}], "$.reward.parts[1].function: required key is missing"),
    ([{"type": "python", "function": f"{TOY}:length", "wieght": 2}], "$.reward.parts[0].wieght: unknown key; did you mean 'weight'?"),
    ([{"type": "python", "function": f"{TOY}:length", "weight": "high"}], "$.reward.parts[0].weight: expected a number, got 'high' (str)"),
    ([PARTS[0], {**PARTS[1], "weight": math.inf}], "$.reward.parts[1].weight: must be a finite number, got inf"),
    ([{"type": "weighted-sum", "parts": [PARTS[0], {**PARTS[1], "weight": "x"}]}], "$.reward.parts[0].parts[1].weight: expected a number"),
    ([], "$.reward.parts: needs at least one part: [[reward.parts]] tables with a type"),
    ({"type": "python"}, "$.reward.parts: expected a list of reward tables ([[reward.parts]] in TOML)"),
])
def test_a_broken_part_is_located_when_the_recipe_is_read(parts, problem):
    with pytest.raises(RecipeError) as caught:
        recipe_with(parts)
    problems = caught.value.problems
    assert len(problems) == 1 and problems[0].startswith(problem), problems
