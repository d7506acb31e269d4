"""Tool-call formats: how a model family writes its calls in a turn, read back as `ToolCall`s.

Models write calls in the markup they were trained on (Hermes' `<tool_call>{json}</tool_call>`,
Qwen3-Coder's `<function=...>` XML, Llama 3's bare JSON object, GLM-4.5's `<arg_key>` pairs), and a
call rlkit cannot read is a call lost. A format is a plugin kind: a class deriving from
`ToolCallFormat`, registered from a `register_tool_call_formats(register)` hook with a config class
and built as `cls(config)`. A recipe picks it in `[environment]` (`tool_call_format = "glm45"`, or a
`[environment.tool_call_format]` table with its settings); the default, "auto", is the registered
format that recognises the tokenizer's chat template, else `hermes`, and the episode audit says which.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from rlkit_core.messages import Reply, ToolCall

AUTO = "auto"  # the type core answers for: the format the chat template writes (`chosen_format`)
DEFAULT = "hermes"  # what "auto" falls back to, and the format of a tokenizer without a chat template
KIND = "tool_call_format"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
CALL_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)


def call_entry(call: ToolCall) -> dict[str, Any]:
    """A call as chat templates read an assistant message's `tool_calls` (the OpenAI layout)."""
    return {"type": "function", "function": {"name": call.name, "arguments": call.arguments}}


class ToolCallFormat(ABC):
    """Reads the calls of a model's turn and leaves the turn as the family's chat template renders
    it back. `read` is all or none: when any call is malformed no call is returned, only the reason
    (the runner counts it in `env/unreadable_tool_calls` and the environment tells the model), so
    that an environment never answers half of a turn."""

    def __init__(self, config: Any = None):
        self.config = config

    @staticmethod
    def recognises(template: str) -> bool:
        """Whether a chat template's source writes calls in this format ("auto" picks the format
        that says so). Cheap and strict: a template that two formats recognise is refused."""
        return False

    @abstractmethod
    def read(self, text: str, tools: Sequence[dict] = ()) -> tuple[tuple[ToolCall, ...], str | None]:
        """The calls in `text`, the turn as the model wrote it, and why they could not be read
        (None when they could). `tools`: the environment's tool schemas, for formats whose values
        are text (see `typed_arguments`)."""

    @abstractmethod
    def content(self, text: str) -> str:
        """`text` without its call markup: the content of the assistant message that carries the calls."""

    @abstractmethod
    def write(self, calls: Sequence[ToolCall]) -> str:
        """The calls as the model writes them, which `read` reads back (the plain chat format
        renders a history's calls so)."""

    def assistant_message(self, reply: Reply) -> dict:
        """The turn as the history records it: read calls move from the text to OpenAI-style
        `tool_calls`, where the chat template renders them; a turn whose markup could not be read
        keeps its text as written."""
        if not reply.tool_calls:
            return {"role": "assistant", "content": reply.text}
        return {"role": "assistant", "content": self.content(reply.text), "tool_calls": [call_entry(call) for call in reply.tool_calls]}


@attrs.frozen
class AutoSettings:
    """`tool_call_format = "auto"` takes no settings: the format it picks keeps its defaults."""


def without_call_blocks(text: str) -> str:
    """`text` without its `<tool_call>...</tool_call>` blocks, stripped: a turn's content."""
    return CALL_BLOCK.sub("", text).strip()


def read_call_blocks(text: str, inner: str | None, parse: Callable[[str], tuple[str, dict[str, str], str | None]],
                     tools: Sequence[dict] = (), typed: bool = True) -> tuple[tuple[ToolCall, ...], str | None]:
    """`read` for a format of `<tool_call>...</tool_call>` blocks whose values are text: each block's
    inside as `parse` reads it (a name, the values, why it cannot be read), the values typed by the
    tools' schemas when `typed` (`typed_arguments`). All or none, with the reasons: a block `parse`
    refuses, a tag left open or closed without opening, `inner` markup (if any) outside every block."""
    calls, problems = [], []
    blocks = list(CALL_BLOCK.finditer(text))
    for number, block in enumerate(blocks, 1):
        name, values, problem = parse(block.group(1))
        if problem:
            problems.append(f"tool call {number}: {problem}")
        else:
            calls.append(ToolCall(name=name, arguments=typed_arguments(name, values, tools) if typed else values))
    outside = CALL_BLOCK.sub("", text)
    if CALL_OPEN in outside:
        problems.append(f"tool call {len(blocks) + 1}: {CALL_OPEN} is not closed with {CALL_CLOSE}")
    if CALL_CLOSE in outside:
        problems.append(f"a {CALL_CLOSE} tag has no {CALL_OPEN} before it")
    if inner and inner in outside:
        problems.append(f"{inner} is not inside {CALL_OPEN}...{CALL_CLOSE}")
    return ((), "; ".join(problems)) if problems else (tuple(calls), None)


