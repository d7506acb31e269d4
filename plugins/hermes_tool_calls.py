"""Tool-call format `hermes`: JSON inside tags, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Hermes 2 Pro, Qwen2.5 and Qwen3 write their calls so. It is the format rlkit always read, what
"auto" falls back to when the chat template names no other, and the format of a tokenizer without
a template. The core reads it (`rlkit_core.JSONInTags`, what a chat format reads when no format is
chosen); this plugin makes it a format a recipe can name. JSON carries its own types, so the tools'
schemas are not needed.
"""

import attrs

from rlkit_core import JSONInTags, hookimpl


@attrs.frozen
class HermesConfig:
    """No settings: the JSON says every value's type."""


@hookimpl
def register_tool_call_formats(register):
    register("hermes", JSONInTags, HermesConfig)
