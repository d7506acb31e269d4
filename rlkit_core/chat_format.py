"""How an episode's messages become token ids without re-tokenising what the model sampled.

A training sample of an episode is its first prompt followed by one stream of ids: each turn's ids
exactly as the generator sampled them, and between turns the ids of what nobody sampled (the text a
chat template puts after an assistant turn's end token, the environment's messages, the next
generation prompt). A `ChatFormat` renders those non-sampled parts. Decoding a turn and encoding it
again would change the ids (another segmentation of the same text) and so the log-probabilities PPO
compares; rendering only the gaps keeps the stream what the model saw. A turn extends the sample
when the stream so far (prompt ids, sampled ids, earlier bridges: what the model saw and wrote) is
a token prefix of the ids of the longer conversation rendered; the bridge is the rest of those ids.
The stream decides, never a render of the shorter history: Qwen3's template gives the last
assistant turn an empty think block that it drops once a message follows, so that render extends
no longer one although the stream does. Where the stream is not a prefix (the template strips a
think block the model wrote, or otherwise rewrites history; the whole render segments the text
otherwise than the stream) the bridge is `None` and the caller starts a new sample instead of
training on a stream no render produces, unless the recipe keeps turns as sampled
(`thinking_in_history = "kept"`): then the stream goes on, and the bridge is what the template renders
after that turn. `audit` plays a probe conversation through the same rule, its turns written
without a think block and with one, and counts what each choice costs.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import attrs

from rlkit_core.errors import RecipeError
from rlkit_core.messages import Reply, ToolCall
from rlkit_core.tool_call_formats import CALL_CLOSE, CALL_OPEN, JSONInTags, ToolCallFormat, call_entry, chosen_format

FORMATS = ("auto", "template", "plain")  # the core's own; plugins register more (`register_chat_formats`)
KIND = "chat_format"
TURN_MARKER = "rlkit-turn-marker-5d1c"  # stands in for an assistant turn's content, to find where the template ends it

@attrs.frozen
class CoreChatSettings:
    """The core's chat formats take no settings."""


def _tool_signature(tool: dict[str, Any]) -> str:
    function = tool.get("function", tool)
    parameters = function.get("parameters") or {}
    return f"{function.get('name', '?')}({', '.join(parameters.get('properties') or {})})"


