"""Environment `unit-converter` and its prompt source `conversion-tasks`: a length to convert, a
typed `convert` tool, and an answer.

Each task asks for a length in another unit ("Convert 3.5 km to ft."). The model may call
`convert(value, unit, to)`, whose `unit` and `to` are `Literal` units, so the schema the model is
shown lists them and a call with any other unit is answered with what was wrong, never run. The
turn without a tool call is the answer: reward 1.0 when its last number is the exact conversion
(within the relative `tolerance`), else 0.0.

The optimum is reachable by a script: call `convert` with the task's own value and units, then
answer with the number it returns. That solves every task in two turns, a return of 1.0 per episode.
"""

from __future__ import annotations

import math
import random
import re
from typing import Any, Literal, get_args

import attrs

from rlkit_core import (
    PromptLengthLimit,
    PromptSource,
    RecipeError,
    Reply,
    Reset,
    StandardEpisode,
    Step,
    ToolEnvironment,
    building_at,
    greater_than,
    hookimpl,
    setting,
    tool,
)

Unit = Literal["mm", "cm", "m", "km", "in", "ft", "yd", "mi"]
METRES = {"mm": 0.001, "cm": 0.01, "m": 1.0, "km": 1000.0, "in": 0.0254, "ft": 0.3048, "yd": 0.9144, "mi": 1609.344}
assert set(METRES) == set(get_args(Unit)), "every unit has its length in metres"
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def converted(value: float, unit: str, to: str) -> float:
    """`value` in `unit`, expressed in `to`, to ten significant digits (what the tool says)."""
    return float(f"{value * METRES[unit] / METRES[to]:.10g}")


def last_number(text: str) -> float | None:
    """The last number written in `text` ("1,000" read as 1000), or None."""
    numbers = NUMBER.findall(re.sub(r"(?<=\d),(?=\d{3}\b)", "", text))
    return float(numbers[-1]) if numbers else None


@attrs.frozen
class UnitConverterConfig(StandardEpisode):
    max_turns: int = setting(3, help="model turns in an episode: a call and the answer, and one to spare", validator=greater_than(0))
    tolerance: float = setting(1e-3, help="relative error an answer may have and still count as right", validator=greater_than(0))


@attrs.define
class Task:
    value: float
    unit: str
    to: str
    calls: int = 0  # calls of `convert` that ran


class UnitConverter(ToolEnvironment):
    """Convert a length with the `convert` tool; solved when the answer's last number is the conversion."""

    def __init__(self, config: UnitConverterConfig, context=None):
        self.config = config
        self.where = building_at(context, "environment")

    def start(self, record: dict[str, Any], seed: int) -> Reset:
        value, unit, to = (record.get(name) for name in ("value", "unit", "to"))
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise RecipeError([f"{self.where}: a record's 'value' column is {value!r}, not a finite number; "
                               "use the prompt source conversion-tasks, or give every record value, unit and to"])
        for name, given in (("unit", unit), ("to", to)):
            if given not in METRES:
                raise RecipeError([f"{self.where}: a record's {name!r} column is {given!r}, not one of {', '.join(METRES)}"])
        return Reset([{"role": "user", "content": str(record["prompt"])}], Task(float(value), unit, to))

    @tool
    def convert(self, state: Task, value: float, unit: Unit, to: Unit) -> float:
        """Convert a length from one unit to another and return the converted value.

        Args:
            value: the length to convert
            unit: the unit the length is in
            to: the unit to express it in
        """
        state.calls += 1
        return converted(value, unit, to)

    def answer(self, state: Task, reply: Reply) -> Step:
        said = last_number(reply.text)
        exact = converted(state.value, state.unit, state.to)
        solved = said is not None and math.isclose(said, exact, rel_tol=self.config.tolerance, abs_tol=1e-12)
        return Step(reward=float(solved), done=True, info=self.info(state) | {"solved": float(solved)})

    def info(self, state: Task) -> dict[str, float]:
        return {"solved": 0.0, "converted": float(state.calls > 0)}


@attrs.frozen
class ConversionTasksConfig(PromptLengthLimit):
    size: int = setting(256, help="tasks to generate", validator=greater_than(0))
    seed: int = setting(0, help="seed of the generator (the same seed gives the same tasks)")


def conversion_tasks(size: int, seed: int) -> list[dict[str, Any]]:
    """`size` tasks, each a value of 0.5 to 100 in one unit to express in another."""
    rng = random.Random(f"conversion-tasks/{seed}")
    tasks = []
    for _ in range(size):
        unit, to = rng.sample(sorted(METRES), 2)
        value = round(rng.uniform(0.5, 100), rng.choice((0, 1, 2)))
        tasks.append({"prompt": f"Convert {value:g} {unit} to {to}. Give the answer as a number.", "value": value, "unit": unit, "to": to})
    return tasks


class ConversionTasks(PromptSource):
    def __init__(self, config: ConversionTasksConfig, context=None):
        self.config = config

    def load(self):
        return conversion_tasks(self.config.size, self.config.seed)


@hookimpl
def register_environments(register):
    register("unit-converter", UnitConverter, UnitConverterConfig)


@hookimpl
def register_prompt_sources(register):
    register("conversion-tasks", ConversionTasks, ConversionTasksConfig)
