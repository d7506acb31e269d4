"""Tokenizer rules shared by the transformers-backed plugins: rlkit's PAD, and loading tokenizers
for checks with located errors and no surprise downloads.

`rlkit check` compares the tokenizers of the parts that must agree (policy and critic) and makes
sure a reward model's tokenizer loads, before anything heavy starts. With `--offline` (the
`HF_HUB_OFFLINE` switch of huggingface_hub) a hub name that is not in the local cache is skipped
and said to be unchecked, instead of failing the check.
"""

from __future__ import annotations

import os
from pathlib import Path


PAD_TOKEN = "<|rlkit_pad|>"  # the PAD rlkit adds to a tokenizer that has none of its own


def settle_pad(tokenizer, eos_token_ids) -> bool:
    """Give the tokenizer a PAD that ends no response; True when rlkit had to add one.

    GPT-2, Pythia and Llama have no PAD, or use an end token as PAD; a shared id would make
    padding indistinguishable from a response that ended, so rlkit adds its own token."""
    if tokenizer.pad_token_id is not None and tokenizer.pad_token_id not in eos_token_ids:
        return False
    tokenizer.add_special_tokens({"pad_token": PAD_TOKEN})
    return True


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def is_local(name: str) -> bool:
    return Path(name).exists() or name.startswith((".", "/", "~"))


def check_tokenizer(name: str, where: str, problems: list[str], notes: list[str], trust_remote_code: bool = False):
    """The tokenizer `name`, or None with a located problem (it cannot be loaded) or a note (a hub
    name that `--offline` leaves unchecked)."""
    from transformers import AutoTokenizer

    if is_local(name) and not Path(name).expanduser().exists():
        problems.append(f"{where}: no directory {name!r}; give a local model directory or a hub name")
        return None
    try:
        return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        if offline() and not is_local(name):
            notes.append(f"{where}: {name!r} is a hub name not in the local cache; not checked offline")
        else:
            problems.append(f"{where}: cannot load a tokenizer from {name!r}: {str(exc).splitlines()[0]}")
        return None


def vocabulary_mismatch(expected, actual, ignore: tuple[str, ...] = ()) -> str | None:
    """A sentence naming the first token whose id differs between two tokenizers, or None when every
    token of `expected` (but the `ignore`d ones) has the same id in `actual`."""
    theirs = actual.get_vocab()
    for token, index in sorted(expected.get_vocab().items(), key=lambda item: item[1]):
        if token in ignore:
            continue
        if theirs.get(token) != index:
            found = "absent" if token not in theirs else f"id {theirs[token]}"
            return f"token {token!r} is id {index} for the policy but {found} there"
    return None
