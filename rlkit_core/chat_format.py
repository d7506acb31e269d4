"""How an episode's messages become token ids without re-tokenising what the model sampled.

A training sample of an episode is its first prompt followed by one stream of ids: each turn's ids
exactly as the generator sampled them, and between turns the ids of what nobody sampled (the text a
chat template puts after an assistant turn's end token, the environment's messages, the next
generation prompt). A `ChatFormat` renders those non-sampled parts. Decoding a turn and encoding it
again would change the ids (another segmentation of the same text) and so the log-probabilities PPO
compares; rendering only the gaps keeps the stream what the model saw. Some templates rewrite earlier
turns once the conversation goes on (Qwen3 drops the reasoning of turns before the last user
message): their render of the longer conversation does not extend the shorter one, and the bridge
says so (`None`), so that the caller starts a new sample instead of training on a stream no render
produces. `audit` checks a tokenizer's template for all of this on a probe conversation.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from typing import Any

import attrs

from rlkit_core.messages import Reply, ToolCall

FORMATS = ("auto", "template", "plain")
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)


def parse_tool_calls(text: str) -> tuple[tuple[ToolCall, ...], str | None]:
    """The calls in `text`'s `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, and
    why they could not be read (None when they could).

    All or none: when any block is malformed (invalid JSON, no string `name`, `arguments` not an
    object, a tag left open or closed without opening) no call is returned, so that an environment
    never answers half of a turn whose other half the model is told was malformed. Arguments may be
    left out (an empty object)."""
    calls: list[ToolCall] = []
    problems: list[str] = []
    blocks = list(_CALL_BLOCK.finditer(text))
    for number, block in enumerate(blocks, 1):
        try:
            value = json.loads(block.group(1))
        except json.JSONDecodeError as exc:
            problems.append(f"tool call {number}: invalid JSON ({exc.msg} at character {exc.pos})")
            continue
        if not isinstance(value, dict):
            problems.append(f"tool call {number}: a JSON object with \"name\" and \"arguments\" expected, got {type(value).__name__}")
        elif not isinstance(value.get("name"), str) or not value["name"]:
            problems.append(f"tool call {number}: \"name\" is missing or not a string")
        elif not isinstance(value.get("arguments", {}), dict):
            problems.append(f"tool call {number}: \"arguments\" is not a JSON object")
        else:
            calls.append(ToolCall(name=value["name"], arguments=value.get("arguments", {})))
    outside = _CALL_BLOCK.sub("", text)
    if CALL_OPEN in outside:
        problems.append(f"tool call {len(blocks) + 1}: {CALL_OPEN} is not closed with {CALL_CLOSE}")
    if CALL_CLOSE in outside:
        problems.append(f"a {CALL_CLOSE} tag has no {CALL_OPEN} before it")
    if problems:
        return (), "; ".join(problems)
    return tuple(calls), None


def _call_entry(call: ToolCall) -> dict[str, Any]:
    """A call as chat templates read an assistant message's `tool_calls` (the OpenAI layout)."""
    return {"type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _tool_signature(tool: dict[str, Any]) -> str:
    function = tool.get("function", tool)
    parameters = function.get("parameters") or {}
    return f"{function.get('name', '?')}({', '.join(parameters.get('properties') or {})})"


class ChatFormat(ABC):
    """Renders what is not sampled and reads what is. `eos_token_ids`: every id a turn may end on
    (a chat model's end of turn is often not its tokenizer's EOS)."""

    name: str

    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...]):
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.end_texts = tuple(dict.fromkeys(self.decode([i]) for i in self.eos_token_ids))

    @abstractmethod
    def render(self, messages: list[dict], tools: list[dict], generation_prompt: bool) -> str:
        """The text of `messages`, with the next generation prompt when `generation_prompt`."""

    @abstractmethod
    def bridge(self, history: list[dict], new: list[dict], tools: list[dict]) -> list[int] | None:
        """The ids to append after the sampled end token of `history`'s last (assistant) turn so that
        the stream goes on with `new` and the next generation prompt; None when the format's render
        of `history + new` does not extend its render of `history`: the caller then starts a new
        sample from `opening(history + new)`."""

    def encode(self, text: str) -> list[int]:
        """Ids of rendered text; the render already holds every special token it wants (a BOS too)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        """Text exactly as the ids spell it: special tokens and spaces kept."""
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def after_end(self, text: str) -> int | None:
        """Where the text after the last end token of `text` begins (None: `text` has none)."""
        ends = [text.rfind(end) + len(end) for end in self.end_texts if end and end in text]
        return max(ends) if ends else None

    def opening(self, messages: list[dict], tools: list[dict]) -> list[int]:
        """Ids of the first prompt of a sample, its generation prompt included."""
        return self.encode(self.render(messages, tools, True))

    def read(self, sampled_ids: list[int], turn: int) -> Reply:
        """The model's turn as an environment reads it: its trailing end token dropped, every other
        token kept as text (tool and reasoning tags even where a tokenizer marks them special)."""
        ids = list(sampled_ids)
        if ids and ids[-1] in self.eos_token_ids:
            ids = ids[:-1]
        text = self.decode(ids)
        calls, error = parse_tool_calls(text)
        return Reply(text=text, turn=turn, tool_calls=calls, parse_error=error)

    def assistant_message(self, reply: Reply) -> dict:
        """The turn as the history records it. Read calls move from the text to `tool_calls` (with
        the blocks removed from the content), where a template renders them; a turn whose markup
        could not be read keeps its text as written."""
        if not reply.tool_calls:
            return {"role": "assistant", "content": reply.text}
        return {"role": "assistant", "content": _CALL_BLOCK.sub("", reply.text).strip(),
                "tool_calls": [_call_entry(call) for call in reply.tool_calls]}


class TemplateFormat(ChatFormat):
    """The tokenizer's chat template. The bridge is the difference between the render of the
    history and that of the longer conversation, from the last end token of the first: the text the
    template puts after an assistant turn's end token (a newline for ChatML, nothing for Llama 3),
    then the new messages and the generation prompt."""

    name = "template"

    def render(self, messages: list[dict], tools: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=generation_prompt,
                                                  tokenize=False)

    def bridge(self, history: list[dict], new: list[dict], tools: list[dict]) -> list[int] | None:
        before = self.render(history, tools, False)
        after = self.render(history + new, tools, True)
        end = self.after_end(before)
        # no end id in the render: the template ends a turn on a token the generation never stops on
        if end is None or not after.startswith(before):
            return None
        return self.encode(before[end:] + after[len(before):])


class PlainFormat(ChatFormat):
    """Messages as lines of text, no role markers: for byte-level toy models without a template.
    A non-assistant message is its content and a newline; tools, when given, one opening line; an
    assistant turn is what the model wrote and its end token. Append-only, so the bridge is never
    None."""

    name = "plain"

    def render(self, messages: list[dict], tools: list[dict], generation_prompt: bool) -> str:
        parts = ["tools: " + "; ".join(_tool_signature(tool) for tool in tools) + "\n"] if tools else []
        for message in messages:
            if message["role"] != "assistant":
                parts.append(f"{message.get('content') or ''}\n")
                continue
            calls = [entry.get("function", entry) for entry in message.get("tool_calls") or []]
            blocks = [CALL_OPEN + json.dumps({"name": c["name"], "arguments": c.get("arguments", {})}) + CALL_CLOSE for c in calls]
            parts.append((message.get("content") or "") + "".join(blocks) + self.end_texts[0])
        return "".join(parts)

    def bridge(self, history: list[dict], new: list[dict], tools: list[dict]) -> list[int] | None:
        return self.encode(self.render(new, [], False))


def chat_format_for(name: str, tokenizer, eos_token_ids: tuple[int, ...]) -> ChatFormat:
    """The format `name` ("auto", "template" or "plain"); "auto" takes the template when the
    tokenizer has one. Raises ValueError with the fix for a name or tokenizer that cannot work."""
    if name not in FORMATS:
        raise ValueError(f"unknown chat format {name!r}: use one of {', '.join(FORMATS)}")
    if not eos_token_ids:
        raise ValueError("the policy has no end-of-turn id, so no turn can end; give its tokenizer an eos_token")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if name == "template" and not has_template:
        raise ValueError("the tokenizer has no chat template: give it one (`chat_template` in its tokenizer_config.json, or "
                         "a chat_template.jinja file beside it), or set chat_format = \"plain\"")
    if name == "template" or (name == "auto" and has_template):
        return TemplateFormat(tokenizer, eos_token_ids)
    return PlainFormat(tokenizer, eos_token_ids)


PROBE_TOOLS = [{"type": "function", "function": {"name": "probe_lookup", "description": "looks a word up",
                                                  "parameters": {"type": "object", "properties": {"word": {"type": "string"}},
                                                                 "required": ["word"]}}}]
PROBE_RESULT = "probe-result-4217: a small wild dog"
PROBE_OPENING = [{"role": "system", "content": "answer briefly"}, {"role": "user", "content": "what is a fox?"}]
# (the model's turn as a history records it, what the environment answers; None after the last turn)
PROBE_TURNS: list[tuple[dict, list[dict] | None]] = [
    ({"role": "assistant", "content": "",
      "tool_calls": [_call_entry(ToolCall("probe_lookup", {"word": "fox"}))]},
     [{"role": "tool", "name": "probe_lookup", "content": PROBE_RESULT}]),
    ({"role": "assistant", "content": "<think>\nthe tool said so\n</think>\n\na small wild dog"},
     [{"role": "user", "content": "and a wolf?"}]),
    ({"role": "assistant", "content": "a large wild dog"}, None),
]


@attrs.frozen
class TemplateAudit:
    """What `audit` found. `differences`: (position, stream id, render id) where the last sample's
    ids differ from the whole conversation rendered at once (None past the shorter one's end)."""

    format: str  # "template" or "plain"
    mode: str  # "merge": every bridge extends the stream; "split": some turns start a new sample
    boundary_ids: tuple[int, ...]  # rendered after an assistant turn's end token, never sampled
    end_ids: tuple[int, ...]
    end_found: bool  # the template ends an assistant turn on one of the end ids
    split_turns: tuple[int, ...]  # turns after which the render of the history was rewritten
    rewrite: str  # where the first rewrite changed the render, for the printout
    tool_calls_rendered: bool
    tool_calls_read: bool  # a rendered call reads back as the call it was
    tool_content_rendered: bool
    stream_length: int
    differences: tuple[tuple[int, int | None, int | None], ...]

    @property
    def matches(self) -> bool:
        return not self.differences

    def lines(self) -> list[str]:
        """One line per finding, for the plan printout."""
        lines = [f"chat format: {self.format}" + (" (the tokenizer's chat template)" if self.format == "template"
                                                   else " (no chat template: each message a line of text, no role markers)")]
        turns = ("turn " if len(self.split_turns) == 1 else "turns ") + ", ".join(map(str, self.split_turns))
        if self.mode == "merge":
            lines.append("mode: merge: every turn's render extends the rendered history, so an episode is one training sample")
        elif not self.end_found:
            lines.append(f"mode: split: the template ends an assistant turn on none of the end ids {list(self.end_ids)}, so no "
                         "bridge can follow a sampled end token and every turn starts a new training sample; add the template's "
                         "end-of-turn token to the generation config's eos_token_id")
        else:
            lines.append(f"mode: split: the template rewrites the history after {turns} of the probe ({self.rewrite}), so such "
                         "turns start a new training sample from the re-rendered conversation")
        lines.append(f"boundary after the end token: ids {list(self.boundary_ids)}, rendered, never sampled" if self.boundary_ids
                     else "boundary after the end token: none")
        lines.append("tool results: rendered" if self.tool_content_rendered
                     else "tool results: NOT rendered: the template drops tool messages' content, so the model never sees it")
        if not self.tool_calls_rendered:
            lines.append("tool calls: not rendered by the template: the history shows the model's turns without its calls")
        else:
            lines.append("tool calls: rendered and read back" if self.tool_calls_read
                         else f"tool calls: rendered in a form the reader does not parse ({CALL_OPEN}{{json}}{CALL_CLOSE} expected)")
        if self.matches:
            lines.append(f"stream vs the conversation rendered at once: identical ({self.stream_length} ids)")
        else:
            shown = ", ".join(f"{p} (stream {s}, render {r})" for p, s, r in self.differences[:5])
            more = f" and {len(self.differences) - 5} more" if len(self.differences) > 5 else ""
            lines.append(f"stream vs the conversation rendered at once: {len(self.differences)} of {self.stream_length} ids "
                         f"differ, at {shown}{more}")
        return lines


def _first_change(before: str, after: str) -> str:
    at = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
    return f"at character {at}: {before[at:at + 24]!r} became {after[at:at + 24]!r}"


def audit(tokenizer, eos_token_ids: tuple[int, ...], name: str = "auto") -> TemplateAudit:
    """Plays the probe conversation (a tool call and its result, an answer with a `<think>` block,
    another user message) the way an episode does, each turn's ids taken from the render of that
    turn as a trained model would write it, and compares the last sample with the whole
    conversation rendered at once (less the boundary after the final end token, which no turn
    samples)."""
    chat = chat_format_for(name, tokenizer, eos_token_ids)
    tools = PROBE_TOOLS
    history = list(PROBE_OPENING)
    sample = chat.opening(history, tools)
    splits: list[int] = []
    rewrite, end_found, calls_rendered, calls_read = "", True, True, True
    boundary: tuple[int, ...] = ()
    for turn, (message, answer) in enumerate(PROBE_TURNS, 1):
        prompt, whole = chat.render(history, tools, True), chat.render(history + [message], tools, False)
        text = whole[len(prompt):] if whole.startswith(prompt) else message["content"]
        end = chat.after_end(text)
        end_found &= end is not None
        sampled = chat.encode(text[:end] if end is not None else text)
        if not sampled or sampled[-1] not in chat.eos_token_ids:
            sampled.append(chat.eos_token_ids[0])
        sample += sampled
        recorded = chat.assistant_message(chat.read(sampled, turn))
        if message.get("tool_calls"):
            calls_rendered = "probe_lookup" in text
            calls_read = recorded.get("tool_calls") == message["tool_calls"]
        history.append(recorded)
        if turn == 1:
            rendered = chat.render(history, tools, False)
            cut = chat.after_end(rendered)
            boundary = tuple(chat.encode(rendered[cut:])) if cut is not None else ()
        if answer is None:
            break
        bridge = chat.bridge(history, answer, tools)
        if bridge is None:
            if not splits:
                rewrite = _first_change(chat.render(history, tools, False), chat.render(history + answer, tools, True))
            splits.append(turn)
            history += answer
            sample = chat.opening(history, tools)
        else:
            history += answer
            sample += bridge
    rendered = chat.render(history, tools, False)
    cut = chat.after_end(rendered)
    reference = chat.encode(rendered if cut is None else rendered[:cut])
    differences = tuple((i, sample[i] if i < len(sample) else None, reference[i] if i < len(reference) else None)
                        for i in range(max(len(sample), len(reference)))
                        if i >= len(sample) or i >= len(reference) or sample[i] != reference[i])
    return TemplateAudit(format=chat.name, mode="split" if splits else "merge", boundary_ids=boundary,
                         end_ids=chat.eos_token_ids, end_found=end_found,
                         split_turns=tuple(splits), rewrite=rewrite, tool_calls_rendered=calls_rendered, tool_calls_read=calls_read,
                         tool_content_rendered=PROBE_RESULT in rendered, stream_length=len(sample), differences=differences)
