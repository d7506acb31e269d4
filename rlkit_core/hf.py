"""Rules shared by the transformers-backed plugins (a helper module of the plugin API): rlkit's PAD,
the weight dtypes by name, what a model's config says about its context and its FSDP units, and
loading tokenizers for checks with located errors and no surprise downloads.

`rlkit check` compares the tokenizers of the parts that must agree (policy and critic) and makes
sure a reward model's tokenizer loads, before anything heavy starts. With `--offline` (the
`HF_HUB_OFFLINE` switch of huggingface_hub) a hub name that is not in the local cache is skipped
and said to be unchecked, instead of failing the check.
"""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path

import torch

PAD_TOKEN = "<|rlkit_pad|>"  # the PAD rlkit adds to a tokenizer that has none of its own
# What transformers raises for a model or tokenizer it cannot load; UnpicklingError: a .bin weights
# file that holds more than tensors (it is read with weights_only=True, so nothing in it runs).
LOAD_ERRORS = (OSError, ValueError, pickle.UnpicklingError)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # a `dtype` setting's words
# where transformers' configs keep the longest sequence the model takes, by architecture
CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "seq_length", "max_sequence_length")


def context_length(model_config) -> int | None:
    """The longest prompt + response a model takes (`Policy.context_length`), from its config; None
    when the config names none (a model with relative positions, say)."""
    for field in CONTEXT_FIELDS:
        value = getattr(model_config, field, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def shard_units(model: torch.nn.Module) -> list[type]:
    """The classes of `model`'s blocks that FSDP shards each as one unit (`Policy.shard_units`):
    those transformers names in the model's `_no_split_modules`, in its order."""
    names = list(getattr(model, "_no_split_modules", None) or [])
    found = {type(module).__name__: type(module) for module in model.modules()}
    return [found[name] for name in names if name in found]


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


def could_be_hub_name(name: str) -> bool:
    """`name` or `owner/name` in the hub's letters; anything else can only be a local path."""
    return re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name) is not None and not name.startswith(".")


def missing_path(name: str) -> bool:
    """Whether `name` can only be a local path (not a hub name) and nothing is there."""
    return not Path(name).expanduser().exists() and (is_local(name) or not could_be_hub_name(name))


# what to do about a local folder that holds no model or tokenizer (yet: a warm start may still be writing it)
UNFINISHED_FOLDER_FIX = "give a folder that save_pretrained wrote, or wait until the one being written there is whole"


def load_problem(name: str, where: str, what: str, error: Exception | None = None) -> str:
    """Why `name` could not be loaded as `what` (a model, a tokenizer), with the fix: a located
    sentence instead of transformers' traceback."""
    if missing_path(name):
        return f"{where}: no directory {name!r}; give a local model directory (relative paths start at the working directory) or a hub name"
    folder = Path(name).expanduser()
    if folder.is_dir() and not any(folder.iterdir()):
        return f"{where}: {name!r} is an empty folder; {UNFINISHED_FOLDER_FIX}"
    if isinstance(error, pickle.UnpicklingError):
        return (f"{where}: {name!r} has a pickled weights file that holds more than tensors; rlkit loads pickles only "
                "as plain tensors (weights_only), so none of its code ran. Use a model saved as safetensors, or one you trust re-saved so")
    reason = f": {str(error).splitlines()[0]}" if error is not None else ""
    if Path(name).expanduser().exists():
        return f"{where}: cannot load {what} from {name!r}{reason}; give a transformers model folder (config.json, weights, tokenizer files)"
    hub = "HF_HUB_OFFLINE is set, so only the local cache is read" if offline() else "reading the hub needs network"
    return (f"{where}: {name!r} is not a local directory, and as a hub name {what} did not load ({hub}){reason}; "
            "give a local model directory or a hub name that exists")


def model_folder_problem(name: str, where: str) -> str | None:
    """Why `name` holds no model, found before transformers reads it (whose errors for these name
    neither the folder nor the fix): nothing there, an empty folder, or a folder without
    config.json (nor a LoRA adapter's); None otherwise, a hub name included (only loading checks
    one)."""
    folder = Path(name).expanduser()
    if missing_path(name) or (folder.is_dir() and not any(folder.iterdir())):
        return load_problem(name, where, "a model")
    if folder.is_dir() and not any((folder / config).is_file() for config in ("config.json", "adapter_config.json")):
        return f"{where}: {name!r} has no config.json, so it holds no transformers model; {UNFINISHED_FOLDER_FIX}"
    return None


def check_tokenizer(name: str, where: str, problems: list[str], notes: list[str], trust_remote_code: bool = False):
    """The tokenizer `name`, or None with a located problem (it cannot be loaded) or a note (a hub
    name that `--offline` leaves unchecked)."""
    from transformers import AutoTokenizer

    if missing_path(name):
        problems.append(load_problem(name, where, "a tokenizer"))
        return None
    try:
        return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        if offline() and not Path(name).expanduser().exists():
            notes.append(f"{where}: {name!r} is a hub name not in the local cache; not checked offline")
        else:
            problems.append(load_problem(name, where, "a tokenizer", exc))
        return None


def check_model(model: str, tokenizer: str, where: str, problems: list[str], notes: list[str],
                trust_remote_code: bool = False):
    """The tokenizer of the model that the table at `where` names by its `model` and `tokenizer`
    settings (`tokenizer` empty: the model's), or None with located problems or notes: the model's
    folder (`model_folder_problem`), then the tokenizer (`check_tokenizer`), one problem for a folder
    that is both."""
    problem = model_folder_problem(model, f"{where}.model")
    if problem:
        problems.append(problem)
        if not tokenizer:
            return None
    setting = f"{where}.tokenizer" if tokenizer else f"{where}.model"
    return check_tokenizer(tokenizer or model, setting, problems, notes, trust_remote_code)


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
