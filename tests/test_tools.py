"""Tools as typed methods: the schema a model is shown, the checks on its calls, and the two built-in
tool environments (`counter`, `calculator`) driven turn by turn with hand-written replies."""

from __future__ import annotations

import re
import time
from fractions import Fraction
from typing import Literal

import attrs
import pytest
from rlkit_plugins import environments

from rlkit_core import (
    Environment,
    RecipeError,
    Reply,
    Reset,
    StandardEpisode,
    Step,
    ToolCall,
    ToolEnvironment,
    tool,
    tool_schema,
)
from rlkit_core.recipe.registry import contract_problems
from rlkit_core.tools import ToolEpisode

# --- schemas -----------------------------------------------------------------------------------


class Library(ToolEnvironment):
    @tool
    def search(self, state, query: str, limit: int = 5, mode: Literal["fast", "exact"] = "fast",
               weights: list[float] | None = None, strict: bool = False) -> list[str]:
        """Find books whose title matches a query,
        best matches first.

        Searching is cheap; call it as often as needed.

        Args:
            query: words of the title
            limit: the most books to return; more than 20
                are cut to 20
            mode (str): how closely titles must match

        Returns:
            limit: not an argument, a section that is not Args
        """
        return []

    @tool
    def borrow(self, state, book_id: int) -> str:
        """Borrow a book."""
        return "ok"

    def start(self, record, seed):
        return Reset([])

    def answer(self, state, reply):
        return Step(done=True)


def test_the_schema_comes_from_the_hints_and_the_docstring():
    assert tool_schema(Library.search) == {"type": "function", "function": {
        "name": "search",
        "description": "Find books whose title matches a query, best matches first.",
        "parameters": {"type": "object", "required": ["query"], "properties": {
            "query": {"type": "string", "description": "words of the title"},
            "limit": {"type": "integer", "description": "the most books to return; more than 20 are cut to 20"},
            "mode": {"type": "string", "enum": ["fast", "exact"], "description": "how closely titles must match"},
            "weights": {"type": ["array", "null"], "items": {"type": "number"}},
            "strict": {"type": "boolean"},
        }}}}


def test_tools_are_sorted_by_name_and_a_caller_cannot_change_them():
    env = Library()
    names = [schema["function"]["name"] for schema in env.tools()]
    assert names == ["borrow", "search"]
    env.tools()[0]["function"]["name"] = "changed"
    assert [schema["function"]["name"] for schema in Library().tools()] == ["borrow", "search"]
    assert tool_schema(env.search) == tool_schema(Library.search)  # a bound method describes the same tool
    assert Environment.tools(env) == []  # the base class has none; ToolEnvironment derives them


def test_a_subclass_keeps_its_parents_tools_and_may_withdraw_one():
    class MoreLibrary(Library):
        @tool
        def renew(self, state, book_id: int, weeks: int = 2) -> str:
            """Renew a borrowed book."""
            return "renewed"

        def borrow(self, state, book_id: int) -> str:  # no longer a tool
            return "no"

    assert [s["function"]["name"] for s in MoreLibrary().tools()] == ["renew", "search"]
    assert [s["function"]["name"] for s in Library().tools()] == ["borrow", "search"]


def no_hint(self, state, shelf): ...
def a_dict(self, state, shelf: dict): ...
def a_union(self, state, shelf: int | str): ...
def a_bare_list(self, state, shelf: list): ...
def a_mixed_literal(self, state, shelf: Literal[1, "a"]): ...
def many(self, state, *shelves: int): ...
def stateless(self, shelf: int): ...
def unresolved(self, state, shelf: Unknown): ...  # noqa: F821 (the point: a name the module lacks)
def step(self, state, shelf: int): ...


def misdocumented(self, state, shelf: int):
    """Look at a shelf.

    Args:
        row: a row
    """


