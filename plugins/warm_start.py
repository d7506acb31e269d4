"""The warm-start policy of the toy recipes: a tiny byte-level GPT-2, briefly supervised on a
task's examples before RL, built once and cached. A task subclasses `WarmStartPolicy` with the
examples it supervises on; this module imports no task.

``build_warm_start`` creates a randomly initialised model (by default a ``GPT2LMHeadModel`` over the
``ByT5Tokenizer`` byte vocabulary; a task may bring its own tokenizer and architecture) and
fine-tunes it (SFT) on the task's examples: token ids, and which of them the
loss counts (what the model is to say, never the prompt). The model and the tokenizer are saved
together, so ``AutoModelForCausalLM.from_pretrained(path)`` and ``AutoTokenizer.from_pretrained(path)``
work offline.

Padding: batches are right-padded for SFT, so positions start at 0 for every row without any
position_ids bookkeeping.

The build is written to a hidden temporary directory beside ``out_dir`` and renamed into place
only when complete, with a ``warm_start.json`` recording its settings, the task's ``corpus``
among them. A later call with the same settings reuses the directory; with different settings it
rebuilds and replaces it. A directory at ``out_dir`` that lacks ``warm_start.json`` is not ours and
is never touched. (Bump the ``format`` number in ``build_warm_start`` whenever the training loop
changes, and a task's ``corpus`` whenever its examples do, so old builds are not reused.)
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import tempfile
import time
from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import torch

from rlkit_core import (
    ComponentChoice,
    Policy,
    PolicySettings,
    Progress,
    RecipeError,
    at_least,
    building_at,
    greater_than,
    setting,
)

MARKER_FILE = "warm_start.json"
PAD_ID = 0
EOS_ID = 1
VOCAB_SIZE = 384
N_POSITIONS = 256

Example = tuple[list[int], list[bool]]  # token ids, and which of them the loss counts


def _tokenizer():
    from transformers import ByT5Tokenizer

    return ByT5Tokenizer()


def _collate_right_padded(batch: Sequence[Example]):
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    for row, (ids, counted) in enumerate(batch):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
        labels[row, : len(ids)] = torch.where(torch.tensor(counted), torch.tensor(ids), -100)
    return input_ids, attention_mask, labels


def _existing_settings(path: Path) -> dict | None:
    try:
        return json.loads((path / MARKER_FILE).read_text())["settings"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def byte_level_gpt2(n_layer: int, n_embd: int, n_head: int):
    """(tokenizer, model) of the toy recipes: the file-free ByT5 byte tokenizer and a fresh GPT-2."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB_SIZE, n_positions=N_POSITIONS, n_embd=n_embd, n_layer=n_layer,
        n_head=n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=EOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
    )
    model = GPT2LMHeadModel(config)
    model.generation_config.pad_token_id = PAD_ID
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.bos_token_id = EOS_ID
    return _tokenizer(), model


def build_warm_start(
    out_dir: str | os.PathLike,
    examples: Callable[[Any, int, int], list[Example]],
    corpus: Mapping[str, Any],
    *,
    make: Callable[[int, int, int], tuple[Any, Any]] = byte_level_gpt2,
    n_layer: int = 2,
    n_embd: int = 128,
    n_head: int = 4,
    sft_steps: int = 800,
    batch_size: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
    corpus_size: int = 20000,
    progress=None,
) -> Path:
    """Build (or reuse) the warm-start policy at ``out_dir``; return its path.

    ``examples(tokenizer, corpus_size, seed)`` makes the task's supervised examples (only when it
    builds); ``corpus`` is what they depend on besides their number and seed, recorded with the
    build. SFT: AdamW (``lr``, weight decay 0.01, betas (0.9, 0.95)), linear warm-up over the
    first 10% of ``sft_steps`` then constant, gradient norm clipped at 1.0, ``batch_size`` examples
    per step drawn without replacement (reshuffled each epoch).
    ``progress`` (an ``rlkit_core.progress.Progress``) shows the step, loss and time left.
    ``make(n_layer, n_embd, n_head)`` gives the tokenizer and the fresh model, its generation
    config set (default: ``byte_level_gpt2``); the examples' length limit is the model's context.

    Builders of one ``out_dir`` take turns through a lock file beside it, so the processes of a
    multi-process launch (or two runs started together) build it once and the others reuse it.
    """
    from filelock import FileLock

    out = Path(out_dir)
    settings = {"format": 1, "n_layer": n_layer, "n_embd": n_embd, "n_head": n_head, "sft_steps": sft_steps,
                "batch_size": batch_size, "lr": lr, "seed": seed, "corpus_size": corpus_size, **corpus}
    out.parent.mkdir(parents=True, exist_ok=True)
    # Its own random stream: a run that builds the warm start must continue with the same draws
    # (critic initialisation, sampling) as a later run that finds it cached.
    with FileLock(out.parent / f".{out.name}.lock"), torch.random.fork_rng(devices=[]):
        return _build(out, settings, examples, make, progress)


