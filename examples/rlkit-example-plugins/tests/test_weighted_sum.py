"""The weighted-sum reward: rlkit's reward contract, the sum itself, and located part errors."""

from pathlib import Path

import pytest

from rlkit_core.recipe import structure_table
from rlkit_core.testing import RewardContract
from rlkit_example_plugins.weighted_sum import WeightedSum, WeightedSumConfig

TOY = Path(__file__).with_name("toy_rewards.py")
PARTS = [
    {"type": "python", "function": f"{TOY}:length", "weight": 0.5},
    {"type": "python", "function": f"{TOY}:exclamations"},
]


class TestWeightedSumContract(RewardContract):
    component = "weighted-sum"
    config = {"parts": PARTS}


def weighted_sum(parts):
    config, problems = structure_table({"parts": parts}, WeightedSumConfig, "$.reward")
    assert not problems, problems
    return WeightedSum(config, context=None)


def test_scores_are_the_weighted_sum_of_the_parts():
    # 0.5 · len + 1 · count("!")
    assert weighted_sum(PARTS).score(["p", "q"], ["hi!!", ""]) == [4.0, 0.0]


def test_a_part_can_itself_be_a_weighted_sum():
    nested = [{"type": "weighted-sum", "parts": PARTS, "weight": 2.0}]
    assert weighted_sum(nested).score(["p"], ["hi!!"]) == [8.0]


@pytest.mark.parametrize("part, problem", [
    ({"type": "pythn", "function": f"{TOY}:length"}, "$.reward.parts: [0].type: unknown reward 'pythn'; registered:"),
    ({"function": f"{TOY}:length"}, "$.reward.parts: [0].type: required: the name of a registered reward"),
    ({"type": "python"}, "$.reward.parts: [0].function: required key is missing"),
    ({"type": "python", "function": f"{TOY}:length", "wieght": 2}, "$.reward.parts: [0].wieght: unknown key"),
    ({"type": "python", "function": f"{TOY}:length", "weight": "high"}, "$.reward.parts: [0].weight: expected a finite number, got 'high'"),
])
def test_a_broken_part_is_located_when_the_recipe_is_read(part, problem):
    _, problems = structure_table({"parts": [part]}, WeightedSumConfig, "$.reward")
    assert len(problems) == 1 and problems[0].startswith(problem), problems


def test_no_parts_is_an_error():
    _, problems = structure_table({"parts": []}, WeightedSumConfig, "$.reward")
    assert problems == ["$.reward.parts: needs at least one part: [[reward.parts]] tables with a type"]