@pytest.mark.parametrize("function, complaint", [
    (no_hint, "parameter 'shelf' has no type hint; annotate it"),
    (a_dict, "parameter 'shelf' is annotated dict, which a tool schema cannot express"),
    (a_union, "parameter 'shelf' is annotated int | str, which"),
    (a_bare_list, "parameter 'shelf' is annotated list, which"),
    (a_mixed_literal, "parameter 'shelf' is annotated Literal[1, 'a'], which"),
    (many, "parameter 'shelves' collects arguments"),
    (stateless, "must take (self, state, ...)"),
    (unresolved, "cannot be resolved"),
    (misdocumented, "Args describe 'row', which it does not take"),
    (step, "may not be named 'step'"),
], ids=lambda value: getattr(value, "__name__", ""))
def test_a_tool_the_schema_cannot_describe_is_refused_by_name(function, complaint):
    for make in (tool, tool_schema):
        with pytest.raises(TypeError) as raised:
            make(function)
        assert f"tool {function.__name__}" in str(raised.value) and complaint in str(raised.value), str(raised.value)


def test_the_unsupported_hint_error_names_the_method_parameter_and_fix():
    with pytest.raises(TypeError, match=r"tool .*Shop\.buy: parameter 'basket' is annotated set\[str\].*use str, int, float, bool"):
        class Shop(ToolEnvironment):
            @tool
            def buy(self, state, item: str, basket: set[str]) -> str:
                return item


# --- dispatch ----------------------------------------------------------------------------------


@attrs.define
class Account:
    balance: int = 0
    seen: list = attrs.field(factory=list)


class Bank(ToolEnvironment):
    @tool
    def deposit(self, state: Account, amount: int, note: str = "") -> int:
        """Put money in."""
        state.balance += amount
        state.seen.append(("deposit", amount, note))
        return state.balance

    @tool
    def scale(self, state: Account, factor: float) -> float:
        """Multiply the balance."""
        state.seen.append(("scale", factor))
        return state.balance * factor

    @tool
    def statement(self, state: Account) -> dict:
        """The balance as a record."""
        return {"balance": state.balance, "entries": len(state.seen)}

    @tool
    def jam(self, state: Account) -> str:
        """Always fails."""
        raise RuntimeError("the vault is jammed")

    def start(self, record, seed):
        return Reset([{"role": "user", "content": record["prompt"]}], Account())

    def answer(self, state, reply):
        return Step(reward=float(state.balance), done=True, info={"balance": float(state.balance)})


def turn(*calls, text="", parse_error=None, number=1) -> Reply:
    return Reply(text=text, turn=number, tool_calls=tuple(ToolCall(name, arguments) for name, arguments in calls), parse_error=parse_error)


@pytest.fixture
def bank():
    env = Bank()
    return env, env.reset({"prompt": "save"}, seed=0).state


def test_a_good_call_runs_the_tool_with_the_episodes_state(bank):
    env, episode = bank
    step = env.step(episode, turn(("deposit", {"amount": 5})))
    assert step.messages == [{"role": "tool", "name": "deposit", "content": "5"}]
    assert (step.done, step.reward, step.status) == (False, None, "ok")
    assert step.info == {"tool_calls": 1.0, "malformed_tool_calls": 0.0, "tool_errors": 0.0}
    assert episode.state == Account(5, [("deposit", 5, "")])


def test_calls_of_one_turn_run_in_order_and_results_render_as_text_or_json(bank):
    env, episode = bank
    step = env.step(episode, turn(("deposit", {"amount": 2, "note": "rent"}), ("scale", {"factor": 1.5}), ("statement", {})))
    assert [m["content"] for m in step.messages] == ["2", "3.0", '{"balance": 2, "entries": 2}']
    assert [m["name"] for m in step.messages] == ["deposit", "scale", "statement"]
    assert step.info["tool_calls"] == 3.0