def _build(out: Path, settings: dict, examples: Callable[[Any, int, int], list[Example]], make, progress) -> Path:
    """`build_warm_start`'s work, with the lock held."""
    n_layer, n_embd, n_head, sft_steps, batch_size, lr, seed, corpus_size = (settings[k] for k in (
        "n_layer", "n_embd", "n_head", "sft_steps", "batch_size", "lr", "seed", "corpus_size"))
    if out.exists():
        existing = _existing_settings(out)
        if existing is None:
            raise FileExistsError(f"{out} exists and is not a warm-start directory; not touching it")
        if existing == settings:
            return out
    if sft_steps < 0 or batch_size < 1 or corpus_size < 1:
        raise ValueError("sft_steps >= 0, batch_size >= 1 and corpus_size >= 1 are required")

    started = time.perf_counter()
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer, model = make(n_layer, n_embd, n_head)
    made = examples(tokenizer, corpus_size, seed)  # after the model's initial weights: the streams stay as they were
    context = model.config.max_position_embeddings
    if any(len(ids) > context for ids, _ in made):
        raise ValueError(f"an example exceeds the model's context of {context} positions")

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = max(1, sft_steps // 10)
    # (s + 1) / warmup, not transformers' constant-with-warmup (s / warmup: no update at step 0, another warm start)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    model.train()
    order: list[int] = []
    losses: list[float] = []
    for step in range(sft_steps):
        if len(order) < batch_size:
            fresh = list(range(len(made)))
            rng.shuffle(fresh)
            order.extend(fresh)
        picked, order = order[:batch_size], order[batch_size:]
        input_ids, attention_mask, labels = _collate_right_padded([made[i] for i in picked])
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if progress is not None:
            progress.show(step + 1, f"loss {losses[-1]:.4f}")
    if progress is not None:
        progress.close()
    model.eval()

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tail = losses[-max(1, len(losses) // 10):]
        info = {
            "settings": settings,
            "sft_seconds": round(time.perf_counter() - started, 2),
            "final_loss": (sum(tail) / len(tail)) if losses else None,
            "n_params": sum(p.numel() for p in model.parameters()),
        }
        (tmp / MARKER_FILE).write_text(json.dumps(info, indent=2) + "\n")
        if out.exists():  # ours, with other settings (checked above): swap it out
            trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, trash / "old")
            os.replace(tmp, out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def default_cache_dir() -> str:
    return str(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rlkit")


@attrs.frozen
class WarmStartConfig(PolicySettings):
    """The model is built, not named (no `ModelSettings`); `dtype` and `gradient_checkpointing` act on it during RL."""

    cache_dir: str = setting(factory=default_cache_dir, help="where the warm-start model is built once and reused")
    n_layer: int = setting(2, help="transformer layers", validator=greater_than(0))
    n_embd: int = setting(128, help="model width", validator=greater_than(0))
    n_head: int = setting(4, help="attention heads (must divide n_embd)", validator=greater_than(0))
    sft_steps: int = setting(800, help="supervised steps of the warm start (too few leave PPO no good behaviour to reinforce)", validator=at_least(0))
    sft_batch_size: int = setting(32, help="examples per supervised step", validator=greater_than(0))
    sft_learning_rate: float = setting(3e-3, help="AdamW learning rate of the supervised warm start", validator=greater_than(0))
    seed: int = setting(0, help="seed of the initial weights and the supervised data order")


class WarmStartPolicy(Policy):
    """Build the warm start on first use (minutes on two CPU cores), then load it with the installed
    `hf` policy (found in the registry, as any plugin finds another's component) and pass every
    call on to it. A task subclasses it with its supervised examples (`examples`), what they depend
    on (`corpus`) and the name of its cache folder (`folder_name`)."""

    packs_sequences = True  # as the `hf` policy it passes its calls on to

    @staticmethod
    @abstractmethod
    def folder_name(config) -> str:
        """The cache folder of the build these settings make."""

    @staticmethod
    @abstractmethod
    def corpus(config) -> dict[str, Any]:
        """What the examples depend on besides their number and seed, recorded with the build: a build
        recorded with other values is made again."""

    @staticmethod
    @abstractmethod
    def examples(config, tokenizer, size: int, seed: int) -> list[Example]:
        """`size` supervised examples, drawn from `seed`, in the ids of `tokenizer` (`model_maker`'s)."""

    @staticmethod
    def model_maker(config) -> Callable[[int, int, int], tuple[Any, Any]]:
        """What makes the tokenizer and the fresh model (`build_warm_start`'s `make`): the byte-level
        GPT-2 unless a task brings its own."""
        return byte_level_gpt2

    def __init__(self, config: WarmStartConfig, context):
        where = building_at(context, "policy")
        if config.n_embd % config.n_head:
            raise RecipeError([f"{where}.n_head: {config.n_head} does not divide n_embd={config.n_embd}"])
        loader = context.registry.find("policy", "hf") if context.registry is not None else None
        if loader is None:
            raise RecipeError([f"{where}.type: {type(self).__name__} loads its model with the 'hf' policy, which is not installed"])
        folder = Path(config.cache_dir) / self.folder_name(config)
        if not (folder / MARKER_FILE).exists():
            print(f"rlkit: building the warm-start policy in {folder} (once; later runs reuse it)", file=sys.stderr, flush=True)
        path = build_warm_start(folder, partial(self.examples, config), self.corpus(config), n_layer=config.n_layer, n_embd=config.n_embd,
                                n_head=config.n_head, sft_steps=config.sft_steps, batch_size=config.sft_batch_size,
                                lr=config.sft_learning_rate, seed=config.seed, make=self.model_maker(config),
                                progress=Progress(config.sft_steps, label="warm-start step"))
        hf_config = loader.config_class(model=str(path), dtype=config.dtype, gradient_checkpointing=config.gradient_checkpointing)
        loaded = context.build(ComponentChoice(where.removeprefix("$."), loader, hf_config))
        self._loaded: Policy = loaded
        self.tokenizer, self.eos_token_ids = loaded.tokenizer, loaded.eos_token_ids
        self.suppressed_token_ids, self.context_length = loaded.suppressed_token_ids, loaded.context_length

    @property
    def model(self):
        return self._loaded.model

    def forward(self, input_ids, attention_mask, position_ids, start: int = 0):
        return self._loaded.forward(input_ids, attention_mask, position_ids, start)

    def reference_logits(self, input_ids, attention_mask, position_ids, start: int = 0):
        return self._loaded.reference_logits(input_ids, attention_mask, position_ids, start)

    def parameters(self):
        return self._loaded.parameters()

    def state_dict(self):
        return self._loaded.state_dict()

    def load_state_dict(self, state) -> None:
        self._loaded.load_state_dict(state)

    def save_pretrained(self, path: str, merge_adapters: bool = True) -> None:
        self._loaded.save_pretrained(path, merge_adapters)

    def shard_units(self) -> list[type]:
        return self._loaded.shard_units()