class ChatFormat(ABC):
    """Renders what is not sampled and reads what is. `eos_token_ids`: every id a turn may end on
    (a chat model's end of turn is often not its tokenizer's EOS). `tool_calls`: the markup the
    model writes its calls in (`rlkit_core.ToolCallFormat`); by default `<tool_call>{json}</tool_call>`
    blocks (`JSONInTags`, the built-in `hermes`). `keep_sampled`: a turn the template would render
    otherwise in a longer history is kept as sampled, so the sample goes on (`thinking_in_history`)."""

    name: str
    keep_sampled: bool = False

    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...], tool_calls: ToolCallFormat | None = None, config: Any = None):
        """`config`: the recipe's settings for a registered format (its config class), None for the core's own."""
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.tool_calls = tool_calls or JSONInTags()
        self.end_texts = tuple(dict.fromkeys(self.decode([i]) for i in self.eos_token_ids))

    @abstractmethod
    def render(self, messages: list[dict], tools: list[dict], generation_prompt: bool) -> str:
        """The text of `messages`, with the next generation prompt when `generation_prompt`."""

    @abstractmethod
    def bridge(self, stream: list[int], history: list[dict], new: list[dict], tools: list[dict]) -> list[int] | None:
        """The ids to append to `stream` (the sample's prompt ids then its stream ids, ending on the
        sampled end token of `history`'s last, assistant, turn) so that it goes on with `new` and the
        next generation prompt; None when no ids can (the template renders the history otherwise and
        `keep_sampled` is off): the caller then starts a new sample from `opening(history + new)`."""

    def encode(self, text: str) -> list[int]:
        """Ids of rendered text; the render already holds every special token it wants (a BOS too)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        """Text exactly as the ids spell it: special tokens and spaces kept."""
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def first_end(self, text: str, start: int = 0) -> int | None:
        """Where the text after the first end token of `text` from `start` begins (None: it has none)."""
        ends = [found + len(end) for end in self.end_texts if end and (found := text.find(end, start)) >= 0]
        return min(ends) if ends else None

    def after_end(self, text: str) -> int | None:
        """Where the text after the last end token of `text` begins (None: `text` has none)."""
        ends = [text.rfind(end) + len(end) for end in self.end_texts if end and end in text]
        return max(ends) if ends else None

    def opening(self, messages: list[dict], tools: list[dict]) -> list[int]:
        """Ids of the first prompt of a sample, its generation prompt included."""
        return self.encode(self.render(messages, tools, True))

    def read(self, sampled_ids: list[int], turn: int, tools: Sequence[dict] = ()) -> Reply:
        """The model's turn as an environment reads it: its trailing end token dropped, every other
        token kept as text (tool and reasoning tags even where a tokenizer marks them special), its
        calls read in the tool-call format (`tools`: the schemas, for a format that types values by them)."""
        ids = list(sampled_ids)
        if ids and ids[-1] in self.eos_token_ids:
            ids = ids[:-1]
        text = self.decode(ids)
        calls, error = self.tool_calls.read(text, tools)
        return Reply(text=text, turn=turn, tool_calls=calls, parse_error=error)

    def assistant_message(self, reply: Reply) -> dict:
        """The turn as the history records it (`ToolCallFormat.assistant_message`)."""
        return self.tool_calls.assistant_message(reply)


class TemplateFormat(ChatFormat):
    """The tokenizer's chat template. The bridge is what follows the stream in the ids of the longer
    conversation rendered (the text the template puts after an assistant turn's end token, a newline
    for ChatML and nothing for Llama 3, then the new messages and the generation prompt), when the
    stream is their prefix; with `keep_sampled`, else, what the template renders after the last
    assistant turn, found by rendering the conversation with that turn's content a marker."""

    name = "template"

    def render(self, messages: list[dict], tools: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=generation_prompt,
                                                  tokenize=False)

    def bridge(self, stream: list[int], history: list[dict], new: list[dict], tools: list[dict]) -> list[int] | None:
        after = self.encode(self.render(history + new, tools, True))
        # Ids, not text: where the whole render segments the text otherwise than the stream did (at a junction: a
        # generation prompt ending in a space that merges with the sampled word after it, an end token that is no
        # special token merging with the newline after it; or a turn the model sampled in another segmentation than
        # the tokenizer's), the stream is not a prefix and the split is the truth. So is an end id the template never
        # renders (it ends turns on another token).
        if after[:len(stream)] == list(stream):
            return after[len(stream):]
        return self._after_turn(history, new, tools) if self.keep_sampled else None

    def _after_turn(self, history: list[dict], new: list[dict], tools: list[dict]) -> list[int] | None:
        """The ids the template renders after the last (assistant) turn's end token: the boundary, `new`
        and the generation prompt, whatever it makes of the turns before (None: no end token follows
        the marker, so the turn's end cannot be found)."""
        marked = [*history[:-1], {**history[-1], "content": TURN_MARKER}]
        text = self.render(marked + new, tools, True)
        at = text.find(TURN_MARKER)
        end = self.first_end(text, at) if at >= 0 else None
        return self.encode(text[end:]) if end is not None else None


class PlainFormat(ChatFormat):
    """Messages as lines of text, no role markers: for byte-level toy models without a template.
    A non-assistant message is its content and a newline; tools, when given, one opening line; an
    assistant turn is its content, its calls as the tool-call format writes them, and its end token. The stream is the format itself, never
    a render of the history (whose calls an opening writes in a form of its own): the bridge appends
    the new messages' lines and is never None."""

    name = "plain"

    def render(self, messages: list[dict], tools: list[dict], generation_prompt: bool) -> str:
        parts = ["tools: " + "; ".join(_tool_signature(tool) for tool in tools) + "\n"] if tools else []
        for message in messages:
            if message["role"] != "assistant":
                parts.append(f"{message.get('content') or ''}\n")
                continue
            calls = [entry.get("function", entry) for entry in message.get("tool_calls") or []]
            written = self.tool_calls.write([ToolCall(name=c["name"], arguments=c.get("arguments", {})) for c in calls])
            parts.append((message.get("content") or "") + written + self.end_texts[0])
        return "".join(parts)

    def bridge(self, stream: list[int], history: list[dict], new: list[dict], tools: list[dict]) -> list[int] | None:
        return self.encode(self.render(new, [], False))