def test_an_integer_is_passed_where_a_float_is_asked_and_nothing_else_is_converted(bank):
    env, episode = bank
    env.step(episode, turn(("scale", {"factor": 2})))
    assert episode.state.seen == [("scale", 2.0)] and isinstance(episode.state.seen[0][1], float)
    for bad in ("2", True, None, [2]):
        step = env.step(episode, turn(("scale", {"factor": bad})))
        assert "must be a number" in step.messages[0]["content"], bad
    assert episode.state.seen == [("scale", 2.0)]  # no bad call reached the tool


@pytest.mark.parametrize("arguments, complaint", [
    ({"amount": "5"}, "argument 'amount' of deposit must be an integer, got \"5\""),
    ({"amount": 2.5}, "argument 'amount' of deposit must be an integer, got 2.5"),
    ({"amount": True}, "argument 'amount' of deposit must be an integer, got true"),
    ({"amount": 1, "note": 3}, "argument 'note' of deposit must be a string, got 3"),
    ({}, "deposit is missing the argument 'amount'; call it as deposit(amount, note)"),
    ({"amount": 1, "currency": "EUR"}, "deposit takes no argument 'currency'; call it as deposit(amount, note)"),
])
def test_arguments_that_do_not_fit_the_signature_are_told_and_counted(bank, arguments, complaint):
    env, episode = bank
    step = env.step(episode, turn(("deposit", arguments)))
    assert step.messages == [{"role": "tool", "name": "deposit", "content": f"Error: {complaint}."}]
    assert step.info == {"tool_calls": 0.0, "malformed_tool_calls": 1.0, "tool_errors": 0.0}
    assert episode.state == Account()


def test_a_literal_or_list_argument_is_checked_by_value_and_type():
    env = Library()
    episode = env.reset({}, 0).state
    assert env.step(episode, turn(("search", {"query": "x", "mode": "exact", "weights": [1, 0.5]}))).messages[0]["content"] == "[]"
    assert env.step(episode, turn(("search", {"query": "x", "weights": None}))).messages[0]["content"] == "[]"
    wrong = env.step(episode, turn(("search", {"query": "x", "mode": "slow"}), ("search", {"query": "x", "weights": [1, "a"]})))
    assert [m["content"] for m in wrong.messages] == [
        "Error: argument 'mode' of search must be one of \"fast\", \"exact\", got \"slow\".",
        "Error: argument 'weights' of search must be an array of numbers or null, got [1, \"a\"]."]
    assert wrong.info["malformed_tool_calls"] == 2.0 and wrong.info["tool_calls"] == 2.0


def test_an_unknown_tool_is_told_with_the_tools_there_are(bank):
    env, episode = bank
    step = env.step(episode, turn(("withdraw", {"amount": 5})))
    assert step.messages == [{"role": "tool", "name": "withdraw",
                              "content": "Error: there is no tool named 'withdraw'; the tools are: deposit, jam, scale, statement."}]
    assert step.info["malformed_tool_calls"] == 1.0 and step.info["tool_calls"] == 0.0


def test_a_tool_that_raises_is_told_and_counted_and_the_episode_goes_on(bank):
    env, episode = bank
    step = env.step(episode, turn(("jam", {}), ("deposit", {"amount": 1})))
    assert [m["content"] for m in step.messages] == ["Error: RuntimeError: the vault is jammed", "1"]
    assert step.info == {"tool_calls": 2.0, "malformed_tool_calls": 0.0, "tool_errors": 1.0}
    assert (step.done, step.status) == (False, "ok")


def test_a_tool_that_finds_the_recipe_wrong_raises_its_recipe_error(bank):
    """Bad input is bad input wherever it surfaces: not told to the model as a tool's failure."""

    class Ledger(Bank):
        @tool
        def lookup(self, state: Account, account: str) -> str:
            """Read an account from the record's ledger."""
            raise RecipeError(["$.data: the record has no 'ledger' column; add one"])

    env = Ledger()
    with pytest.raises(RecipeError, match="no 'ledger' column"):
        env.step(env.reset({"prompt": "save"}, seed=0).state, turn(("lookup", {"account": "a"})))


