"""Environments: `counter` and `calculator`, two small tool-use tasks with their prompt sources
(`counter-tasks`, `word-problems`), generated offline from a seed, so a multi-turn recipe runs and
can be tested without any data or service.

Both score the model's answer, the turn without a tool call: 1.0 when it is right, else 0.0.
"""

from __future__ import annotations

import ast
import random
import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any

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


def column(record: dict[str, Any], name: str, where: str) -> Any:
    """A record's column the environment reads, or a located error naming the columns there are."""
    if name not in record:
        raise RecipeError([f"{where}: the data has no column {name!r} (columns: {', '.join(record) or 'none'}); "
                           "give every record one, or use the prompt source this environment comes with"])
    return record[name]


def opening(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The first messages of an episode: the record's conversation, else its prompt as the user's message."""
    if record.get("prompt") is None and record.get("messages"):
        return [dict(message) for message in record["messages"]]
    return [{"role": "user", "content": record["prompt"]}]


def last_number(text: str) -> Fraction | None:
    """The last number written in `text` ("1,000" and "3.5" included), or None."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", re.sub(r"(?<=\d),(?=\d{3}\b)", "", text))
    return Fraction(numbers[-1]) if numbers else None


# --- counter -----------------------------------------------------------------------------------


@attrs.frozen
class CounterConfig(StandardEpisode):
    pass


@attrs.define
class CounterState:
    steps: list[int]  # the additions the prompt asks for, in order
    total: int = 0
    added: list[int] = attrs.field(factory=list)


class Counter(ToolEnvironment):
    """Add the asked numbers with the `add` tool, one call each, then say the total. Solved when
    the counter got exactly the asked additions in order and the answer is its total."""

    def __init__(self, config: CounterConfig, context=None):
        self.config = config
        self.where = building_at(context, "environment")

    def start(self, record, seed):
        steps = column(record, "steps", self.where)
        if not (isinstance(steps, list) and steps and all(isinstance(s, int) and not isinstance(s, bool) for s in steps)):
            raise RecipeError([f"{self.where}: column 'steps' must be a non-empty list of integers, got {steps!r}"])
        return Reset(opening(record), CounterState(list(steps)))

    @tool
    def add(self, state: CounterState, amount: int) -> int:
        """Add a whole number to the counter and return the counter's new total.

        Args:
            amount: the number to add
        """
        state.added.append(amount)
        state.total += amount
        return state.total

    @tool
    def read(self, state: CounterState) -> int:
        """Return the counter's total."""
        return state.total

    def answer(self, state: CounterState, reply: Reply) -> Step:
        solved = state.added == state.steps and last_number(reply.text) == state.total
        return Step(reward=float(solved), done=True, info={"solved": float(solved)})

    def info(self, state):
        return {"solved": 0.0}


@attrs.frozen
class CounterTasksConfig(PromptLengthLimit):
    size: int = setting(256, help="tasks to generate", validator=greater_than(0))
    seed: int = setting(0, help="seed of the generator (the same seed gives the same tasks)")


def counter_tasks(size: int, seed: int) -> list[dict[str, Any]]:
    """`size` tasks of one to three additions of 1 to 9."""
    rng = random.Random(seed)
    tasks = []
    for _ in range(size):
        steps = [rng.randint(1, 9) for _ in range(rng.randint(1, 3))]
        asked = ", then ".join(f"add {step}" for step in steps)
        tasks.append({"prompt": f"Use the counter: {asked}, then say the total.", "steps": steps})
    return tasks


class CounterTasks(PromptSource):
    def __init__(self, config: CounterTasksConfig, context=None):
        self.config = config

    def load(self):
        return counter_tasks(self.config.size, self.config.seed)


# --- calculator --------------------------------------------------------------------------------

MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 10**12  # every number and partial result; far beyond a word problem, far below a slow one
_OPERATORS: dict[type[ast.operator], Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b}