def _json_call(block: str) -> tuple[str, dict[str, Any], str | None]:
    """(name, arguments, why the block cannot be read) of a `{"name": ..., "arguments": {...}}` block."""
    try:
        value = json.loads(block)
    except json.JSONDecodeError as exc:
        return "", {}, f"invalid JSON ({exc.msg} at character {exc.pos})"
    if not isinstance(value, dict):
        return "", {}, f"a JSON object with \"name\" and \"arguments\" expected, got {type(value).__name__}"
    if not isinstance(value.get("name"), str) or not value["name"]:
        return "", {}, "\"name\" is missing or not a string"
    if not isinstance(value.get("arguments", {}), dict):
        return "", {}, "\"arguments\" is not a JSON object"
    return value["name"], value.get("arguments", {}), None


def parse_tool_calls(text: str) -> tuple[tuple[ToolCall, ...], str | None]:
    """The calls in `text`'s `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, and
    why they could not be read (None when they could).

    All or none: when any block is malformed (invalid JSON, no string `name`, `arguments` not an
    object, a tag left open or closed without opening) no call is returned, so that an environment
    never answers half of a turn whose other half the model is told was malformed. Arguments may be
    left out (an empty object); JSON carries their types."""
    return read_call_blocks(text, None, _json_call, typed=False)


class JSONInTags(ToolCallFormat):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as Hermes 2 Pro, Qwen2.5 and Qwen3
    write calls: the format a chat format reads when no other is chosen (the plugin `hermes`
    registers it)."""

    # the template writes `<tool_call>` and then a JSON object's "name" (a newline, a quote escaped in a Jinja string, between)
    _in_template = re.compile(r'<tool_call>(?:\\n|\s)*\{\\?"name')

    @staticmethod
    def recognises(template: str) -> bool:
        return bool(JSONInTags._in_template.search(template))

    def read(self, text: str, tools: Sequence[dict] = ()) -> tuple[tuple[ToolCall, ...], str | None]:
        return parse_tool_calls(text)

    def content(self, text: str) -> str:
        return without_call_blocks(text)

    def write(self, calls: Sequence[ToolCall]) -> str:
        return "".join(CALL_OPEN + json.dumps({"name": call.name, "arguments": call.arguments}) + CALL_CLOSE for call in calls)


def _schema_types(tools: Sequence[dict], name: str, key: str) -> list[str]:
    """The JSON schema types the tool `name` declares for its argument `key` (none when unknown)."""
    for tool in tools:
        function = tool.get("function", tool)
        if function.get("name") == name:
            declared = ((function.get("parameters") or {}).get("properties") or {}).get(key, {}).get("type")
            return [declared] if isinstance(declared, str) else list(declared) if isinstance(declared, list) else []
    return []


_JSON_TYPES: dict[str, Any] = {"integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
                               "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
                               "boolean": lambda v: isinstance(v, bool), "object": lambda v: isinstance(v, dict),
                               "array": lambda v: isinstance(v, list), "null": lambda v: v is None}


def typed_arguments(name: str, values: dict[str, str], tools: Sequence[dict]) -> dict[str, Any]:
    """Arguments written as text (the XML formats) converted by the tool's JSON schema: a value whose
    declared type is integer, number, boolean, object, array or null is read as JSON when it parses
    as that type; any other value (a type that allows a string, no type, an unknown tool or
    argument, text that is not of the declared type) stays the string it was, and the tool's own
    argument check answers it."""
    typed: dict[str, Any] = {}
    for key, text in values.items():
        typed[key] = text
        kinds = _schema_types(tools, name, key)
        for kind in [] if "string" in kinds else kinds:
            if kind not in _JSON_TYPES:
                continue
            try:
                value = json.loads(text.strip().lower() if kind == "boolean" else text)
            except json.JSONDecodeError:
                continue
            if _JSON_TYPES[kind](value):
                typed[key] = value
                break
    return typed


def chosen_format(choice: Any, template: str | None, registry: Any) -> tuple[ToolCallFormat | None, str]:
    """The format a recipe's `tool_call_format` (a `ComponentChoice`, or None outside a recipe:
    "auto") picks for a tokenizer's `template` (None: it has none or it is not used), and how it
    was picked, for the audit. "auto" takes the one registered format whose `recognises` accepts
    the template, else `hermes`: its class when `registry` has it, else None, the core's reading of
    the same markup (`JSONInTags`, a chat format's default). Raises ValueError with the fix when several formats claim the template."""
    if choice is not None and choice.component.name != AUTO:
        return choice.component.factory(choice.config), f"{choice.component.name} (the recipe's)"
    formats = [registry.find(KIND, name) for name in registry.names(KIND) if name != AUTO] if registry is not None else []
    claimed = [c for c in formats if template and c.factory.recognises(template)]
    if len(claimed) > 1:
        raise ValueError(f"the chat template reads as {len(claimed)} tool-call formats ({', '.join(c.name for c in claimed)}); "
                         "set tool_call_format to the one the model writes")
    if claimed:
        return claimed[0].factory(claimed[0].config_class()), f"{claimed[0].name} (auto: recognised in the chat template)"
    fallback = registry.find(KIND, DEFAULT) if registry is not None else None
    why = "the chat template names no other format" if template else "no chat template"
    return (fallback.factory(fallback.config_class()) if fallback else None), f"{DEFAULT} (auto: {why})"