def test_an_unreadable_call_is_told_and_no_tool_runs(bank):
    env, episode = bank
    step = env.step(episode, turn(("deposit", {"amount": 5}), parse_error="expected ',' at char 17"))
    assert len(step.messages) == 1 and step.messages[0]["role"] == "tool"
    assert "could not be read: expected ',' at char 17" in step.messages[0]["content"]
    assert step.info == {"tool_calls": 0.0, "malformed_tool_calls": 1.0, "tool_errors": 0.0}
    assert episode.state == Account()


def test_the_answer_ends_the_episode_with_its_info_and_the_counts(bank):
    env, episode = bank
    env.step(episode, turn(("deposit", {"amount": 4})))
    env.step(episode, turn(("nope", {}), number=2))
    env.step(episode, turn(("jam", {}), number=3))
    final = env.step(episode, turn(text="I saved 4.", number=4))
    assert (final.done, final.reward, final.messages) == (True, 4.0, [])
    assert final.info == {"tool_calls": 2.0, "malformed_tool_calls": 1.0, "tool_errors": 1.0, "balance": 4.0}


def test_episodes_of_one_environment_keep_their_own_state_and_counts():
    env = Bank()
    first, second = env.reset({"prompt": "a"}, 0).state, env.reset({"prompt": "b"}, 1).state
    assert isinstance(first, ToolEpisode) and first is not second
    env.step(first, turn(("deposit", {"amount": 3})))
    env.step(second, turn(("deposit", {"amount": "x"})))
    env.step(first, turn(("deposit", {"amount": 4})))
    assert (first.state.balance, second.state.balance) == (7, 0)
    assert (first.counts(), second.counts()) == (
        {"tool_calls": 2.0, "malformed_tool_calls": 0.0, "tool_errors": 0.0},
        {"tool_calls": 0.0, "malformed_tool_calls": 1.0, "tool_errors": 0.0})


def test_a_state_that_reset_did_not_make_is_refused_by_name():
    with pytest.raises(TypeError, match="implements start"):
        Bank().step(Account(), turn(("deposit", {"amount": 1})))


# --- the built-in environments -----------------------------------------------------------------


def play(env: ToolEnvironment, record: dict, turns: list[Reply]) -> list[Step]:
    episode = env.reset(record, seed=0).state
    return [env.step(episode, reply) for reply in turns]


COUNTER_TASK = {"prompt": "Use the counter: add 3, then add 4, then say the total.", "steps": [3, 4]}


def test_the_counters_optimal_path_is_one_call_per_addition_then_the_total():
    steps = play(environments.Counter(environments.CounterConfig()), COUNTER_TASK, [
        turn(("add", {"amount": 3})), turn(("add", {"amount": 4}), number=2), turn(text="The total is 7.", number=3)])
    assert [m["content"] for s in steps[:2] for m in s.messages] == ["3", "7"]
    assert [s.reward for s in steps] == [None, None, 1.0] and steps[-1].done
    assert steps[-1].info == {"solved": 1.0, "tool_calls": 2.0, "malformed_tool_calls": 0.0, "tool_errors": 0.0}


@pytest.mark.parametrize("turns", [
    [turn(("add", {"amount": 3}), ("add", {"amount": 4})), turn(text="The total is 8.")],  # wrong total
    [turn(text="7")],  # right number, no additions made
    [turn(("add", {"amount": 4}), ("add", {"amount": 3})), turn(text="7")],  # the asked additions out of order
    [turn(("add", {"amount": 7})), turn(text="7")],  # one addition of the sum
    [turn(("add", {"amount": 3}), ("add", {"amount": 4})), turn(text="I am done.")],  # no number
])
def test_a_wrong_counter_answer_scores_zero(turns):
    final = play(environments.Counter(environments.CounterConfig()), COUNTER_TASK, turns)[-1]
    assert (final.reward, final.done, final.info["solved"]) == (0.0, True, 0.0)


