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

from rlkit_core import ToolCall, ToolCallFormat, hookimpl, read_call_blocks, setting, without_call_blocks

OPEN, CLOSE = "<tool_call>", "</tool_call>"
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
        return read_call_blocks(text, "<arg_key>", _call, tools, typed=self.config is None or self.config.typed_arguments)

    def content(self, text: str) -> str:
        return without_call_blocks(text)

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
