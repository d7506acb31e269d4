"""Tool-call format `glm45`: GLM-4.5's calls, a name and `<arg_key>`/`<arg_value>` pairs.

    <tool_call>NAME
    <arg_key>KEY</arg_key>
    <arg_value>VALUE</arg_value>
    </tool_call>

A value is text, as written between its tags. The template writes a string as it is and any other
value as JSON, so a value is read back by the tool's JSON schema type (`typed_arguments`); without
a schema type it stays a string.
"""

import json
import re
from collections.abc import Sequence

import attrs

from rlkit_core import ToolCall, ToolCallFormat, hookimpl, setting, typed_arguments

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
_NAME = re.compile(r"\s*([^\s<>{}\"]+)\s*")
_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


@attrs.frozen
class GLM45Config:
    typed_arguments: bool = setting(True, help="read each value by the tool's JSON schema type (integer, number, boolean, object, array); "
                                               "false: every value a string")


def _call(body: str) -> tuple[str, dict[str, str], str | None]:
    """(name, values, why the block cannot be read)."""
    name = _NAME.match(body)
    if name is None:
        return "", {}, f"a function name expected right after {OPEN}, got {body[:40]!r}"
    values: dict[str, str] = {}
    position = name.end()
    while pair := _PAIR.match(body, position):
        key = pair.group(1).strip()
        if not key or key in values:
            return "", {}, f"argument {key!r} is given twice" if key else "an <arg_key> is empty"
        values[key], position = pair.group(2), pair.end()
    rest = body[position:].strip()
    if rest:
        return "", {}, f"{rest[:40]!r} is not an <arg_key>KEY</arg_key><arg_value>VALUE</arg_value> pair (a tag left open?)"
    return name.group(1), values, None


class GLM45(ToolCallFormat):
    @staticmethod
    def recognises(template: str) -> bool:
        return "<arg_key>" in template and "<arg_value>" in template

    def read(self, text: str, tools: Sequence[dict] = ()) -> tuple[tuple[ToolCall, ...], str | None]:
        calls: list[ToolCall] = []
        problems: list[str] = []
        blocks = list(_BLOCK.finditer(text))
        for number, block in enumerate(blocks, 1):
            name, values, problem = _call(block.group(1))
            if problem:
                problems.append(f"tool call {number}: {problem}")
                continue
            typed = self.config is None or self.config.typed_arguments
            calls.append(ToolCall(name=name, arguments=typed_arguments(name, values, tools) if typed else values))
        outside = _BLOCK.sub("", text)
        if OPEN in outside:
            problems.append(f"tool call {len(blocks) + 1}: {OPEN} is not closed with {CLOSE}")
        if CLOSE in outside:
            problems.append(f"a {CLOSE} tag has no {OPEN} before it")
        if "<arg_key>" in outside:
            problems.append(f"an <arg_key> is not inside {OPEN}...{CLOSE}")
        if problems:
            return (), "; ".join(problems)
        return tuple(calls), None

    def content(self, text: str) -> str:
        return _BLOCK.sub("", text).strip()

    def write(self, calls: Sequence[ToolCall]) -> str:
        """As GLM-4.5's template renders them: a string as it is, any other value as JSON."""
        return "\n".join(
            f"{OPEN}{call.name}\n"
            + "".join(f"<arg_key>{key}</arg_key>\n<arg_value>{_text(value)}</arg_value>\n" for key, value in call.arguments.items())
            + CLOSE for call in calls)


def _text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


@hookimpl
def register_tool_call_formats(register):
    register("glm45", GLM45, GLM45Config)
