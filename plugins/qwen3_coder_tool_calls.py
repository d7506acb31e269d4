"""Tool-call format `qwen3-coder`: the XML calls of Qwen3-Coder, Qwen3.5 and Qwen3.6.

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

One function a block; a value is text, the newline after `<parameter=KEY>` and the one before
`</parameter>` being the template's, not the value's. The template writes a string as it is and any
other value as JSON, so a value is read back by the tool's JSON schema type (`typed_arguments`);
without a schema type it stays a string.
"""

import json
import re
from collections.abc import Sequence

import attrs

from rlkit_core import ToolCall, ToolCallFormat, hookimpl, read_call_blocks, setting, without_call_blocks

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]*)>(.*)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]*)>(.*?)</parameter>", re.DOTALL)


@attrs.frozen
class Qwen3CoderConfig:
    typed_arguments: bool = setting(True, help="read each value by the tool's JSON schema type (integer, number, boolean, object, array); "
                                               "false: every value a string")


def _value(text: str) -> str:
    """A parameter's text without the newline the template puts on each side."""
    text = text[1:] if text.startswith("\n") else text
    return text[:-1] if text.endswith("\n") else text


def _arguments(body: str) -> tuple[dict[str, str], str | None]:
    """The `<parameter=...>` values of a function's body, or why they cannot be read."""
    values: dict[str, str] = {}
    position = 0
    while match := _PARAMETER.match(body, position):
        key = match.group(1).strip()
        if not key:
            return {}, "a <parameter=> without a name"
        if key in values:
            return {}, f"parameter {key!r} is given twice"
        values[key], position = _value(match.group(2)), match.end()
    rest = body[position:].strip()
    if rest:
        return {}, f"{rest[:40]!r} is not a <parameter=NAME>...</parameter> block (a tag left open?)"
    return values, None


def _call(block: str) -> tuple[str, dict[str, str], str | None]:
    """(name, values, why the block cannot be read)."""
    function = _FUNCTION.fullmatch(block)
    if function is None:
        return "", {}, f"one <function=NAME>...</function> expected inside {OPEN}"
    name = function.group(1).strip()
    values, problem = _arguments(function.group(2))
    if not name or problem:
        return "", {}, problem or "the function has no name"
    return name, values, None


class Qwen3Coder(ToolCallFormat):
    @staticmethod
    def recognises(template: str) -> bool:
        return "<function=" in template and "<parameter=" in template

    def read(self, text: str, tools: Sequence[dict] = ()) -> tuple[tuple[ToolCall, ...], str | None]:
        return read_call_blocks(text, "<function=", _call, tools, typed=self.config is None or self.config.typed_arguments)

    def content(self, text: str) -> str:
        return without_call_blocks(text)

    def write(self, calls: Sequence[ToolCall]) -> str:
        """As Qwen3.6's template renders them: a string as it is, any other value as JSON."""
        return "\n".join(
            f"{OPEN}\n<function={call.name}>\n"
            + "".join(f"<parameter={key}>\n{_text(value)}\n</parameter>\n" for key, value in call.arguments.items())
            + f"</function>\n{CLOSE}" for call in calls)


def _text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


@hookimpl
def register_tool_call_formats(register):
    register("qwen3-coder", Qwen3Coder, Qwen3CoderConfig)
