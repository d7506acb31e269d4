"""Tool-call format `llama3-json`: Llama 3.1's and 3.2's JSON tool calls, a bare object as the whole turn.

    {"name": NAME, "parameters": {KEY: VALUE, ...}}

optionally after `<|python_tag|>`. The template renders one call a turn (and refuses more), so a
turn is one call or none: a turn that opens with `<|python_tag|>`, or with `{` and names a "name",
is read as a call and must be one; any other turn is prose. `"arguments"` is read as well as
`"parameters"`. JSON carries its own types, so the tools' schemas are not needed.
"""

import json
from collections.abc import Sequence

import attrs

from rlkit_core import ToolCall, ToolCallFormat, hookimpl

PYTHON_TAG = "<|python_tag|>"


@attrs.frozen
class Llama3JsonConfig:
    """No settings: the JSON says every value's type."""


def _call(value) -> tuple[ToolCall | None, str | None]:
    if isinstance(value, list):
        return None, "one call a turn expected (a JSON object), got a list: Llama 3's chat template renders one call a turn"
    if not isinstance(value, dict):
        return None, f"a JSON object with \"name\" and \"parameters\" expected, got {type(value).__name__}"
    if not isinstance(value.get("name"), str) or not value["name"]:
        return None, "\"name\" is missing or not a string"
    arguments = value.get("parameters", value.get("arguments", {}))
    if not isinstance(arguments, dict):
        return None, "\"parameters\" is not a JSON object"
    return ToolCall(name=value["name"], arguments=arguments), None


class Llama3Json(ToolCallFormat):
    @staticmethod
    def recognises(template: str) -> bool:
        return '{"name": "' in template and '"parameters": ' in template

    def read(self, text: str, tools: Sequence[dict] = ()) -> tuple[tuple[ToolCall, ...], str | None]:
        body = text.strip()
        tagged = body.startswith(PYTHON_TAG)
        body = body.removeprefix(PYTHON_TAG).strip()
        if not tagged and not (body.startswith(("{", "[")) and '"name"' in body):
            return (), None
        try:
            value = json.loads(body)
        except json.JSONDecodeError as exc:
            return (), f"tool call 1: invalid JSON ({exc.msg} at character {exc.pos}); a call is the whole turn, one JSON object"
        call, problem = _call(value)
        return ((call,), None) if call else ((), f"tool call 1: {problem}")

    def content(self, text: str) -> str:
        return ""  # a call is the whole turn

    def write(self, calls: Sequence[ToolCall]) -> str:
        """As Llama 3.1's template renders a call (one a turn)."""
        if len(calls) > 1:
            raise ValueError(f"llama3-json writes one call a turn, not {len(calls)}")
        return "".join('{"name": "' + call.name + '", "parameters": ' + json.dumps(call.arguments, ensure_ascii=False) + "}" for call in calls)


@hookimpl
def register_tool_call_formats(register):
    register("llama3-json", Llama3Json, Llama3JsonConfig)