def chat_format_for(name: str, tokenizer, eos_token_ids: tuple[int, ...], tool_calls: ToolCallFormat | None = None,
                    registry: Any = None, config: Any = None) -> ChatFormat:
    """The format `name`: "auto", "template" or "plain", or one a plugin registered (found in
    `registry`, built with `config`, its config class's defaults when None); "auto" takes the
    template when the tokenizer has one. `tool_calls`: how turns write their calls (None:
    `JSONInTags`). Raises ValueError with the fix for a name or tokenizer that cannot work."""
    if not eos_token_ids:
        raise ValueError("the policy has no end-of-turn id, so no turn can end; give its tokenizer an eos_token")
    if name not in FORMATS:
        found = registry.find(KIND, name) if registry is not None and name in registry.names(KIND) else None
        if found is None:
            known = [*FORMATS, *(n for n in (registry.names(KIND) if registry is not None else ()) if n not in FORMATS)]
            raise ValueError(f"unknown chat format {name!r}: use one of {', '.join(known)}")
        return found.factory(tokenizer, eos_token_ids, tool_calls, config=config if config is not None else found.config_class())
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if name == "template" and not has_template:
        raise ValueError("the tokenizer has no chat template: give it one (`chat_template` in its tokenizer_config.json, or "
                         "a chat_template.jinja file beside it), or set chat_format = \"plain\"")
    if name == "template" or (name == "auto" and has_template):
        return TemplateFormat(tokenizer, eos_token_ids, tool_calls)
    return PlainFormat(tokenizer, eos_token_ids, tool_calls)


def episode_format(settings, tokenizer, eos_token_ids: tuple[int, ...], registry) -> tuple[ChatFormat, str]:
    """The chat format an environment's `settings` (`StandardEpisode`) name, reading calls in their
    `tool_call_format` ("auto": the one the chat template writes, when the format renders with the
    template; `chosen_format`), and how that format was picked. A RecipeError located at the setting
    that cannot work."""
    choice = settings.chat_format  # a ComponentChoice in a recipe; a name (or None: "auto") outside one
    name = choice.component.name if hasattr(choice, "component") else (choice or "auto")
    try:
        chat = chat_format_for(name, tokenizer, eos_token_ids, registry=registry, config=getattr(choice, "config", None))
    except ValueError as exc:
        raise RecipeError([f"$.environment.chat_format: {exc}"]) from None
    try:
        found, how = chosen_format(settings.tool_call_format, tokenizer.chat_template if chat.name == "template" else None, registry)
    except ValueError as exc:
        raise RecipeError([f"$.environment.tool_call_format: {exc}"]) from None
    chat.tool_calls = found or chat.tool_calls
    chat.keep_sampled = settings.thinking_in_history == "kept"
    return chat, how


PROBE_TOOLS = [{"type": "function", "function": {"name": "probe_lookup", "description": "looks a word up",
                                                  "parameters": {"type": "object", "properties": {"word": {"type": "string"}},
                                                                 "required": ["word"]}}}]
PROBE_RESULT = "probe-result-4217: a small wild dog"
PROBE_OPENING = [{"role": "system", "content": "answer briefly"}, {"role": "user", "content": "what is a fox?"}]
# (the model's turn as a history records it, what the environment answers; None after the last turn)
PROBE_TURNS: list[tuple[dict, list[dict] | None]] = [
    ({"role": "assistant", "content": "",
      "tool_calls": [call_entry(ToolCall("probe_lookup", {"word": "fox"}))]},
     [{"role": "tool", "name": "probe_lookup", "content": PROBE_RESULT}]),
    ({"role": "assistant", "content": "a small wild dog"}, [{"role": "user", "content": "and a wolf?"}]),
    ({"role": "assistant", "content": "a large wild dog"}, None),
]
PROBE_THINK = "<think>\nsome reasoning\n</think>\n\n"  # how a reasoning model opens each turn of the second probe
_EMPTY_THINK = re.compile(r"<think>\s*</think>\s*")


