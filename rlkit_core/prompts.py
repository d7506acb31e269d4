"""From prompt records to the policy's left-padded prompt ids: plain text or chat, within a length.

A record carries either a `prompt` string or `messages` (a list of {"role", "content"} dicts). A
conversation is rendered with the policy's chat template, ending in the assistant's turn
(`add_generation_prompt`); the rendered text becomes the record's `prompt`, and `messages` stays a
column, so a reward sees both. Prompts longer than the data table's `max_prompt_tokens` (or than
the policy's context leaves room for beside the longest response) are cut from the left, skipped,
or refused, as its `truncate` says; empty prompts are skipped; the run reports how many of each.
"""

from __future__ import annotations

import attrs
import torch

from rlkit_core.config import at_least, one_of, setting
from rlkit_core.errors import RecipeError


@attrs.frozen
class PromptLengthLimit:
    """Settings every built-in prompt source shares; a prompt source's config class inherits them."""

    max_prompt_tokens: int = setting(0, help="longest prompt in policy tokens (0: no limit)", validator=at_least(0), kw_only=True)
    truncate: str = setting("left", help="a longer prompt: 'left' keeps its end, 'skip' drops it, 'error' stops the run",
                            validator=one_of("left", "error", "skip"), kw_only=True)


def is_chat(record: dict) -> bool:
    return record.get("messages") is not None


def render(tokenizer, record: dict, where: str) -> str:
    """The prompt text the policy continues: the record's own, or its conversation rendered."""
    if not is_chat(record):
        return record["prompt"]
    if not getattr(tokenizer, "chat_template", None):
        raise RecipeError([f"{where}: the record holds `messages` but the policy's tokenizer has no chat template; "
                           "use a chat model's tokenizer (policy.tokenizer) or give plain `prompt` strings"])
    return tokenizer.apply_chat_template(record["messages"], add_generation_prompt=True, tokenize=False)


def prompt_token_ids(tokenizer, record: dict) -> list[int]:
    """The policy's ids of a prepared record. A rendered conversation already holds its special
    tokens; plain text gets the tokenizer's, less a trailing EOS (ByT5 and T5 append one, and a
    prompt that already ended would teach the policy to stop at once)."""
    ids = tokenizer(record["prompt"], add_special_tokens=not is_chat(record))["input_ids"]
    if ids and ids[-1] == tokenizer.eos_token_id and not is_chat(record):
        ids = ids[:-1]
    return ids


def within_context(limit: PromptLengthLimit | None, context: int | None, new_tokens: int) -> PromptLengthLimit | None:
    """The data's length limit, tightened so that a prompt and its longest response (the generator's
    `max_new_tokens`) fit in the policy's context (`context` positions); a longer one would fail
    deep inside the model mid-run."""
    if not context or not new_tokens:
        return limit
    room = context - new_tokens
    if room < 1:
        raise RecipeError([f"$.generator.max_new_tokens: {new_tokens} leaves no room for a prompt in the policy's context "
                           f"of {context} positions; lower it"])
    limit = limit or PromptLengthLimit()
    if limit.max_prompt_tokens > room:
        raise RecipeError([f"$.data.max_prompt_tokens: {limit.max_prompt_tokens} prompt tokens and {new_tokens} response tokens "
                           f"(generator.max_new_tokens) do not fit in the policy's context of {context} positions; set it to {room} or less"])
    return limit if limit.max_prompt_tokens else attrs.evolve(limit, max_prompt_tokens=room)


def prepare_prompts(records: list[dict], tokenizer, limit: PromptLengthLimit | None) -> tuple[list[dict], dict[str, int]]:
    """Records with rendered `prompt` text, within the length limit; and counts for the report
    (loaded, cut, skipped, empty: a prompt of no tokens gives the policy nothing to continue)."""
    prepared, cut, skipped, empty = [], 0, 0, 0
    max_tokens = limit.max_prompt_tokens if limit else 0
    for index, record in enumerate(records):
        record = {**record, "prompt": render(tokenizer, record, f"$.data: record {index}")}
        length = len(prompt_token_ids(tokenizer, record))
        if not length:
            empty += 1
            continue
        if limit and max_tokens and length > max_tokens:
            if limit.truncate == "error":
                raise RecipeError([f"$.data.max_prompt_tokens: record {index} has {length} prompt tokens, over the limit "
                                   f"of {max_tokens}; raise the limit, or set data.truncate = 'left' or 'skip'"])
            if limit.truncate == "skip":
                skipped += 1
                continue
            cut += 1
        prepared.append(record)
    if not prepared and empty == len(records):
        raise RecipeError([f"$.data: every one of the {len(records)} prompts is empty"])
    if not prepared:
        raise RecipeError([f"$.data.max_prompt_tokens: every one of the {len(records)} prompts is empty or longer than "
                           f"{max_tokens} tokens; raise the limit or set data.truncate = 'left'"])
    return prepared, {"loaded": len(records), "cut": cut, "skipped": skipped, "empty": empty}


def encode_prompts(tokenizer, records: list[dict], device, max_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, P] left-padded prompt ids and mask of prepared records; longer prompts keep their last
    `max_tokens` ids (0: no limit)."""
    rows = [prompt_token_ids(tokenizer, record) for record in records]
    if max_tokens:
        rows = [row[-max_tokens:] for row in rows]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row):] = torch.tensor(row)
            mask[i, width - len(row):] = 1
    return ids.to(device), mask.to(device)
