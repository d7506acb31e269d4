# pyright: standard
"""Stage 3, the update, read top to bottom like the paper's loop: epochs → shuffled minibatches →
micro-batches → forward, loss and backward → one optimiser step per minibatch.

Every loss term is a sum over its tokens divided by the minibatch's global token count, so the
summed gradients are the same however the minibatch is split over processes and micro-batches.
Whatever the loss, the loop logs the policy's entropy and how far it moved from π_old itself
(`train/entropy`, `train/approx_kl`), which the health checks and the epochs' summary read.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from collections.abc import Iterator

import attrs
import torch

from rlkit_core.batch import RolloutBatch
from rlkit_core.functional import approx_kl, masked_mean, token_log_ratio
from rlkit_core.interfaces import LossInputs, LossTerms
from rlkit_core.randomness import minibatch_order_generator
from rlkit_core.recipe.assemble import Components
from rlkit_core.recipe.document import Recipe
from rlkit_core.runtime.distributed import StepTerms, add_terms
from rlkit_core.runtime.engine import Engine
from rlkit_core.runtime.faults import NonFiniteSteps
from rlkit_core.runtime.forward import ForwardObserver, chunks_of, lengths_of, response_view, rows_of
from rlkit_core.runtime.state import RunState


@attrs.frozen
class UpdateResult:
    metrics: dict[str, float]  # `train/...`: means over the optimiser steps, with the largest gradient norm and the rate
    nonfinite_in_a_row: int  # the run's count of non-finite steps in a row, after this update's


def update(engine: Engine, components: Components, recipe: Recipe, batch: RolloutBatch, state: RunState,
           observe: ForwardObserver | None = None) -> UpdateResult:
    """Epochs of shuffled minibatches over this process's rollouts, one optimiser step each.

    A minibatch holds `minibatch_size / processes` rollouts here, run as
    `gradient_accumulation_steps` micro-batches (see the module for how they add up). With
    `ppo.target_kl`, the update ends at the first minibatch that finds π_θ past 1.5 × target_kl
    from π_old (approx KL per token), before its step, as Stable-Baselines3 does."""
    ppo, optim = recipe.ppo, recipe.optim
    shuffler = minibatch_order_generator(recipe.run.seed, state.iteration)
    per_process = ppo.minibatch_size // engine.processes.count
    lengths = lengths_of(batch)
    stats = StepStats()
    nonfinite_in_a_row = state.nonfinite_in_a_row
    engine.trainable.train()  # gradient checkpointing acts in training mode only; dropout is off
    planned, past_target = ppo.epochs * math.ceil(len(batch) / per_process), False
    for _ in range(ppo.epochs):
        stats.epoch_starts.append(stats.steps)
        for index in torch.randperm(len(batch), generator=shuffler).to(engine.device).split(per_process):
            token_count = engine.processes.sum(batch.loss_mask[index].sum()).clamp(min=1)
            engine.optimizer.zero_grad(set_to_none=True)
            step_terms = StepTerms({}, {})
            for micro, rows in micro_batches(engine, recipe, batch, index, lengths, observe):
                terms = _micro_step(engine, components, recipe, micro, rows, token_count)
                step_terms = add_terms(step_terms, terms)
            terms = engine.processes.combine_terms(step_terms)
            past_target = bool(ppo.target_kl) and float(terms.metrics()["approx_kl"]) > 1.5 * ppo.target_kl
            if past_target:  # every process alike: the terms are summed over them
                break
            grad_norm, nonfinite = _optimizer_step(engine, recipe, terms)
            nonfinite_in_a_row = _count_nonfinite(recipe, state.iteration, nonfinite_in_a_row, nonfinite)
            for name, value in terms.metrics().items():
                stats.add(f"train/{name}", value)
            stats.add("train/grad_norm", torch.tensor(grad_norm))  # before clipping
            # the share of steps that clipping shortened: near 1, max_grad_norm sets the step size, not the loss
            stats.add("train/grad_clipped", torch.tensor(float(0 < optim.max_grad_norm < grad_norm)))
            stats.add("train/nonfinite", torch.tensor(float(nonfinite)))
            stats.steps += 1
        if past_target:
            break
    for _ in range(planned - stats.steps):  # an update stopped early: the schedule keeps the run's clock of one step a minibatch
        engine.step_schedule()
    engine.trainable.eval()
    metrics = stats.read(engine.device)
    metrics["train/lr"] = engine.learning_rate
    metrics["train/steps_taken"] = stats.steps / planned  # below 1: ppo.target_kl ended the update early
    return UpdateResult(metrics, nonfinite_in_a_row)


def micro_batches(engine: Engine, recipe: Recipe, batch: RolloutBatch, index: torch.Tensor, lengths: tuple[list[int], list[int]],
                  observe: ForwardObserver | None = None) -> Iterator[tuple[RolloutBatch, object]]:
    """The minibatch `index` of `batch` as micro-batches, each trimmed and with its rows. The
    caller's forward and backward of each run inside the loop, and gradients are all-reduced
    once, at the last micro-batch. Every process gets as many as the others."""
    ppo = recipe.ppo
    micro_size = ppo.minibatch_size // engine.processes.count // ppo.gradient_accumulation_steps
    chunks = chunks_of(index, lengths, ppo.max_tokens_per_microbatch, micro_size, "max_tokens_per_microbatch", ppo.pack_sequences,
                       engine.processes)
    for number, chunk in enumerate(chunks):
        syncing = number == len(chunks) - 1
        with contextlib.nullcontext() if syncing else engine.no_sync():
            micro = batch.select(chunk).trimmed()
            rows = rows_of(micro, ppo.pack_sequences)
            if observe is not None:
                observe("train", micro, rows)
            yield micro, rows


class StepStats:
    """Each optimiser step's numbers, kept as device tensors and read from the device once, at the end."""

    def __init__(self):
        self.per_step: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.steps = 0
        self.epoch_starts: list[int] = []  # the step each epoch began at

    def add(self, name: str, value: torch.Tensor) -> None:
        self.per_step[name].append(value)

    def read(self, device: torch.device) -> dict[str, float]:
        """The mean of each over the steps, the largest gradient norm, and the approx KL of the
        last epoch that took a step alone (how far the policy has moved from the rollout's by then)."""
        if not self.steps:  # the first step found the policy past ppo.target_kl: nothing was taken
            return {}
        read = iter(torch.stack([v.to(device, torch.float64) for values in self.per_step.values() for v in values]).tolist())
        steps = {name: [next(read) for _ in values] for name, values in self.per_step.items()}
        metrics = {name: sum(values) / self.steps for name, values in steps.items()}
        metrics["train/grad_norm_max"] = max(steps["train/grad_norm"])
        if "train/approx_kl" in steps:
            last_epoch = steps["train/approx_kl"][max(start for start in self.epoch_starts if start < self.steps):]
            metrics["train/approx_kl_last_epoch"] = sum(last_epoch) / len(last_epoch)
        return metrics