@attrs.frozen
class TemplateAudit:
    """What `audit` found. `differences`: (position, stream id, render id) where the stream, after
    the first turn of the probe (written without a think block) where it was not a token prefix of the
    longer conversation rendered, differs from that render (None past the render's end)."""

    format: str  # "template" or "plain"
    mode: str  # "merge": every turn written without a think block extends the sample; "split": some start a new sample
    boundary_ids: tuple[int, ...]  # rendered after an assistant turn's end token, never sampled
    end_ids: tuple[int, ...]
    end_found: bool  # the template ends an assistant turn on one of the end ids
    split_turns: tuple[int, ...]  # turns, written without a think block, after which the next turn started a new sample
    think_split_turns: tuple[int, ...]  # the same, each turn opening with a think block
    parting: str  # where the stream and the render part at the first turn rewritten, for the printout
    think_parting: str  # the same at the first turn rewritten only with a think block
    tool_calls_rendered: bool
    tool_calls_read: bool  # a rendered call reads back as the call it was
    tool_content_rendered: bool
    stream_length: int  # ids of the stream `differences` compares, else of the last sample
    parted_after: int  # the turn after which `differences` were taken (0: none)
    differences: tuple[tuple[int, int, int | None], ...]
    tool_call_format: str = ""  # the tool-call format and how it was picked ("": parse_tool_calls's markup)
    thinking_in_history: str = "rendered"  # the setting the splits above were played with
    rewritten_turns: tuple[int, ...] = ()  # turns, written without a think block, after which the stream was not a prefix of the render
    think_rewritten_turns: tuple[int, ...] = ()  # the same, each turn opening with a think block
    think_costs: tuple[tuple[str, int, int], ...] = ()  # (setting, training samples, ids in them) of the probe written with think blocks

    @property
    def matches(self) -> bool:
        return not self.differences

    def lines(self) -> list[str]:
        """One line per finding, for the plan printout."""
        lines = [f"chat format: {self.format}" + (" (the tokenizer's chat template)" if self.format == "template"
                                                   else " (no chat template: each message a line of text, no role markers)")]
        if not self.end_found:
            lines.append(f"mode: split: the template ends an assistant turn on none of the end ids {list(self.end_ids)}, so no "
                         "bridge can follow a sampled end token and every turn starts a new training sample; add the template's "
                         "end-of-turn token to the generation config's eos_token_id")
        elif self.mode == "merge" and self.format == "plain":
            lines.append("mode: merge: the plain format only appends what nobody sampled, so an episode is one training sample")
        elif self.mode == "merge" and self.rewritten_turns:
            lines.append(f"mode: merge: turns are kept as sampled (thinking_in_history = \"kept\"): after {_turns(self.rewritten_turns)} of "
                         f"the probe the stream is not a token prefix of the longer conversation rendered ({self.parting}), and it goes "
                         "on as the model wrote it: an episode is one training sample, on a stream no render produces")
        elif self.mode == "merge":
            lines.append("mode: merge: when the model writes no think block, the stream at each turn (prompt, sampled ids, bridges) "
                         "is a token prefix of the longer conversation rendered: turns extend the sample, an episode is one training sample")
        else:
            lines.append(f"mode: split: after {_turns(self.split_turns)} of the probe the stream is not a token prefix of the longer "
                         f"conversation rendered ({self.parting}), so the next turn starts a new training sample from the "
                         "re-rendered conversation")
        only_think = tuple(t for t in self.think_rewritten_turns if t not in self.rewritten_turns)
        costs = {setting: f"{samples} training sample{'s' if samples > 1 else ''} of {ids} ids" for setting, samples, ids in self.think_costs}
        if self.format == "plain" or not self.end_found:
            pass
        elif not only_think:
            lines.append("think blocks: kept in the history: turns that open with <think>...</think> extend the sample as well")
        elif self.thinking_in_history == "kept":
            lines.append(f"think blocks: kept as sampled (thinking_in_history = \"kept\"): the template strips them from the history "
                         f"after {_turns(only_think)} of the probe ({self.think_parting}), but the stream goes on as the model wrote it: "
                         f"the probe makes {costs['kept']}, against {costs['rendered']} as rendered. Later turns are trained seeing "
                         "the earlier thinking, which the template hides from the deployed model")
        else:
            lines.append(f"think blocks: stripped from the history: when the model opens its turns with <think>...</think>, "
                         f"{_turns(only_think)} of the probe split, the next turn starting a new training sample ({self.think_parting}): "
                         f"the probe makes {costs['rendered']}, against {costs['kept']} with thinking_in_history = \"kept\"")
        lines.append(f"boundary after the end token: ids {list(self.boundary_ids)}, rendered, never sampled" if self.boundary_ids
                     else "boundary after the end token: none")
        lines.append("tool results: rendered" if self.tool_content_rendered
                     else "tool results: NOT rendered: the template drops tool messages' content, so the model never sees it")
        if self.tool_call_format:
            lines.append(f"tool-call format: {self.tool_call_format}")
        expected = (f"the {self.tool_call_format.split()[0]} format does not read it: set environment.tool_call_format to the one the "
                    "template writes" if self.tool_call_format else f"{CALL_OPEN}{{json}}{CALL_CLOSE} expected")
        if not self.tool_calls_rendered:
            lines.append("tool calls: not rendered by the template: the history shows the model's turns without its calls")
        else:
            lines.append("tool calls: rendered and read back" if self.tool_calls_read
                         else f"tool calls: rendered in a form the reader does not parse ({expected})")
        if self.matches:
            lines.append(f"stream vs the conversation rendered at once: a token prefix at every turn ({self.stream_length} ids "
                         "in the last sample)")
        else:
            shown = ", ".join(f"{p} (stream {s}, render {r})" for p, s, r in self.differences[:5])
            more = f" and {len(self.differences) - 5} more" if len(self.differences) > 5 else ""
            lines.append(f"stream vs the conversation rendered at once: after turn {self.parted_after}, {len(self.differences)} "
                         f"of the stream's {self.stream_length} ids differ, at {shown}{more}")
        return lines


