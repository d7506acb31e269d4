"""Environments whose tools are typed methods: the schema the model is shown and the checks on its
calls both come from the method's signature, so the two cannot drift apart.

A tool is a method marked `@tool` whose parameters after `self` are the episode's state (named
`state`, or `_state` when the tool does not read it) and then the tool's own arguments, each with
a type hint; its docstring's first paragraph describes it and a Google-style `Args:` section
describes each argument:

    class Counter(ToolEnvironment):
        @tool
        def add(self, state, amount: int) -> int:
            \"\"\"Add to the counter and return the new total.

            Args:
                amount: how much to add
            \"\"\"

The state is the one `start` returned for this episode (one instance serves many episodes at
once, so nothing of an episode may live on `self`). A bad call never raises: the model is told
what was wrong in a tool message, and the episode goes on.
"""

from __future__ import annotations

import copy
import inspect
import json
import re
import types
import typing
from abc import abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import attrs

from rlkit_core.errors import RecipeError
from rlkit_core.interfaces import Environment
from rlkit_core.messages import Reply, Reset, Step, ToolCall

__all__ = ["ToolEnvironment", "ToolEpisode", "tool", "tool_schema"]

_MARK = "__rlkit_tool__"
_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean"}
_SUPPORTED = "str, int, float, bool, list[...] of them, Literal[...] or any of these | None"
_SECTION = re.compile(r"^(Args|Arguments|Parameters|Returns|Return|Yields|Raises|Examples?|Notes?|See Also|Warnings?):\s*$")
_ARG_LINE = re.compile(r"^\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
# what a tool may not be called: the methods the runner and ToolEnvironment call themselves
_RESERVED = frozenset({"reset", "step", "start", "answer", "tools", "info", "check", "imports", "probe", "describe"})


@attrs.frozen
class _Parameter:
    name: str
    hint: Any
    required: bool


@attrs.frozen
class _Spec:
    """What `@tool` works out once, when the class body runs: the schema and how to check a call."""

    name: str
    schema: dict[str, Any]
    parameters: tuple[_Parameter, ...]


def tool(function: Callable) -> Callable:
    """Mark a method of a `ToolEnvironment` as a tool the model may call (`def name(self, state, ...)`).
    Its schema is worked out here, so a hint no schema can express fails when the class is defined."""
    setattr(function, _MARK, _spec(function))
    return function


def tool_schema(function: Callable) -> dict[str, Any]:
    """The JSON schema of a tool method (`{"type": "function", "function": {...}}`): from the
    parameters after `self` and `state`, their hints and the docstring. A parameter without a
    hint, or with one a schema cannot express, raises TypeError naming the method and the parameter."""
    function = getattr(function, "__func__", function)  # a bound method: the function it binds
    spec = getattr(function, _MARK, None) or _spec(function)
    return copy.deepcopy(spec.schema)


def _spec(function: Callable) -> _Spec:
    where = getattr(function, "__qualname__", repr(function))
    if not inspect.isfunction(function):
        raise TypeError(f"@tool marks a method defined with def, not {function!r}")
    name = function.__name__
    if name in _RESERVED or name.startswith("_"):
        raise TypeError(f"tool {where}: a tool may not be named {name!r} (the environment's own methods, and private names, are "
                        "not tools); rename the method")
    parameters = list(inspect.signature(function).parameters.values())
    # the name is the rule's one check: a tool that forgot the state would otherwise take its first argument for it
    if (len(parameters) < 2 or any(p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters[:2])
            or parameters[1].name not in ("state", "_state")):
        raise TypeError(f"tool {where} must take (self, state, ...): the episode's state comes before the tool's arguments "
                        "(`_state` when the tool does not read it)")
    own = parameters[2:]
    # only the tool's own arguments' hints: the state's may name a class defined after this one
    wanted = {p.name: function.__annotations__[p.name] for p in own if p.name in function.__annotations__}
    try:
        hints = typing.get_type_hints(types.SimpleNamespace(__annotations__=wanted), globalns=function.__globals__)
    except Exception as exc:  # a hint naming something its module does not define
        raise TypeError(f"tool {where}: its type hints cannot be resolved ({type(exc).__name__}: {exc}); "
                        "import what they name at module level") from None
    descriptions, summary = _docstring(function)
    unknown = sorted(set(descriptions) - {p.name for p in own})
    if unknown:
        raise TypeError(f"tool {where}: its docstring's Args describe {', '.join(map(repr, unknown))}, which it does not take; "
                        "fix the docstring or the signature")
    properties: dict[str, Any] = {}
    checked = []
    for parameter in own:
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise TypeError(f"tool {where}: parameter {parameter.name!r} collects arguments (*args or **kwargs), which a schema cannot "
                            "describe; name each argument")
        if parameter.name not in hints:
            raise TypeError(f"tool {where}: parameter {parameter.name!r} has no type hint; annotate it ({_SUPPORTED}) so the model "
                            "is told what to pass and its calls can be checked")
        schema = _type_schema(hints[parameter.name])
        if schema is None:
            raise TypeError(f"tool {where}: parameter {parameter.name!r} is annotated {_hint_name(hints[parameter.name])}, which a tool "
                            f"schema cannot express; use {_SUPPORTED}")
        if parameter.name in descriptions:
            schema["description"] = descriptions[parameter.name]
        properties[parameter.name] = schema
        checked.append(_Parameter(parameter.name, hints[parameter.name], parameter.default is inspect.Parameter.empty))
    schema = {"type": "function", "function": {"name": name, "description": summary, "parameters": {
        "type": "object", "properties": properties, "required": [p.name for p in checked if p.required]}}}
    return _Spec(name, schema, tuple(checked))


def _hint_name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def _nullable(hint: Any) -> Any | None:
    """The X of `X | None` (or `Optional[X]`), else None."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if len(rest) == 1 and len(typing.get_args(hint)) == 2:
            return rest[0]
    return None


def _type_schema(hint: Any) -> dict[str, Any] | None:
    """The JSON schema of one hint, or None when it has none."""
    if hint in _SCALARS:
        return {"type": _SCALARS[hint]}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is list and len(args) == 1:
        items = _type_schema(args[0])
        return None if items is None else {"type": "array", "items": items}
    if origin is Literal:
        kinds = {type(arg) for arg in args}
        if len(kinds) != 1 or not kinds <= set(_SCALARS):
            return None  # a schema's enum takes values of one JSON type
        return {"type": _SCALARS[kinds.pop()], "enum": list(args)}
    inner = _nullable(hint)
    if inner is not None and _nullable(inner) is None:
        schema = _type_schema(inner)
        if schema is None:
            return None
        if isinstance(schema.get("type"), str):
            schema["type"] = [schema["type"], "null"]
        if "enum" in schema:
            schema["enum"] = [*schema["enum"], None]
        return schema
    return None


def _docstring(function: Callable) -> tuple[dict[str, str], str]:
    """(argument -> description from a Google-style `Args:` section, the first paragraph)."""
    lines = inspect.cleandoc(function.__doc__ or "").splitlines()
    summary: list[str] = []
    for line in lines:
        if not line.strip() or _SECTION.match(line.strip()):
            break
        summary.append(line.strip())
    descriptions: dict[str, str] = {}
    section, indent, current = None, 0, None
    for line in lines:
        stripped = line.strip()
        if _SECTION.match(stripped) and len(line) - len(line.lstrip()) == 0:
            section, current, indent = stripped.rstrip(":"), None, 0
            continue
        if section not in ("Args", "Arguments", "Parameters") or not stripped:
            continue
        depth = len(line) - len(line.lstrip())
        if depth == 0:  # text back at the margin ends the section
            section = None
            continue
        match = _ARG_LINE.match(stripped)
        if match and (current is None or depth <= indent):
            current, indent = match.group(1), depth
            descriptions[current] = match.group(2).strip()
        elif current is not None:  # a continuation line
            descriptions[current] = f"{descriptions[current]} {stripped}".strip()
    return descriptions, " ".join(summary)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _expected(hint: Any, plural: bool = False) -> str:
    """What a value of `hint` is, in words for the model: "an integer", "an array of strings"."""
    if hint in _SCALARS:
        kind = _SCALARS[hint]
        return f"{kind}s" if plural else {"string": "a string", "integer": "an integer", "number": "a number", "boolean": "true or false"}[kind]
    if typing.get_origin(hint) is list:
        return f"{'arrays' if plural else 'an array'} of {_expected(typing.get_args(hint)[0], plural=True)}"
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(json.dumps(arg) for arg in typing.get_args(hint))
    return f"{_expected(_nullable(hint), plural)} or null"


def _checked(hint: Any, value: Any) -> tuple[bool, Any]:
    """(whether `value` fits `hint`, the value to pass): JSON numbers may stand for a float; nothing else is converted."""
    if hint is bool or hint is str:
        return isinstance(value, hint), value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if hint is float:
        fits = isinstance(value, (int, float)) and not isinstance(value, bool)
        return fits, float(value) if fits else value
    origin = typing.get_origin(hint)
    if origin is list:
        if not isinstance(value, list):
            return False, value
        items = [_checked(typing.get_args(hint)[0], item) for item in value]
        return all(fits for fits, _ in items), [item for _, item in items]
    if origin is Literal:
        # by type too: 1 == True in Python, not in the schema's enum
        return any(value == arg and type(value) is type(arg) for arg in typing.get_args(hint)), value
    if value is None:
        return True, None  # only a nullable hint is left
    return _checked(_nullable(hint), value)


def _arguments(spec: _Spec, arguments: Any) -> tuple[dict[str, Any] | None, str]:
    """(the checked keyword arguments, "") or (None, what is wrong with the call)."""
    signature = f"{spec.name}({', '.join(p.name for p in spec.parameters)})"
    if not isinstance(arguments, dict):
        return None, f"the arguments of {spec.name} must be an object of named values, got {_json_type(arguments)}"
    known = {p.name: p for p in spec.parameters}
    unexpected = [name for name in arguments if name not in known]
    if unexpected:
        return None, f"{spec.name} takes no argument {', '.join(map(repr, unexpected))}; call it as {signature}"
    missing = [p.name for p in spec.parameters if p.required and p.name not in arguments]
    if missing:
        return None, f"{spec.name} is missing the argument {', '.join(map(repr, missing))}; call it as {signature}"
    passed = {}
    for name, value in arguments.items():
        fits, passed[name] = _checked(known[name].hint, value)
        if not fits:
            return None, f"argument {name!r} of {spec.name} must be {_expected(known[name].hint)}, got {json.dumps(value, default=str)}"
    return passed, ""


def _rendered(result: Any) -> str:
    if isinstance(result, (dict, list, tuple)):
        return json.dumps(result, ensure_ascii=False, default=str)
    return str(result)


@attrs.define
class ToolEpisode:
    """The state the runner holds for an episode of a `ToolEnvironment`: the environment's own
    (`state`, what `start` returned) and the counts the final step's info reports."""

    state: Any
    tool_calls: int = 0  # calls that reached a tool, whether it raised or not
    malformed_tool_calls: int = 0  # unreadable markup, an unknown tool, arguments that do not fit the signature
    tool_errors: int = 0  # calls whose tool raised

    def counts(self) -> dict[str, float]:
        return {"tool_calls": float(self.tool_calls), "malformed_tool_calls": float(self.malformed_tool_calls),
                "tool_errors": float(self.tool_errors)}


class ToolEnvironment(Environment):
    """An environment whose model calls the `@tool` methods and ends with an answer.

    A subclass implements `start` (the episode's opening messages and state) and `answer` (the
    model's turn without tool calls: usually the final answer, scored); `reset` and `step` are
    this class's. Each turn with tool calls gets one tool message per call, in order; an unreadable
    call, an unknown tool, arguments that do not fit the signature and a tool that raises each get
    a tool message saying what went wrong, are counted, and the episode goes on. Every step's info
    carries the episode's counts so far (`tool_calls`, `malformed_tool_calls`, `tool_errors`) and
    `info(state)`, so an episode the runner ends at its turn limit reports them too."""

    _tools: ClassVar[dict[str, _Spec]] = {}
    _schemas: ClassVar[list[dict[str, Any]]] = []

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        found = {}
        for klass in reversed(cls.__mro__):  # a subclass's own definition of a name wins
            for name, value in vars(klass).items():
                found[name] = getattr(value, _MARK, None)
        cls._tools = {name: spec for name, spec in found.items() if spec is not None}
        cls._schemas = [spec.schema for _, spec in sorted(cls._tools.items())]

    def tools(self) -> list[dict[str, Any]]:
        """The schemas of the `@tool` methods, sorted by name (worked out once per class)."""
        return copy.deepcopy(self._schemas)

    @abstractmethod
    def start(self, record: dict[str, Any], seed: int) -> Reset:
        """The episode's opening messages and its state, which every tool and `answer` of the episode is given."""

    @abstractmethod
    def answer(self, state: Any, reply: Reply) -> Step:
        """The model's turn without tool calls (its answer): usually the reward and done."""

    def info(self, state: Any) -> dict[str, float]:
        """Figures for a step that is not the answer (an episode cut off at its turn limit reports
        them as its last), e.g. `{"solved": 0.0}`; `answer`'s own info replaces them."""
        return {}

    def reset(self, record: dict[str, Any], seed: int) -> Reset:
        opening = self.start(record, seed)
        episode = ToolEpisode(opening.state)
        return Reset(opening.messages, episode, info={**episode.counts(), **self.info(episode.state), **opening.info})

    def step(self, state: Any, reply: Reply) -> Step:
        if not isinstance(state, ToolEpisode):
            raise TypeError(f"{type(self).__name__}.step was given {type(state).__name__}, not the ToolEpisode its reset returns; "
                            "a ToolEnvironment implements start() and answer(), not reset()")
        episode = state
        if reply.parse_error:
            episode.malformed_tool_calls += 1
            messages = [_tool_message("", f"Error: your tool call could not be read: {reply.parse_error}. No tool was called; "
                                          "write the call again.")]
        elif reply.tool_calls:
            messages = [self._call(episode, call) for call in reply.tool_calls]
        else:
            final = self.answer(episode.state, reply)
            if not isinstance(final, Step):
                raise TypeError(f"{type(self).__name__}.answer returned {type(final).__name__}; return a rlkit_core.Step")
            return attrs.evolve(final, info={**episode.counts(), **final.info})
        return Step(messages=messages, info={**episode.counts(), **self.info(episode.state)})

    def _call(self, episode: ToolEpisode, call: ToolCall) -> dict[str, Any]:
        spec = self._tools.get(call.name)
        if spec is None:
            episode.malformed_tool_calls += 1
            names = ", ".join(sorted(self._tools)) or "none"
            return _tool_message(call.name, f"Error: there is no tool named {call.name!r}; the tools are: {names}.")
        arguments, problem = _arguments(spec, call.arguments)
        if arguments is None:
            episode.malformed_tool_calls += 1
            return _tool_message(call.name, f"Error: {problem}.")
        episode.tool_calls += 1
        try:
            result = getattr(self, spec.name)(episode.state, **arguments)
        except RecipeError:  # bad input (a record without a column the tool reads): the run stops, exit 2
            raise
        except Exception as exc:  # the model sees what went wrong, as it would from a real tool
            episode.tool_errors += 1
            return _tool_message(call.name, f"Error: {type(exc).__name__}: {exc}")
        return _tool_message(call.name, _rendered(result))


def _tool_message(name: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "name": name, "content": content}