def evaluate(expression: str) -> Fraction:
    """The exact value of numbers, + - * / and parentheses, read with `ast` (never run as code);
    anything else raises ValueError (ZeroDivisionError for a division by zero)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters; split it into steps")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression: {exc.msg}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = Fraction(str(node.value))
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _value(node.operand)
        value = -value if isinstance(node.op, ast.USub) else value
    elif isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ZeroDivisionError("division by zero")
        value = _OPERATORS[type(node.op)](left, right)
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        raise ValueError("powers (**) are not supported; write the multiplication out")
    elif isinstance(node, (ast.Name, ast.Call, ast.Attribute)):
        kind = {ast.Name: "names", ast.Call: "function calls", ast.Attribute: "attributes"}[type(node)]
        raise ValueError(f"{kind} are not allowed ({ast.unparse(node)}); use numbers, + - * / and parentheses")
    else:
        raise ValueError(f"{ast.unparse(node)!r} is not allowed; use numbers, + - * / and parentheses")
    if abs(value) > MAX_MAGNITUDE:
        raise ValueError(f"a number is larger than {MAX_MAGNITUDE:,} in magnitude")
    return value


def rendered(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.10g}"


@attrs.frozen
class CalculatorConfig(StandardEpisode):
    pass


@attrs.define
class CalculatorState:
    answer: Fraction


class Calculator(ToolEnvironment):
    """A word problem, a `calculate` tool, and an answer: solved when the answer's last number is the record's `answer`."""

    def __init__(self, config: CalculatorConfig, context=None):
        self.config = config
        self.where = building_at(context, "environment")

    def start(self, record, seed):
        answer = column(record, "answer", self.where)
        try:
            exact = Fraction(str(answer)) if isinstance(answer, (int, float, str)) and not isinstance(answer, bool) else None
        except ValueError:
            exact = None
        if exact is None:
            raise RecipeError([f"{self.where}: column 'answer' must be a number, got {answer!r}"])
        return Reset(opening(record), CalculatorState(exact))

    @tool
    def calculate(self, state: CalculatorState, expression: str) -> str:
        """Evaluate an arithmetic expression and return its value.

        Args:
            expression: numbers, + - * / and parentheses, e.g. "3 * 7 - 5"
        """
        return rendered(evaluate(expression))

    def answer(self, state: CalculatorState, reply: Reply) -> Step:
        solved = last_number(reply.text) == state.answer
        return Step(reward=float(solved), done=True, info={"solved": float(solved)})

    def info(self, state):
        return {"solved": 0.0}


@attrs.frozen
class WordProblemsConfig(PromptLengthLimit):
    size: int = setting(256, help="problems to generate", validator=greater_than(0))
    seed: int = setting(0, help="seed of the generator (the same seed gives the same problems)")


PEOPLE = (("Ana", "she"), ("Ben", "he"), ("Chloe", "she"), ("David", "he"), ("Elena", "she"), ("Farid", "he"), ("Grace", "she"),
          ("Hugo", "he"), ("Ines", "she"), ("Jonas", "he"))
ITEMS = ("pens", "apples", "books", "marbles", "stickers", "cards", "shells", "cookies")


def _boxes(rng, name, pronoun, item):
    a, b = rng.randint(2, 9), rng.randint(2, 12)
    c = rng.randint(1, a * b - 1)
    return (f"{name} has {a} boxes of {b} {item}. {pronoun.capitalize()} gives away {c} {item}. "
            f"How many {item} does {pronoun} have left?", a * b - c)


def _packs(rng, name, pronoun, item):
    a, b, c = rng.randint(2, 9), rng.randint(2, 12), rng.randint(1, 20)
    return (f"{name} has {c} {item}. {pronoun.capitalize()} buys {a} packs of {b} {item}. How many {item} does {pronoun} have now?",
            a * b + c)


def _shares(rng, name, pronoun, item):
    a, b = rng.randint(2, 9), rng.randint(2, 12)
    return f"{name} shares {a * b} {item} equally among {a} friends. How many {item} does each friend get?", b


def _had_bought_lost(rng, name, pronoun, item):
    a, b = rng.randint(5, 40), rng.randint(1, 30)
    c = rng.randint(1, a + b)
    return f"{name} had {a} {item}, bought {b} more and then lost {c}. How many {item} does {pronoun} have now?", a + b - c


def _shelf(rng, name, pronoun, item):
    a, b, c = rng.randint(2, 6), rng.randint(3, 10), rng.randint(1, 15)
    d = rng.randint(1, a * b + c)
    return (f"A shelf holds {a} rows of {b} {item}. {name} puts {c} more {item} on it and takes {d} away. "
            f"How many {item} are on the shelf now?", a * b + c - d)


def _change(rng, name, pronoun, item):
    a, b = rng.randint(2, 9), rng.randint(2, 15)
    paid = a * b + rng.randint(0, 50)
    return (f"{name} buys {a} {item} at {b} coins each and pays with {paid} coins. How many coins does {pronoun} get back?",
            paid - a * b)


TEMPLATES = (_boxes, _packs, _shares, _had_bought_lost, _shelf, _change)


def word_problems(size: int, seed: int) -> list[dict[str, Any]]:
    """`size` problems drawn from the templates, each with its whole-number `answer`."""
    rng = random.Random(seed)
    problems = []
    for _ in range(size):
        name, pronoun = rng.choice(PEOPLE)
        text, answer = rng.choice(TEMPLATES)(rng, name, pronoun, rng.choice(ITEMS))
        problems.append({"prompt": f"{text} Give the answer as a number.", "answer": answer})
    return problems


class WordProblems(PromptSource):
    def __init__(self, config: WordProblemsConfig, context=None):
        self.config = config

    def load(self):
        return word_problems(self.config.size, self.config.seed)


@hookimpl
def register_environments(register):
    register("counter", Counter, CounterConfig)
    register("calculator", Calculator, CalculatorConfig)


@hookimpl
def register_prompt_sources(register):
    register("counter-tasks", CounterTasks, CounterTasksConfig)
    register("word-problems", WordProblems, WordProblemsConfig)
