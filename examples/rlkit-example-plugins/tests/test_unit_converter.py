"""The unit-converter environment: rlkit's environment and prompt-source contracts, then the
tool's schema and checks, the scoring, and the scripted optimum."""

import json

import pytest
from rlkit_example_plugins.unit_converter import UnitConverter, UnitConverterConfig, conversion_tasks, converted

from rlkit_core import Reply
from rlkit_core.testing.contracts import EnvironmentContract, PromptSourceContract, read_reply


class TestUnitConverterContract(EnvironmentContract):
    component = "unit-converter"
    records = conversion_tasks(3, seed=0)


class TestConversionTasksContract(PromptSourceContract):
    component = "conversion-tasks"
    config = {"size": 8, "seed": 1}


def call(name, turn=1, **arguments):
    """The model's turn that calls `name`, read as the core reads it."""
    return read_reply(f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>", turn)


def test_the_schema_lists_the_units():
    [schema] = UnitConverter(UnitConverterConfig()).tools()
    properties = schema["function"]["parameters"]["properties"]
    assert schema["function"]["name"] == "convert" and schema["function"]["parameters"]["required"] == ["value", "unit", "to"]
    assert properties["value"]["type"] == "number"
    assert properties["unit"]["enum"] == properties["to"]["enum"] == ["mm", "cm", "m", "km", "in", "ft", "yd", "mi"]


def test_conversions():
    # 1 mi = 1609.344 m = 5280 ft; 12 in = 0.3048 m = 1 ft
    assert converted(1, "mi", "ft") == 5280.0
    assert converted(12, "in", "ft") == 1.0
    assert converted(3.5, "km", "m") == 3500.0


def test_a_unit_outside_the_literal_is_told_not_run():
    environment = UnitConverter(UnitConverterConfig())
    state = environment.reset({"prompt": "Convert 2 m to cm.", "value": 2, "unit": "m", "to": "cm"}, 0).state
    step = environment.step(state, call("convert", value=2, unit="metre", to="cm"))
    [message] = step.messages
    assert message["role"] == "tool" and message["content"].startswith("Error: argument 'unit' of convert must be one of \"mm\", \"cm\"")
    assert not step.done and step.info["malformed_tool_calls"] == 1.0 and step.info["tool_calls"] == 0.0


@pytest.mark.parametrize("answer, reward", [("It is 200 cm.", 1.0), ("200.1", 1.0), ("201", 0.0), ("I cannot say.", 0.0)])
def test_the_answer_is_scored_by_its_last_number_within_the_tolerance(answer, reward):
    environment = UnitConverter(UnitConverterConfig(tolerance=1e-3))  # 200.1 is 0.05% off, 201 is 0.5% off
    state = environment.reset({"prompt": "Convert 2 m to cm.", "value": 2, "unit": "m", "to": "cm"}, 0).state
    step = environment.step(state, Reply(text=answer, turn=1))
    assert step.done and step.reward == reward and step.info["solved"] == reward


def test_a_script_that_calls_the_tool_and_repeats_its_result_solves_every_task():
    environment = UnitConverter(UnitConverterConfig())
    returns = []
    for seed, task in enumerate(conversion_tasks(64, seed=3)):
        state = environment.reset(task, seed).state
        asked = environment.step(state, call("convert", value=task["value"], unit=task["unit"], to=task["to"]))
        [result] = asked.messages
        final = environment.step(state, Reply(text=f"The answer is {result['content']}.", turn=2))
        assert final.done and final.info["converted"] == 1.0
        returns.append(sum(step.reward or 0.0 for step in (asked, final)))
    assert returns == [1.0] * 64
