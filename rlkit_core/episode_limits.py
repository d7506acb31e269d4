"""The episode settings rlkit reads from an environment's config: the words a recipe bounds an
episode with, which every environment takes by inheriting them (the registry refuses a config that
does not)."""

from __future__ import annotations

import attrs

from rlkit_core.config import at_least, greater_than, nested_component, one_of, setting
from rlkit_core.records import ComponentChoice


@attrs.frozen
class StandardEpisode:
    """Turns, tokens, timeouts, call threads, whether turns wait for each other, the chat format, its
    treatment of rewritten turns and the tool-call format: the bounds of an episode, which the
    core's episode runner enforces (the environment never sees a token), and how turns are rendered
    and read. Keyword-only, so that a subclass may add settings without a default."""

    max_turns: int = setting(4, help="most model turns in an episode", validator=greater_than(0), kw_only=True)
    max_episode_tokens: int = setting(256, help="most tokens after the first prompt, sampled and environment alike (0: the response limit "
                                                "times the turns)", validator=at_least(0), kw_only=True)
    step_timeout_s: float = setting(10.0, help="seconds a reset or step may take (0: no limit)", validator=at_least(0), kw_only=True)
    episode_timeout_s: float = setting(60.0, help="seconds an episode may take from its reset, checked between turns (0: no limit)",
                                       validator=at_least(0), kw_only=True)
    call_threads: int = setting(64, help="threads that run reset and step calls at once; a call that hangs past step_timeout_s holds "
                                         "its thread until it returns, and when every one is held the run stops",
                                validator=greater_than(0), kw_only=True)
    turn_barrier: bool = setting(True, help="true: each turn, every running episode is generated at once, after every environment has "
                                            "answered the turn before (runs repeat to the last digit); false: an episode's next turn is "
                                            "generated as soon as its environment answers, joining the decoding in progress, so a slow "
                                            "step holds only its own episode (which episodes share a generation then depends on timing, "
                                            "so runs do not repeat exactly)", kw_only=True)
    chat_format: ComponentChoice | None = nested_component(
        "chat_format", help="how messages become tokens: 'template' (the tokenizer's chat template), 'plain' (text lines), another "
                            "registered format, or 'auto' (the template when the tokenizer has one)", default_type="auto", kw_only=True)
    thinking_in_history: str = setting(
        "rendered", help="how the model's earlier turns stand in its later prompts when the chat template would rewrite them (Qwen3's "
                         "drops the think blocks of turns before the last user message): 'rendered' (as the template renders them, "
                         "as the model sees them when deployed: that turn starts a new training sample) or 'kept' (as sampled: the "
                         "stream goes on, one sample an episode, and later turns are trained seeing the earlier thinking)",
        validator=one_of("rendered", "kept"), kw_only=True)
    tool_call_format: ComponentChoice | None = nested_component(
        "tool_call_format", help="the markup the model writes tool calls in: 'hermes' (<tool_call>{json}</tool_call>), 'qwen3-coder', "
                                 "'llama3-json', 'glm45', another registered format, or 'auto' (the one the chat template writes, else hermes)",
        default_type="auto", kw_only=True)
