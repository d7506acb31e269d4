"""Tool-call format `hermes`: JSON inside tags, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Hermes 2 Pro, Qwen2.5 and Qwen3 write their calls so. It is the format rlkit always read, what
"auto" falls back to when the chat template names no other, and the format of a tokenizer without
a template. Reading is `rlkit_core.parse_tool_calls`: JSON carries its own types, so the tools'
schemas are not needed.
"""

import json
import re
from collections.abc import Sequence

import attrs

from rlkit_core import ToolCall, ToolCallFormat, hookimpl, parse_tool_calls

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r".*?" + re.escape(CLOSE), re.DOTALL)
# the template writes `<tool_call>` and then a JSON object's "name" (a newline, a quote escaped in a Jinja string, between)
_IN_TEMPLATE = re.compile(r'<tool_call>(?:\\n|\s)*\{\\?"name')


@attrs.frozen
class HermesConfig:
    """No settings: the JSON says every value's type."""


class Hermes(ToolCallFormat):
    @staticmethod
    def recognises(template: str) -> bool:
        return bool(_IN_TEMPLATE.search(template))

    def read(self, text: str, tools: Sequence[dict] = ()) -> tuple[tuple[ToolCall, ...], str | None]:
        return parse_tool_calls(text)

    def content(self, text: str) -> str:
        return _BLOCK.sub("", text).strip()

    def write(self, calls: Sequence[ToolCall]) -> str:
        return "".join(OPEN + json.dumps({"name": call.name, "arguments": call.arguments}) + CLOSE for call in calls)


@hookimpl
def register_tool_call_formats(register):
    register("hermes", Hermes, HermesConfig)