def _turns(turns: tuple[int, ...]) -> str:
    return ("turn " if len(turns) == 1 else "turns ") + ", ".join(map(str, turns))


@attrs.frozen
class _Probe:
    """One play of the probe (see `audit`)."""

    splits: tuple[int, ...]
    rewritten: tuple[int, ...]  # turns after which the stream was not a token prefix of the render (split, or kept as sampled)
    partings: tuple[str, ...]  # for each turn rewritten
    samples: int  # training samples the probe made
    ids: int  # ids in them
    differences: tuple[tuple[int, int, int | None], ...]  # after the first turn whose stream was not a prefix of the render
    stream_length: int
    parted_after: int
    end_found: bool
    calls_rendered: bool
    calls_read: bool
    boundary: tuple[int, ...]
    rendered: str  # the whole conversation


def _written(chat: ChatFormat, history: list[dict], message: dict, tools: list[dict], think: bool) -> tuple[list[int], bool]:
    """The ids a model of the template's family samples for `message` (opening with a think block when
    `think`), and whether its end id was found: the template's render of it as the last turn, from
    the generation prompt to the end token. Without `think`, an empty think block the template puts
    before a last turn (Qwen3's) is left out: such a model does not write it."""
    if think:
        message = {**message, "content": PROBE_THINK + message["content"]}
    prompt, whole = chat.render(history, tools, True), chat.render(history + [message], tools, False)
    text = whole[len(prompt):] if whole.startswith(prompt) else message["content"]
    empty = None if think else _EMPTY_THINK.match(text)
    text = text[empty.end():] if empty else text
    end = chat.after_end(text)
    sampled = chat.encode(text[:end] if end is not None else text)
    if not sampled or sampled[-1] not in chat.eos_token_ids:
        sampled.append(chat.eos_token_ids[0])
    return sampled, end is not None


def _pieces(chat: ChatFormat, ids: list[int]) -> str:
    """Ids as the text of each, so that a segmentation shows."""
    return " + ".join(repr(chat.decode([i])) for i in ids) or "nothing"


