"""Chat format `role-lines`: every message one line led by its role, for models trained on
transcripts such as "user: ...", "assistant: ...".

A chat format plugin in one module: a `ChatFormat` subclass, its settings as an attrs class, and a
`register_chat_formats` hook. Put the module on an entry point of the `rlkit` group (for example
`role-lines = "my_package.role_lines"`) and a recipe picks it in `[environment]`:
`chat_format = "role-lines"`, or a `[environment.chat_format]` table with `type = "role-lines"`
and its settings.

Like the core's `plain` format, the stream is the format itself: an assistant turn is exactly the
ids the model sampled (its end token last), and the bridge after it is the next messages' lines
and the generation prompt, so an episode is always one training sample.
"""

import attrs

from rlkit_core import ChatFormat, ToolCall, hookimpl, setting


@attrs.frozen
class RoleLinesConfig:
    separator: str = setting(": ", help="what follows the role at the start of each line")


class RoleLines(ChatFormat):
    name = "role-lines"

    def render(self, messages, tools, generation_prompt):
        separator = self.config.separator
        parts = [f"tools{separator}" + ", ".join(tool.get("function", tool)["name"] for tool in tools) + "\n"] if tools else []
        for message in messages:
            if message["role"] == "assistant":
                calls = [entry.get("function", entry) for entry in message.get("tool_calls") or []]
                written = self.tool_calls.write([ToolCall(name=c["name"], arguments=c.get("arguments", {})) for c in calls])
                parts.append(f"assistant{separator}{message.get('content') or ''}{written}{self.end_texts[0]}\n")
            else:
                parts.append(f"{message['role']}{separator}{message.get('content') or ''}\n")
        if generation_prompt:
            parts.append(f"assistant{separator}")
        return "".join(parts)

    def bridge(self, stream, history, new, tools):
        return self.encode("\n" + self.render(new, [], True))


@hookimpl
def register_chat_formats(register):
    register("role-lines", RoleLines, RoleLinesConfig)