def test_a_counter_episode_cut_off_before_its_answer_reports_it_unsolved():
    step = play(environments.Counter(environments.CounterConfig()), COUNTER_TASK, [turn(("read", {}))])[-1]
    assert step.messages[0]["content"] == "0" and not step.done
    assert step.info == {"tool_calls": 1.0, "malformed_tool_calls": 0.0, "tool_errors": 0.0, "solved": 0.0}


def test_counter_tasks_are_generated_from_their_seed_and_say_what_steps_holds():
    tasks = environments.counter_tasks(50, seed=3)
    assert tasks == environments.counter_tasks(50, seed=3) != environments.counter_tasks(50, seed=4)
    for task in tasks:
        assert [int(n) for n in re.findall(r"add (\d)", task["prompt"])] == task["steps"] and 1 <= len(task["steps"]) <= 3
    source = environments.CounterTasks(environments.CounterTasksConfig(size=7, seed=3))
    assert source.load() == tasks[:7]


def test_the_calculators_optimal_path_reaches_the_answer():
    record = {"prompt": "Ana has 3 boxes of 7 pens. She gives away 5 pens. How many pens does she have left?", "answer": 16}
    env = environments.Calculator(environments.CalculatorConfig())
    steps = play(env, record, [turn(("calculate", {"expression": "3 * 7 - 5"})), turn(text="She has 16 pens left.", number=2)])
    assert steps[0].messages == [{"role": "tool", "name": "calculate", "content": "16"}]
    assert (steps[-1].reward, steps[-1].info["solved"], steps[-1].info["tool_calls"]) == (1.0, 1.0, 1.0)
    wrong = play(env, record, [turn(text="16 pens, minus 5 is 11.")])[-1]
    assert (wrong.reward, wrong.info["solved"]) == (0.0, 0.0)


def test_a_calculator_refusal_reaches_the_model_as_a_tool_error():
    env = environments.Calculator(environments.CalculatorConfig())
    step = play(env, {"prompt": "?", "answer": 1}, [turn(("calculate", {"expression": "__import__('os').getcwd()"}))])[-1]
    assert step.messages[0]["content"].startswith("Error: ValueError: function calls are not allowed")
    assert step.info["tool_errors"] == 1.0 and not step.done


@pytest.mark.parametrize("expression, value", [("(2 + 3) * 4", 20), ("-3 + 10 / 4", Fraction(-1, 2)), ("7 / 2", Fraction(7, 2)),
                                               ("((((1))))", 1), ("2.5 * 4", 10), ("+8 - -2", 10)])
def test_the_calculator_does_exact_arithmetic(expression, value):
    assert environments.evaluate(expression) == value


def test_results_are_written_as_the_model_would_read_them():
    assert [environments.rendered(environments.evaluate(e)) for e in ("6 / 3", "7 / 2", "1 / 3", "-4")] == ["2", "3.5", "0.3333333333", "-4"]


@pytest.mark.parametrize("expression, complaint", [
    ("x + 1", "names are not allowed"),
    ("abs(-3)", "function calls are not allowed"),
    ("(1).real", "attributes are not allowed"),
    ("9 ** 999999999", "powers (**) are not supported"),
    ("999999 * 999999 * 999999", "larger than"),
    ("10000000000000 + 1", "larger than"),
    ("'3' + '4'", "is not allowed"),
    ("True + 1", "is not allowed"),
    ("[1, 2][0]", "is not allowed"),
    ("lambda: 1", "is not allowed"),
    ("7 // 2", "is not allowed"),
    ("1 +", "not an arithmetic expression"),
    ("1" + " + 1" * 100, "longer than"),
])
def test_the_calculator_refuses_everything_but_arithmetic(expression, complaint):
    began = time.perf_counter()
    with pytest.raises(ValueError, match=re.escape(complaint)):
        environments.evaluate(expression)
    assert time.perf_counter() - began < 1.0  # refused, not computed


def test_division_by_zero_is_its_own_error():
    with pytest.raises(ZeroDivisionError):
        environments.evaluate("4 / (2 - 2)")