def _play(chat: ChatFormat, think: bool) -> _Probe:
    """The probe played as `EpisodeRunner` plays an episode: the sampled ids, then the bridge, or a
    new sample where there is none."""
    tools, history = PROBE_TOOLS, list(PROBE_OPENING)
    sample = chat.opening(history, tools)
    splits: list[int] = []
    rewritten: list[int] = []
    partings: list[str] = []
    lengths: list[int] = []  # of the finished samples
    differences: tuple[tuple[int, int, int | None], ...] = ()
    end_found, calls_rendered, calls_read, boundary, compared, parted_after = True, True, True, (), 0, 0
    for turn, (message, answer) in enumerate(PROBE_TURNS, 1):
        sampled, found = _written(chat, history, message, tools, think)
        end_found &= found
        sample += sampled
        recorded = chat.assistant_message(chat.read(sampled, turn, tools))
        if message.get("tool_calls"):
            calls_rendered = "probe_lookup" in chat.decode(sampled)
            calls_read = recorded.get("tool_calls") == message["tool_calls"]
        history.append(recorded)
        if turn == 1:
            rendered = chat.render(history, tools, False)
            cut = chat.after_end(rendered)
            boundary = tuple(chat.encode(rendered[cut:])) if cut is not None else ()
        if answer is None:
            break
        bridge = chat.bridge(sample, history, answer, tools)
        history += answer
        render = chat.opening(history, tools)  # the template's bridge is the same comparison; the plain one makes none
        at = [i for i in range(len(sample)) if i >= len(render) or sample[i] != render[i]]
        if at and not parted_after:
            differences, compared, parted_after = tuple((i, sample[i], render[i] if i < len(render) else None) for i in at), len(sample), turn
        if at and (bridge is None or not rewritten):  # a stream kept as sampled stays unlike the render: its first turn counts
            first = at[0]
            partings.append(f"at id {first} the stream has {_pieces(chat, sample[first:first + 6])} where the render has "
                            f"{_pieces(chat, render[first:first + 6])}")
            rewritten.append(turn)
        if bridge is not None:
            sample += bridge
            continue
        splits.append(turn)
        lengths.append(len(sample))
        sample = render
    return _Probe(splits=tuple(splits), rewritten=tuple(rewritten), partings=tuple(partings), samples=len(lengths) + 1,
                  ids=sum(lengths) + len(sample), differences=differences, stream_length=compared or len(sample), parted_after=parted_after,
                  end_found=end_found, calls_rendered=calls_rendered, calls_read=calls_read, boundary=boundary,
                  rendered=chat.render(history, tools, False))


def audit(tokenizer, eos_token_ids: tuple[int, ...], name: str = "auto", tool_calls: ToolCallFormat | None = None,
          tool_call_format: str = "", thinking_in_history: str = "rendered", chat: ChatFormat | None = None) -> TemplateAudit:
    """Plays the probe conversation (a tool call and its result, an answer, another user message)
    the way an episode does, through the runner's bridge, twice: each turn's ids as a model of the
    template's family writes them (the template's render of that turn), without a think block, then
    with one (`PROBE_THINK`) opening each turn, which some templates strip from the history. The
    calls are read in `tool_calls`, picked as `tool_call_format` says (`rlkit_core.tool_call_formats.chosen_format`).
    The splits are those of `thinking_in_history`; the probe with think blocks is played with both
    settings, for what each costs. `chat`: the format to play, built already (a registered one); else `name`'s."""
    chat = chat or chat_format_for(name, tokenizer, eos_token_ids, tool_calls)
    plays = {}
    for setting in ("rendered", "kept"):
        chat.keep_sampled = setting == "kept"
        plays[setting] = (_play(chat, False), _play(chat, True))
    plain, thinking = plays[thinking_in_history]
    rendered, rendered_thinking = plays["rendered"]
    only_think = [p for t, p in zip(rendered_thinking.rewritten, rendered_thinking.partings) if t not in rendered.rewritten]
    return TemplateAudit(format=chat.name, mode="split" if plain.splits else "merge", boundary_ids=plain.boundary,
                         end_ids=chat.eos_token_ids, end_found=plain.end_found, split_turns=plain.splits,
                         think_split_turns=thinking.splits, parting=rendered.partings[0] if rendered.partings else "",
                         think_parting=only_think[0] if only_think else "", tool_calls_rendered=plain.calls_rendered,
                         tool_calls_read=plain.calls_read, tool_content_rendered=PROBE_RESULT in plain.rendered,
                         stream_length=rendered.stream_length, parted_after=rendered.parted_after, differences=rendered.differences,
                         tool_call_format=tool_call_format, thinking_in_history=thinking_in_history, rewritten_turns=rendered.rewritten,
                         think_rewritten_turns=rendered_thinking.rewritten,
                         think_costs=tuple((setting, play[1].samples, play[1].ids) for setting, play in plays.items()))