def _optimizer_step(engine: Engine, recipe: Recipe, terms: StepTerms) -> tuple[float, bool]:
    """Clip the gradients and step, unless the loss asked to skip this minibatch or is not
    finite; then the schedule steps either way. Returns (gradient norm before clipping, whether
    the loss or the gradient was non-finite).

    Every process took part in the backward passes (DDP needs them all); all skip or none does.
    The loss is summed over processes and the gradient norm is of the all-reduced gradients, so
    a non-finite value on one process is non-finite on every one."""
    grad_norm = 0.0
    nonfinite = not math.isfinite(float(terms.loss))
    if not float(terms.skip) and not nonfinite:
        grad_norm = engine.clip_gradients(recipe.optim.max_grad_norm)
        nonfinite = not math.isfinite(grad_norm)
        if not nonfinite or recipe.run.mixed_precision == "fp16":
            engine.step_optimizer()  # under fp16 the loss scaler skips an overflowed step itself and lowers its scale
    engine.step_schedule()
    return grad_norm, nonfinite


def _count_nonfinite(recipe: Recipe, iteration: int, in_a_row: int, nonfinite: bool) -> int:
    """A step with a non-finite loss or gradient leaves the weights alone; `run.max_skips_in_a_row`
    of them in a row stop the run, before a broken state could be checkpointed. Returns the new
    count in a row."""
    in_a_row = in_a_row + 1 if nonfinite else 0
    limit = recipe.run.max_skips_in_a_row
    if in_a_row >= limit:
        raise NonFiniteSteps(f"{limit} optimiser steps in a row had a non-finite loss or gradient, in iteration "
                             f"{iteration + 1}; the weights were left as they were before them")
    return in_a_row


def _micro_step(engine: Engine, components: Components, recipe: Recipe, micro: RolloutBatch, rows,
                token_count: torch.Tensor) -> StepTerms:
    """Forward and backward of one micro-batch; returns its share of the step's terms
    (`StepTerms.share_of`)."""
    ppo = recipe.ppo
    with engine.autocast():  # accelerate's prepared module autocasts by itself, except under FSDP
        logprobs, values, entropy, logits = engine.trainable(response_view, components, micro, rows, grad=True)
    mask = micro.loss_mask
    kl_coef = components.kl.beta if ppo.kl_penalty == "loss" else 0.0
    current = LossInputs(logprobs=logprobs, values=values, entropy=entropy, kl_coef=kl_coef, kl_estimator=ppo.kl_estimator,
                         logits=logits)
    terms = components.loss(micro, current, token_count)
    token_share = mask.sum() / token_count
    share = StepTerms.share_of(recipe["loss"].component.name, terms, token_share)
    own = StepTerms({name: value * token_share for name, value in policy_diagnostics(micro, current, terms).items()}, {})
    engine.backward(terms.total())
    return add_terms(share, own)


def policy_diagnostics(micro: RolloutBatch, current: LossInputs, terms: LossTerms) -> dict[str, torch.Tensor]:
    """What the loop logs of every loss, as means over the micro-batch's counted tokens (detached):
    the policy's entropy, and the approx KL of π_θ from π_old over the log-ratios the loss weighed
    (`LossTerms.log_ratio`; each token's own unless the loss says otherwise)."""
    mask = micro.loss_mask
    log_ratio = terms.log_ratio
    if log_ratio is None:
        assert micro.old_logprobs is not None, "the loop fills it before the update"
        log_ratio = token_log_ratio(current.logprobs.detach(), micro.old_logprobs, mask)
    return {"approx_kl": approx_kl(log_ratio, mask), "entropy": masked_mean(current.entropy, mask).detach()}
