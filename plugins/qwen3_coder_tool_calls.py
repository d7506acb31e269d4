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

from rlkit_core import ToolCall, ToolCallFormat, hookimpl, setting, typed_arguments

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
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


class Qwen3Coder(ToolCallFormat):
    @staticmethod
    def recognises(template: str) -> bool:
        return "<function=" in template and "<parameter=" in template

    def read(self, text: str, tools: Sequence[dict] = ()) -> tuple[tuple[ToolCall, ...], str | None]:
        calls: list[ToolCall] = []
        problems: list[str] = []
        blocks = list(_BLOCK.finditer(text))
        for number, block in enumerate(blocks, 1):
            function = _FUNCTION.fullmatch(block.group(1))
            if function is None:
                problems.append(f"tool call {number}: one <function=NAME>...</function> expected inside {OPEN}")
                continue
            name = function.group(1).strip()
            values, problem = _arguments(function.group(2))
            if not name or problem:
                problems.append(f"tool call {number}: {problem or 'the function has no name'}")
                continue
            typed = self.config is None or self.config.typed_arguments
            calls.append(ToolCall(name=name, arguments=typed_arguments(name, values, tools) if typed else values))
        outside = _BLOCK.sub("", text)
        if OPEN in outside:
            problems.append(f"tool call {len(blocks) + 1}: {OPEN} is not closed with {CLOSE}")
        if CLOSE in outside:
            problems.append(f"a {CLOSE} tag has no {OPEN} before it")
        if "<function=" in outside:
            problems.append(f"a <function=...> is not inside {OPEN}...{CLOSE}")
        if problems:
            return (), "; ".join(problems)
        return tuple(calls), None

    def content(self, text: str) -> str:
        return _BLOCK.sub("", text).strip()

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
