"""The warm-start policy of the default recipe: a tiny byte-level GPT-2, briefly supervised.

``build_warm_start`` creates a randomly initialised ``GPT2LMHeadModel`` over the ``ByT5Tokenizer``
byte vocabulary and fine-tunes it (SFT) on prompt + summary + EOS from
``summarize_task.make_corpus``, the loss counting only the summary tokens (and the EOS). It is
deliberately short: the policy should write summary-shaped text with facts often wrong, so PPO has
room to improve on it. The model and the tokenizer are saved together, so
``AutoModelForCausalLM.from_pretrained(path)`` and ``AutoTokenizer.from_pretrained(path)`` work
offline.

The supervised summary is the reference, except that a share ``filler_share`` of them go on with
one filler sentence of the document ("The baker sold bread in Paris. The sky was grey."): careless
human summaries, of the kind real SFT data holds. The reward still compares against the clean
reference, so PPO has a flaw to fix that a reader sees at once, besides wrong facts.

Padding: batches are right-padded for SFT, so positions start at 0 for every row without any
position_ids bookkeeping. The warm start is measured the way PPO sees it: the first iterations of
the default recipe report its sampled score.

The build is written to a hidden temporary directory beside ``out_dir`` and renamed into place
only when complete, with a ``warm_start.json`` recording its settings. A later call with the same
settings reuses the directory; with different settings it rebuilds and replaces it. A directory at
``out_dir`` that lacks ``warm_start.json`` is not ours and is never touched. (Bump the
``format`` number in ``_settings`` whenever the corpus or the training loop changes, so old builds
are not reused.)

Measured on a 2-core CPU (2 layers, width 128, 4 heads: 0.48 M parameters; AdamW, batch 32, lr
3e-3), summaries sampled at temperature 1 unless said otherwise:
- ``filler_share`` 0 (the defaults, the algorithm-variant recipes): SFT crosses into copying facts
  between 700 and 800 steps. At 700 the summaries score a mean ROUGE-1 F1 of 0.40 and never copy a
  whole fact, and 150 PPO iterations leave them there (0.40 -> 0.42); at 800 they score 0.72 and
  one in eight copies the whole fact (one in three greedy summaries), which PPO then raises.
- ``filler_share`` 0.75 (the default recipe): the filler delays copying; at 800 steps no greedy
  summary copies a fact, at 1100 three in five do, half of the sampled ones, and every greedy
  summary goes on with a filler sentence.
Fewer steps leave more room on paper but none that PPO can use.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from . import summarize_task

MARKER_FILE = "warm_start.json"
PAD_ID = 0
EOS_ID = 1
VOCAB_SIZE = 384
N_POSITIONS = 256


def _tokenizer():
    from transformers import ByT5Tokenizer

    return ByT5Tokenizer()


def _encode(tokenizer, text: str) -> list[int]:
    # ByT5Tokenizer appends EOS unless told not to.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _sft_examples(tokenizer, records: Sequence[dict], filler_share: float, rng: random.Random) -> list[tuple[list[int], list[bool]]]:
    """(prompt ids + summary ids + EOS, which of them the loss counts: the summary and EOS) for each
    record; a `filler_share` of the summaries go on with one filler sentence of the document."""
    examples = []
    for record in records:
        prompt = _encode(tokenizer, record["prompt"])
        summary = record["reference"]
        if rng.random() < filler_share:
            summary += " " + rng.choice(summarize_task.filler_sentences(record))
        target = _encode(tokenizer, summary) + [EOS_ID]
        ids = prompt + target
        examples.append((ids, [False] * len(prompt) + [True] * len(target)))
    return examples


def _collate_right_padded(batch: Sequence[tuple[list[int], list[bool]]]):
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    for row, (ids, counted) in enumerate(batch):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
        labels[row, : len(ids)] = torch.where(torch.tensor(counted), torch.tensor(ids), -100)
    return input_ids, attention_mask, labels


def _examples(corpus: str, tokenizer, size: int, seed: int, filler_share: float) -> list[tuple[list[int], list[bool]]]:
    """The supervised examples of `corpus`: "summaries" (the default recipe's) or "guess-number"
    (the multi-turn recipe's games, `guess_number.sft_examples`)."""
    if corpus == "guess-number":
        from . import guess_number

        return guess_number.sft_examples(tokenizer, size, seed)
    return _sft_examples(tokenizer, summarize_task.make_corpus(size, seed), filler_share, random.Random(f"filler/{seed}"))


def _settings(**kwargs) -> dict:
    return {"format": 1, "prompt_separator": summarize_task.PROMPT_SEPARATOR, **kwargs}


def _existing_settings(path: Path) -> dict | None:
    try:
        return json.loads((path / MARKER_FILE).read_text())["settings"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def build_warm_start(
    out_dir: str | os.PathLike,
    *,
    n_layer: int = 2,
    n_embd: int = 128,
    n_head: int = 4,
    sft_steps: int = 800,
    batch_size: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
    corpus_size: int = 20000,
    filler_share: float = 0.0,
    corpus: str = "summaries",
    progress=None,
) -> Path:
    """Build (or reuse) the warm-start policy at ``out_dir``; return its path.

    SFT: AdamW (``lr``, weight decay 0.01, betas (0.9, 0.95)), linear warm-up over the first 10% of
    ``sft_steps`` then constant, gradient norm clipped at 1.0, ``batch_size`` examples per step drawn
    without replacement from ``make_corpus(corpus_size, seed)`` (reshuffled each epoch), a share
    ``filler_share`` of their summaries going on with a filler sentence (see above).
    ``progress`` (an ``rlkit_core.progress.Progress``) shows the step, loss and time left.

    Builders of one ``out_dir`` take turns through a lock file beside it, so the processes of a
    multi-process launch (or two runs started together) build it once and the others reuse it.
    """
    from filelock import FileLock

    out = Path(out_dir)
    settings = _settings(
        n_layer=n_layer, n_embd=n_embd, n_head=n_head, sft_steps=sft_steps,
        batch_size=batch_size, lr=lr, seed=seed, corpus_size=corpus_size, filler_share=filler_share,
    )
    if corpus != "summaries":  # the summarizer's settings as they were, so that its builds are reused
        settings["corpus"] = corpus
    out.parent.mkdir(parents=True, exist_ok=True)
    # Its own random stream: a run that builds the warm start must continue with the same draws
    # (critic initialisation, sampling) as a later run that finds it cached.
    with FileLock(out.parent / f".{out.name}.lock"), torch.random.fork_rng(devices=[]):
        return _build(out, settings, progress)


def _build(out: Path, settings: dict, progress) -> Path:
    """`build_warm_start`'s work, with the lock held."""
    from transformers import GPT2Config, GPT2LMHeadModel

    n_layer, n_embd, n_head, sft_steps, batch_size, lr, seed, corpus_size, filler_share = (settings[k] for k in (
        "n_layer", "n_embd", "n_head", "sft_steps", "batch_size", "lr", "seed", "corpus_size", "filler_share"))
    if out.exists():
        existing = _existing_settings(out)
        if existing is None:
            raise FileExistsError(f"{out} exists and is not a warm-start directory; not touching it")
        if existing == settings:
            return out
    if sft_steps < 0 or batch_size < 1 or corpus_size < 1 or not 0.0 <= filler_share <= 1.0:
        raise ValueError("sft_steps >= 0, batch_size >= 1, corpus_size >= 1 and 0 <= filler_share <= 1 are required")

    started = time.perf_counter()
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = _tokenizer()
    config = GPT2Config(
        vocab_size=VOCAB_SIZE, n_positions=N_POSITIONS, n_embd=n_embd, n_layer=n_layer,
        n_head=n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=EOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
    )
    model = GPT2LMHeadModel(config)
    examples = _examples(settings.get("corpus", "summaries"), tokenizer, corpus_size, seed, filler_share)
    if any(len(ids) > N_POSITIONS for ids, _ in examples):
        raise ValueError(f"an example exceeds n_positions={N_POSITIONS}")

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = max(1, sft_steps // 10)
    # (s + 1) / warmup, not transformers' constant-with-warmup (s / warmup: no update at step 0, another warm start)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    model.train()
    order: list[int] = []
    losses: list[float] = []
    for step in range(sft_steps):
        if len(order) < batch_size:
            fresh = list(range(len(examples)))
            rng.shuffle(fresh)
            order.extend(fresh)
        picked, order = order[:batch_size], order[batch_size:]
        input_ids, attention_mask, labels = _collate_right_padded([examples[i] for i in picked])
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
    model.generation_config.pad_token_id = PAD_ID
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.bos_token_id = EOS_ID

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
