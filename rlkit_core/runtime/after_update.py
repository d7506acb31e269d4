# pyright: standard
"""Stage 4, after the update: the KL controller's step and the iteration's metrics, over the
global batch.

The update trained on this process's rollouts; what the iteration reports, and the KL the
controller sees, are of every process's (`DESIGN.md`: the multi-process contract), so the batch
is gathered first. Only rollouts with a counted token enter them: an episode kept out of
training (a fault) has none, and its score or KL was never part of what trained.
"""

from __future__ import annotations

import json
import zlib

import torch

from rlkit_core.batch import RolloutBatch
from rlkit_core.functional import explained_variance, masked_mean, masked_sum, masked_var
from rlkit_core.recipe.assemble import Components
from rlkit_core.runtime.engine import Engine


def after_update(engine: Engine, components: Components, batch: RolloutBatch,
                 timings: dict[str, float]) -> tuple[RolloutBatch, dict[str, float]]:
    """(the global batch, a row per episode, and the iteration's metrics after the update's) for
    this process's `batch`, scored, compared with the reference and trained on; β is stepped on the
    KL per sequence of the rollouts that trained. `timings`: the iteration's `time/forward`, `time/train` and
    `time/iteration` (seconds, up to the end of the update), reported with the rest."""
    # the metrics are global, and count an episode that split once (its samples joined: `RolloutBatch.by_episode`)
    batch = engine.processes.gather_batch(batch, components.policy.tokenizer.pad_token_id).by_episode().batch
    # the rollouts that train (some do, `Trainer._untrained` otherwise): an episode kept out of training (a fault) has no counted token
    trained = batch.loss_mask.any(dim=1)
    batch_trained = batch if trained.all() else batch.select(trained.nonzero().squeeze(1))
    assert batch_trained.kl is not None  # compared with the reference before the update
    mask = batch_trained.loss_mask
    kl_per_sequence = masked_sum(batch_trained.kl, mask, dim=1)
    kl_now = float(kl_per_sequence.mean())
    beta = components.kl.beta
    components.kl.update(kl_now, len(batch_trained))
    assert batch_trained.scores is not None and batch_trained.ended is not None and batch_trained.old_logprobs is not None
    metrics = {
        "score/mean": float(batch_trained.scores.mean()),
        "score/std": float(batch_trained.scores.std()) if len(batch_trained) > 1 else 0.0,
        "kl/ref": kl_now,
        "kl/ref_per_token": float(masked_mean(batch_trained.kl, mask)),
        "kl/ref_median": float(kl_per_sequence.median()),  # far below kl/ref: a few responses hold most of the KL
        "kl/ref_max": float(kl_per_sequence.max()),
        "kl/beta": beta,
        "response/length": float(mask.sum(dim=1).float().mean()),
        "response/eos_rate": float(batch_trained.ended.float().mean()),
        "check/logprob_gap": float(masked_mean((batch_trained.old_logprobs - batch_trained.sampled_logprobs).abs(), mask)),
        **timings,
        # every response position forwarded
        "time/tokens_per_second": float(batch.response_mask.sum()) / timings["time/iteration"],
        "data/prompts_crc": data_checksum(batch),
    }
    if batch_trained.values is not None and batch_trained.returns is not None:
        metrics.update(critic_metrics(batch_trained.values, batch_trained.returns, mask))
    return batch, metrics


def critic_metrics(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """What the rollout's critic said against its targets, over counted tokens: explained variance;
    returns − values (GAE's advantages before whitening: the scale the policy's gradient would have
    without it), mean and biased std; and the mean value and return (apart: a critic still warming up)."""
    raw = returns - values
    return {"train/explained_variance": float(explained_variance(values, returns, mask)),
            "advantage/raw_mean": float(masked_mean(raw, mask)), "advantage/raw_std": float(masked_var(raw, mask).sqrt()),
            "value/mean": float(masked_mean(values, mask)), "return/mean": float(masked_mean(returns, mask))}


def data_checksum(batch: RolloutBatch) -> float:
    """Which records an iteration's batch came from, as a CRC-32: each row's prompt and its record's
    other columns (what makes episodes of one prompt text differ, a game's secret). A resumed run,
    or one made ahead, must show the same value each iteration as an uninterrupted one."""
    rows = [{"prompt": prompt, **{name: values[row] for name, values in batch.columns.items()}} for row, prompt in enumerate(batch.prompts)]
    return float(zlib.crc32(json.dumps(rows, sort_keys=True, default=str).encode()))