# each template's arithmetic, from the numbers its text gives in order
ARITHMETIC = {"_boxes": lambda a, b, c: a * b - c, "_packs": lambda c, a, b: a * b + c, "_shares": lambda total, a: total // a,
              "_had_bought_lost": lambda a, b, c: a + b - c, "_shelf": lambda a, b, c, d: a * b + c - d,
              "_change": lambda a, b, paid: paid - a * b}


@pytest.mark.parametrize("template", environments.TEMPLATES, ids=lambda t: t.__name__)
def test_every_word_problem_template_states_the_answer_it_records(template):
    import random

    rng = random.Random(0)
    for _ in range(200):
        text, answer = template(rng, "Ana", "she", "pens")
        numbers = [int(n) for n in re.findall(r"\d+", text)]
        assert ARITHMETIC[template.__name__](*numbers) == answer >= 0, text
        if template.__name__ == "_shares":
            assert numbers[0] % numbers[1] == 0, text


def test_word_problems_come_from_their_seed_with_an_answer_column():
    problems = environments.word_problems(100, seed=1)
    assert problems == environments.word_problems(100, seed=1) != environments.word_problems(100, seed=2)
    assert all(set(p) == {"prompt", "answer"} and isinstance(p["answer"], int) and p["prompt"].endswith("as a number.") for p in problems)
    assert len({p["prompt"].split(" ")[1] for p in problems}) > 3  # the templates and names vary
    assert environments.WordProblems(environments.WordProblemsConfig(size=5, seed=1)).load() == problems[:5]


@pytest.mark.parametrize("env, record, column", [
    (environments.Counter(environments.CounterConfig()), {"prompt": "add"}, "steps"),
    (environments.Calculator(environments.CalculatorConfig()), {"prompt": "how many?", "solution": 3}, "answer"),
])
def test_a_record_without_the_column_the_environment_reads_is_a_located_error(env, record, column):
    with pytest.raises(RecipeError) as raised:
        env.reset(record, 0)
    assert raised.value.problems[0].startswith(f"$.environment: the data has no column {column!r} (columns: prompt")


def test_a_column_of_the_wrong_kind_is_a_located_error():
    with pytest.raises(RecipeError, match=r"\$\.environment: column 'steps' must be a non-empty list of integers"):
        environments.Counter(environments.CounterConfig()).reset({"prompt": "add", "steps": "3, 4"}, 0)
    with pytest.raises(RecipeError, match=r"\$\.environment: column 'answer' must be a number"):
        environments.Calculator(environments.CalculatorConfig()).reset({"prompt": "?", "answer": "sixteen"}, 0)


# --- settings and registration -----------------------------------------------------------------


def test_standard_episode_settings_are_what_the_runner_reads():
    config = environments.CounterConfig(max_turns=6, chat_format="plain")
    assert (config.max_turns, config.max_episode_tokens, config.step_timeout_s, config.episode_timeout_s, config.call_threads,
            config.chat_format) == (6, 256, 10.0, 60.0, 64, "plain")
    assert StandardEpisode().max_turns == 4
    for bad in ({"max_turns": 0}, {"max_episode_tokens": -1}, {"step_timeout_s": -0.5}, {"episode_timeout_s": -1.0}):
        with pytest.raises(ValueError, match="must be"):
            StandardEpisode(**bad)


def registered(hook) -> dict[str, tuple]:
    found = {}
    hook(lambda name, factory, config: found.__setitem__(name, (factory, config)))
    return found


def test_the_plugin_registers_both_environments_and_their_prompt_sources_within_the_contract():
    envs, sources = registered(environments.register_environments), registered(environments.register_prompt_sources)
    assert set(envs) == {"counter", "calculator"} and set(sources) == {"counter-tasks", "word-problems"}
    for name, (factory, config) in envs.items():
        assert contract_problems("environment", factory, config) == [], name
        assert issubclass(config, StandardEpisode)
    for name, (factory, config) in sources.items():
        assert contract_problems("prompt_source", factory, config) == [], name
        assert {"prompt"} <= set(factory(config()).load()[0])
