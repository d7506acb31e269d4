"""What an environment and the core say to each other over an episode: messages, never token ids.

A message is a dict as chat templates take them: `{"role": "user" | "assistant" | "tool" |
"system", "content": str}`, a tool message with `"name"` (the tool's), an assistant message with
`"tool_calls"`. The core turns messages into tokens (`rlkit_core.chat_format`) and keeps the ids
the model sampled as it sampled them; the environment reads the model's turn as a `Reply`.
"""

from __future__ import annotations

from typing import Any

import attrs

# How an episode ended. "ok": the environment said done (or the turns ran out). "cut_off": a turn
# reached the generator's max_new_tokens before its end token; "overflow": the episode's token
# budget ran out. Both are the model's doing: the episode trains as a single-turn response that
# never ended does (the rewards it got, less `ppo.missing_eos_penalty`; set the penalty so that
# rambling costs at least what failing the task would). "timeout": a step or the episode took too long; "error": the environment raised or
# broke its contract. Those are the environment's faults: the episode is kept out of training and
# counted, never scored.
STATUSES = ("ok", "cut_off", "overflow", "timeout", "error")
TRAINED_STATUSES = ("ok", "cut_off", "overflow")


@attrs.frozen
class ToolCall:
    name: str
    arguments: dict[str, Any]


@attrs.frozen
class Reply:
    """The model's turn as the environment reads it. `text` is decoded for reading only."""

    text: str  # the turn's text without its end token; tool-call markup left in
    turn: int  # 1 for the first turn of the episode
    tool_calls: tuple[ToolCall, ...] = ()  # the calls the chat format read from `text`
    # why a tool call could not be read (bad JSON, no name): the environment tells the model so;
    # the call is not made and the runner counts it (`env/unreadable_tool_calls`)
    parse_error: str | None = None
    # the turn's ids as the generator sampled them (its end token included) and their log-probs:
    # what an endpoint hands a harness that asks for tokens; never read back into the stream
    ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    # the turn as the conversation records it (`ToolCallFormat.assistant_message`: its content and
    # the calls read from it), which the chat template renders back
    message: dict[str, Any] = attrs.field(factory=dict)
    # the weights that sampled the turn (`Policy.weights_version`: the run's iterations done when they were current)
    weights_version: int = 0
    # the ids the model was given for the turn: its sample's stream before it (an endpoint's `usage.prompt_tokens`)
    prompt_tokens: int = 0


@attrs.frozen
class Reset:
    """The start of an episode: the opening messages, and the environment's own state for it
    (handed back to every `step` of the episode, so one environment serves many at once)."""

    messages: list[dict[str, Any]]
    state: Any = None
    # the episode's numbers until a step says otherwise ({"won": 0.0}), so that an episode the
    # model cut off before the environment could answer still counts in `env/won`
    info: dict[str, float] = attrs.field(factory=dict)
    # the tools this episode's model may call, as JSON schemas; None: the environment's `tools()`
    # (an agent whose harness names its tools per conversation sets them per episode)
    tools: list[dict[str, Any]] | None = None


@attrs.frozen
class Step:
    """What the environment answers to a reply."""

    messages: list[dict[str, Any]] = attrs.field(factory=list)  # what it says next (user or tool messages)
    reward: float | None = None  # this turn's reward, at the turn's last sampled token
    done: bool = False
    # "ok", or "error" when the environment cannot go on with this episode (its fault, not the model's)
    status: str = "ok"
    # numbers about the episode, each replacing the one of that name the reset or an earlier step
    # gave; those standing when it ends are averaged into `env/<name>` and `eval/<name>` ("won": 1.0)
    info: dict[str, float] = attrs.field(factory=dict)
    # the whole conversation so far, when the environment changed what came before (an agent's
    # harness that edited or dropped earlier messages); None: `messages` extend it. The next turn
    # then starts a new training sample from this conversation rendered, counted in `env/splits`
    history: list[dict[str, Any]] | None = None
    # True: the environment never saw this turn (an agent's harness returned while it was sampled). The
    # turn is cut from the episode with what was said before it, never trained; `reward` is paid at the
    # turn before it, and the episode ends
    unseen: bool = False
