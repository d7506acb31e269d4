"""One PPO iteration, read top to bottom:

prompts → generate → score → old/reference log-probs and values → per-token rewards with the KL
penalty → advantages → epochs of shuffled minibatches → KL controller update → metrics.

The trainer owns the order of the stages and the bookkeeping (optimiser, schedule, seeds, timing);
every stage's own logic lives in a component or in `rlkit_core.functional`.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections import defaultdict
from pathlib import Path

import torch
from accelerate import Accelerator
from transformers import get_scheduler

from rlkit_core.batch import RolloutBatch
from rlkit_core.context import BuildContext
from rlkit_core.errors import RecipeError, RunError
from rlkit_core.functional import (
    entropy_from_logits,
    explained_variance,
    kl_per_token,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    shaped_scores,
    token_rewards,
)
from rlkit_core.interfaces import Generation, LossInputs
from rlkit_core.prompts import PromptLengthLimit, encode_prompts, prepare_prompts, within_context
from rlkit_core.randomness import minibatch_order_generator, sampling_seed
from rlkit_core.recipe.assemble import build_components
from rlkit_core.recipe.document import Recipe
from rlkit_core.runtime.distributed import (
    Processes,
    TrainableModules,
    add_terms,
    combined_by_max,
    critic_problem,
    engine_problem,
    fsdp_plugin,
)
from rlkit_core.runtime.dynamic_sampling import DynamicSampler
from rlkit_core.runtime.evaluation import hold_out
from rlkit_core.runtime.faults import BadReward, NonFiniteSteps, checked_scores, failure_text
from rlkit_core.runtime.metrics_log import MetricsLog
from rlkit_core.runtime.microbatches import TooLong, budget_pieces, fixed_pieces, padded_to
from rlkit_core.runtime.packing import PackedRows, PaddedRows
from rlkit_core.runtime.prompt_stream import PromptStream
from rlkit_core.settings import field_of


def record_columns(records: list[dict]) -> dict[str, list]:
    """The records' fields other than the prompt, as columns (the reward's keyword arguments)."""
    keys = dict.fromkeys(key for r in records for key in r if key != "prompt")
    return {key: [r.get(key) for r in records] for key in keys}


def critic_metrics(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """What the rollout's critic said against its targets, over counted tokens: explained variance;
    returns − values (GAE's advantages before whitening: the scale the policy's gradient would have
    without it), mean and biased std; and the mean value and return (apart: a critic still warming up)."""
    raw = returns - values
    return {"train/explained_variance": float(explained_variance(values, returns, mask)),
            "advantage/raw_mean": float(masked_mean(raw, mask)), "advantage/raw_std": float(masked_var(raw, mask).sqrt()),
            "value/mean": float(masked_mean(values, mask)), "return/mean": float(masked_mean(returns, mask))}


def lengths_of(batch: RolloutBatch) -> tuple[list[int], list[int]]:
    """Each rollout's prompt and response length in tokens (one read from the device)."""
    prompt, response = torch.stack([batch.prompt_mask.sum(dim=1), batch.response_mask.sum(dim=1)]).tolist()
    return prompt, response


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RunError(f"run.device = {name!r} but torch sees no GPU; use 'auto' or 'cpu'")
    return torch.device(name)


class Trainer:
    def __init__(self, recipe: Recipe, device: torch.device | None = None):
        self.recipe = recipe
        run, ppo, optim = recipe.run, recipe.ppo, recipe.optim
        if run.threads:
            torch.set_num_threads(run.threads)
        torch.manual_seed(run.seed)
        self.device = device or pick_device(run.device)
        # accelerate owns the processes, backward, gradient clipping and mixed precision, so one
        # process and `accelerate launch` (several) go through the same calls.
        # Components are built on self.device; `prepare` must not move them (run.device = "cuda:1").
        # The schedule steps once per `scheduler.step()` (not once per process, accelerate's default).
        self.accelerator = Accelerator(cpu=self.device.type == "cpu", mixed_precision=run.mixed_precision, device_placement=False,
                                       fsdp_plugin=fsdp_plugin(run.mixed_precision), step_scheduler_with_optimizer=False)
        if problem := engine_problem(self.accelerator):
            raise RunError(problem)
        self.processes = Processes(self.accelerator)
        if self.processes.count > 1 and self.device.type == "cuda":
            self.device = self.accelerator.device  # this process's own GPU
        self.output_dir = Path(run.output_dir)
        self.context = BuildContext(recipe=recipe, device=self.device, output_dir=str(self.output_dir), seed=run.seed)
        self.parts = build_components(recipe, self.context)
        self.policy, self.value_head = self.parts.policy, self.parts.value_head
        if self.processes.sharded and (problem := critic_problem(self.value_head)):
            raise RunError(problem)
        self.tokenizer = self.policy.tokenizer
        limit = recipe["data"].config if isinstance(recipe["data"].config, PromptLengthLimit) else None
        generator = recipe["generator"].config
        limit = within_context(limit, self.policy.context_length, generator.response_limit, field_of(generator, "max_new_tokens"))
        self.max_prompt_tokens = limit.max_prompt_tokens if limit else 0
        records, self.prompt_counts = prepare_prompts(self.parts.data.load(), self.tokenizer, limit)
        self.eval_records, self.records = hold_out(records, recipe.eval.size, run.seed)
        if self.processes.index:  # every process built the same components; now each samples its own
            torch.manual_seed(sampling_seed(run.seed, self.processes.index))
        self.stream = PromptStream(self.records, ppo.batch_size // ppo.samples_per_prompt, run.seed)
        self.dynamic_sampler = DynamicSampler(self) if ppo.dynamic_sampling else None

        groups = [{"params": list(self.policy.parameters()), "lr": optim.learning_rate}]
        if self.value_head is not None:
            groups.append({"params": list(self.value_head.parameters()), "lr": optim.value_learning_rate or optim.learning_rate})
        # fused: one kernel for all parameters (2 ms a step instead of 10 on the benchmark shape's CPU);
        # the same update up to rounding, also on FSDP2's DTensor shards
        optimizer = torch.optim.AdamW(groups, weight_decay=optim.weight_decay, eps=optim.adam_eps,
                                      fused=self.device.type in ("cpu", "cuda"))
        self.trainable, self.optimizer = self.accelerator.prepare(TrainableModules(self.policy, self.value_head), optimizer)
        # what the optimiser updates: the same tensors, or under FSDP the shards that replaced them
        self.parameters = [p for g in optimizer.param_groups for p in g["params"]]
        updates = run.steps * ppo.epochs * (ppo.batch_size // ppo.minibatch_size)
        # prepared, so that accelerate's save_state holds it with the optimiser, loss scaler and random states
        self.scheduler = self.accelerator.prepare(get_scheduler(optim.schedule, optimizer, num_warmup_steps=optim.warmup_steps,
                                                                num_training_steps=updates))
        self.iteration = 0  # iterations completed
        self.last_batch: RolloutBatch | None = None  # the latest scored batch, for sample tables
        self.metrics_log = MetricsLog(self.output_dir / "metrics.jsonl")
        self.nonfinite_in_a_row = 0  # optimiser steps with a non-finite loss or gradient, the latest ones
        # (positions computed, real tokens among them) per phase, summed over the run
        self.positions = {"forward": (0, 0), "train": (0, 0)}

    def full_weights(self):
        """A block in which the policy and critic can be read whole (under FSDP: gathered in every
        process, which must all enter it; see `Processes.full_weights`)."""
        return self.processes.full_weights(self.trainable)

    # --- stage 1: rollouts -------------------------------------------------------------------
    def rollout(self, records: list[dict], samples_per_prompt: int | None = None, greedy: bool = False) -> tuple[RolloutBatch, dict[str, float]]:
        """Sample `samples_per_prompt` (default: the recipe's) responses for each record and score them."""
        k = samples_per_prompt or self.recipe.ppo.samples_per_prompt
        records = [r for r in records for _ in range(k)]
        prompts = [r["prompt"] for r in records]
        columns = record_columns(records)
        group_ids = torch.arange(len(records), device=self.device) // k + self.processes.index * (len(records) // k)
        prompt_ids, prompt_mask = encode_prompts(self.tokenizer, records, self.device, self.max_prompt_tokens)

        started = time.perf_counter()
        [generation] = self._generate([(prompt_ids, prompt_mask)], greedy)
        generated = time.perf_counter()
        mask = generation.response_mask
        ended = torch.isin(generation.response_ids, torch.tensor(self.policy.eos_token_ids, device=self.device)).any(dim=1)
        responses = self.tokenizer.batch_decode(generation.response_ids, skip_special_tokens=True)
        scores = self._score(prompts, responses, columns)
        scored = time.perf_counter()
        batch = RolloutBatch(
            prompts=prompts, columns=columns, group_ids=group_ids, prompt_ids=prompt_ids, prompt_mask=prompt_mask,
            response_ids=generation.response_ids, response_mask=mask, sampled_logprobs=generation.logprobs,
            responses=responses, ended=ended, scores=torch.tensor(scores, dtype=torch.float32, device=self.device),
        )
        return batch, {"time/generate": generated - started, "time/score": scored - generated, **self.parts.generator.metrics()}

    def _generate(self, prompts: list[tuple[torch.Tensor, torch.Tensor]], greedy: bool) -> list[Generation]:
        """The generator's output for each (prompt ids, mask) chunk, from the current weights:
        read whole (FSDP gathers them in every process), synced once into an engine of its own
        (vLLM last saw them before the last update), under the run's mixed precision unless the
        generator runs its own (`Generator.runs_own_precision`)."""
        with self.full_weights():
            self.parts.generator.sync_weights(self.policy)
            with contextlib.nullcontext() if type(self.parts.generator).runs_own_precision else self.accelerator.autocast():
                return [self.parts.generator.generate(ids, mask, greedy=greedy) for ids, mask in prompts]

    def _score(self, prompts: list[str], responses: list[str], columns: dict) -> list[float]:
        """The reward's scores, checked here, where every reward source passes. A reward that
        raises or breaks its contract on any process is a `BadReward` on every process, so that
        all of them stop or skip together."""
        problem, scores = None, None
        try:
            returned = self.parts.reward.score(prompts, responses, **columns)
        except RecipeError:  # the recipe's fault (a column the data lacks): exit 2 with its located message
            raise
        except Exception as exc:  # someone else's code: whatever else it raises is the reward's failure
            problem = {"problem": f"raised {failure_text(exc)}"}
        else:
            try:
                scores = checked_scores(returned, len(responses))
            except ValueError as exc:
                problem = {"problem": str(exc), "returned": returned if isinstance(returned, (list, tuple)) else repr(returned)}
        if problem:
            problem["rows"] = [{"prompt": p, "response": r} for p, r in zip(prompts, responses)]
        problems = [p for p in self.processes.gather_objects(problem) if p]
        if problems:
            raise BadReward(problems[0].pop("problem"), problems[0])
        return scores

    # --- stage 2: what the rollout policy, the reference and the critic say -------------------
    def _rows(self, part: RolloutBatch):
        """How `part` (a trimmed piece) lies in the rows of its forward pass: packed when the
        recipe asks (`rlkit_core.runtime.packing`), else one rollout per row."""
        if self.recipe.ppo.pack_sequences:
            return PackedRows(part, *lengths_of(part))
        return PaddedRows(part)

    def _response_view(self, batch: RolloutBatch, rows, grad: bool):
        """(logprobs, values, entropy, response logits) of the current parameters on `batch`, laid
        out as `rows` (`_rows`).

        Entropy keeps its graph only when the loss optimises it; otherwise it is a detached
        diagnostic, so no [b, R, V] buffers are held for a backward that never uses them."""
        out = self.policy.forward(*rows.inputs, start=rows.start)
        logits = rows.response_logits(out.logits)
        temperature, suppressed = self.parts.generator.temperature, self.policy.suppressed_token_ids
        logprobs = logprobs_from_logits(logits, batch.response_ids, temperature, suppressed)
        values = None
        if self.value_head is not None:
            values = rows.at_response(self.value_head.values(out, *rows.inputs))
        entropy = None
        if grad and self.parts.loss.entropy_in_loss:
            entropy = entropy_from_logits(logits, temperature, suppressed)
        elif grad:
            with torch.no_grad():
                entropy = entropy_from_logits(logits.detach(), temperature, suppressed)
        return logprobs, values, entropy, logits

    @torch.no_grad()
    def compare_to_reference(self, batch: RolloutBatch) -> RolloutBatch:
        """Old and reference log-probs, values and the per-token KL (zero on padding), on this
        process's rollouts."""
        with self.full_weights():  # once for every chunk
            return self._compare_in_chunks(batch)

    def _compare_in_chunks(self, batch: RolloutBatch) -> RolloutBatch:
        ppo = self.recipe.ppo
        temperature, suppressed = self.parts.generator.temperature, self.policy.suppressed_token_ids
        pieces, width = defaultdict(list), batch.response_ids.shape[1]
        chunks = self._pieces(torch.arange(len(batch), device=self.device), lengths_of(batch), ppo.max_tokens_per_forward,
                              ppo.forward_batch_size or ppo.minibatch_size, "max_tokens_per_forward")
        for index in chunks:
            part = batch.select(index).trimmed()
            rows = self._rows(part)
            with self.accelerator.autocast():
                logprobs, values, _, logits = self._response_view(part, rows, grad=False)
                ref_logits = rows.response_logits(self.policy.reference_logits(*rows.inputs, start=rows.start))
            ref_logprobs = logprobs_from_logits(ref_logits, part.response_ids, temperature, suppressed)
            full = ppo.kl_estimator == "full"
            pieces["kl"].append(kl_per_token(logprobs, ref_logprobs, ppo.kl_estimator, logits if full else None,
                                             ref_logits if full else None, temperature, suppressed))
            pieces["old_logprobs"].append(logprobs)
            pieces["ref_logprobs"].append(ref_logprobs)
            if values is not None:
                pieces["values"].append(values)
            self._count_positions("forward", part, rows)
        original_order = torch.cat(chunks).argsort()  # the chunks hold the rows sorted by length
        fields = {name: torch.cat([padded_to(part, width) for part in parts])[original_order] for name, parts in pieces.items()}
        mask = batch.response_mask
        fields["kl"] = torch.where(mask.bool(), fields["kl"], torch.zeros_like(fields["kl"]))
        return batch.with_(**fields)

    def _pieces(self, index: torch.Tensor, lengths: tuple[list[int], list[int]], budget: int, size: int, setting: str,
                same_count: bool = False) -> list[torch.Tensor]:
        """`index`'s rollouts as forward passes, grouped by length: within `budget` tokens each when
        one is set, else `size` rows each. `same_count`: every process gets as many pieces as the
        process that needs most (collective calls in the backward must pair up)."""
        if not budget:
            return fixed_pieces(index, [p + r for p, r in zip(*lengths)], size)
        try:
            packed = self.recipe.ppo.pack_sequences
            pieces = budget_pieces(index, *lengths, budget, packed=packed)
            if same_count and self.processes.count > 1:
                count = max(self.processes.gather_objects(len(pieces)))
                pieces = budget_pieces(index, *lengths, budget, at_least=count, packed=packed)
        except TooLong as too_long:
            raise RecipeError([f"$.ppo.{setting}: a rollout of {too_long.tokens} tokens (prompt and response) does not fit in "
                               f"the budget of {too_long.budget}; raise it to at least data.max_prompt_tokens + "
                               "generator.max_new_tokens, or limit the prompts with data.max_prompt_tokens"]) from None
        return pieces

    def _count_positions(self, phase: str, part: RolloutBatch, rows) -> None:
        """Positions computed and positions that are real tokens, per phase (the benchmark's padding
        share). The real count stays a device tensor: reading it here would wait for every piece."""
        computed, real = self.positions[phase]
        self.positions[phase] = (computed + rows.computed,
                                 real + part.prompt_mask.sum() + part.response_mask.sum())

    def shaped(self, scores: torch.Tensor, ended: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Scores as the rewards take them, with the recipe's penalties and clip (`shaped_scores`)."""
        ppo = self.recipe.ppo
        limit = self.recipe["generator"].config.response_limit if ppo.overlong_buffer else 0
        return shaped_scores(scores, ended, lengths, ppo.missing_eos_penalty, limit, ppo.overlong_buffer, ppo.overlong_penalty,
                             ppo.score_clip)

    def greedy_baseline(self, records: list[dict], batch: RolloutBatch) -> tuple[RolloutBatch, dict[str, float]]:
        """`batch` with `baseline_scores`: the shaped score of the greedy response to each of `records`
        (ReMax's baseline), given to every sample of that prompt."""
        greedy, timing = self.rollout(records, samples_per_prompt=1, greedy=True)
        baseline = self.shaped(greedy.scores, greedy.ended, greedy.response_mask.sum(dim=1)).repeat_interleave(self.recipe.ppo.samples_per_prompt)
        return batch.with_(baseline_scores=baseline), {"time/baseline": timing["time/generate"] + timing["time/score"]}

    @torch.no_grad()
    def with_advantages(self, batch: RolloutBatch) -> RolloutBatch:
        """`batch` with old and reference log-probs, values, per-token KL and rewards, advantages and
        returns: everything the update reads.

        The forward passes run on this process's rollouts; the advantages are estimated over the
        global batch (whitening statistics, groups), and this process keeps its rows of them."""
        batch = self.compare_to_reference(batch)
        mask = batch.response_mask
        kl_coef = self.parts.kl.beta if self.recipe.ppo.kl_penalty == "reward" else 0.0
        rewards = token_rewards(self.shaped(batch.scores, batch.ended, mask.sum(dim=1)), batch.kl, mask, kl_coef)
        batch = batch.with_(rewards=rewards)
        advantages, returns = self.parts.advantage.estimate(self.processes.gather_batch(batch, self.tokenizer.pad_token_id))
        return batch.with_(advantages=self.processes.local_rows(advantages, rewards),
                           returns=self.processes.local_rows(returns, rewards))

    # --- stage 3: the update -------------------------------------------------------------------
    def train_on(self, batch: RolloutBatch) -> dict[str, float]:
        """Epochs of shuffled minibatches over this process's rollouts, one optimiser step each.

        A minibatch holds `minibatch_size / processes` rollouts here, run as
        `gradient_accumulation_steps` micro-batches. Every loss term is a sum over its tokens
        divided by the minibatch's global token count, so the summed gradients are the same
        however the minibatch is split over processes and micro-batches."""
        ppo, optim = self.recipe.ppo, self.recipe.optim
        shuffler = minibatch_order_generator(self.recipe.run.seed, self.iteration)
        per_process = ppo.minibatch_size // self.processes.count
        micro_size = per_process // ppo.gradient_accumulation_steps
        lengths = lengths_of(batch)
        per_step, count = defaultdict(list), 0  # each step's terms stay tensors: one read from the device at the end
        self.trainable.train()  # gradient checkpointing acts in training mode only; dropout is off
        for _ in range(ppo.epochs):
            for index in torch.randperm(len(batch), generator=shuffler).to(self.device).split(per_process):
                token_count = self.processes.sum(batch.response_mask[index].sum()).clamp(min=1)
                self.optimizer.zero_grad(set_to_none=True)
                pieces = self._pieces(index, lengths, ppo.max_tokens_per_microbatch, micro_size, "max_tokens_per_microbatch", same_count=True)
                step_terms = {}
                for number, piece in enumerate(pieces):
                    # Gradients are all-reduced once, at the last micro-batch.
                    syncing = number == len(pieces) - 1
                    with contextlib.nullcontext() if syncing else self.accelerator.no_sync(self.trainable):
                        micro = batch.select(piece).trimmed()
                        rows = self._rows(micro)
                        self._count_positions("train", micro, rows)
                        terms = self._micro_step(micro, rows, token_count)
                    step_terms = add_terms(step_terms, terms)
                terms = self.processes.combine_terms(step_terms)
                grad_norm, nonfinite = self._optimizer_step(terms)
                for name, value in terms.items():
                    per_step[f"train/{name}"].append(value)
                per_step["train/grad_norm"].append(torch.tensor(grad_norm))  # before clipping
                # the share of steps that clipping shortened: near 1, max_grad_norm sets the step size, not the loss
                per_step["train/grad_clipped"].append(torch.tensor(float(0 < optim.max_grad_norm < grad_norm)))
                per_step["train/nonfinite"].append(torch.tensor(float(nonfinite)))
                count += 1
        self.trainable.eval()
        read = iter(torch.stack([v.to(self.device, torch.float64) for values in per_step.values() for v in values]).tolist())
        steps = {name: [next(read) for _ in values] for name, values in per_step.items()}
        metrics = {name: sum(values) / count for name, values in steps.items()}
        metrics["train/grad_norm_max"] = max(steps["train/grad_norm"])
        metrics["train/lr"] = self.scheduler.get_last_lr()[0]
        return metrics

    def _optimizer_step(self, terms: dict[str, torch.Tensor]) -> tuple[float, bool]:
        """Clip the gradients and step, unless the loss asked to skip this minibatch or is not
        finite; then the schedule steps either way. Returns (gradient norm before clipping, whether
        the loss or the gradient was non-finite).

        Every process took part in the backward passes (DDP needs them all); all skip or none does.
        The loss is summed over processes and the gradient norm is of the all-reduced gradients, so
        a non-finite value on one process is non-finite on every one."""
        grad_norm = 0.0
        nonfinite = not math.isfinite(float(terms["loss"]))
        if not float(terms.get("skipped", 0.0)) and not nonfinite:
            # a float: under FSDP the norm is a sharded tensor
            grad_norm = float(self.accelerator.clip_grad_norm_(self.parameters, self.recipe.optim.max_grad_norm or float("inf")))
            nonfinite = not math.isfinite(grad_norm)
            if not nonfinite or self.recipe.run.mixed_precision == "fp16":
                self.optimizer.step()  # under fp16 the loss scaler skips an overflowed step itself and lowers its scale
        self._count_nonfinite(nonfinite)
        with warnings.catch_warnings():  # a skipped step uses up its place in the schedule on purpose
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`")
            self.scheduler.step()
        return grad_norm, nonfinite

    def _count_nonfinite(self, nonfinite: bool) -> None:
        """A step with a non-finite loss or gradient leaves the weights alone; `run.max_skips_in_a_row`
        of them in a row stop the run, before a broken state could be checkpointed."""
        self.nonfinite_in_a_row = self.nonfinite_in_a_row + 1 if nonfinite else 0
        limit = self.recipe.run.max_skips_in_a_row
        if self.nonfinite_in_a_row >= limit:
            raise NonFiniteSteps(f"{limit} optimiser steps in a row had a non-finite loss or gradient, in iteration "
                                 f"{self.iteration + 1}; the weights were left as they were before them")

    def _micro_step(self, micro: RolloutBatch, rows, token_count: torch.Tensor) -> dict[str, torch.Tensor]:
        """Forward and backward of one micro-batch; returns its share of the step's terms (detached):
        `loss_*` and `loss` as they are (already over the global token count), diagnostics weighted
        by this micro-batch's share of the tokens, so that their sum is the global token mean."""
        ppo = self.recipe.ppo
        with self.accelerator.autocast():  # accelerate's prepared module autocasts by itself, except under FSDP
            logprobs, values, entropy, _ = self.trainable(self._response_view, micro, rows, True)
        mask = micro.response_mask
        kl_coef = self.parts.kl.beta if ppo.kl_penalty == "loss" else 0.0
        current = LossInputs(logprobs=logprobs, values=values, entropy=entropy, kl_coef=kl_coef, kl_estimator=ppo.kl_estimator)
        terms = self.parts.loss(micro, current, token_count)
        total = sum(value for name, value in terms.items() if name.startswith("loss_"))
        # DDP averages gradients over processes; the loss is a share of a global sum, so undo the mean.
        self.accelerator.backward(total * self.processes.count)
        share = mask.sum() / token_count
        shares = {name: value.detach() if name.startswith("loss_") or combined_by_max(name) else value.detach() * share
                  for name, value in terms.items()}
        shares["loss"] = total.detach()
        return shares

    # --- one whole iteration -------------------------------------------------------------------
    def step(self) -> dict[str, float]:
        """Run iteration `self.iteration + 1` and return its metrics: over the global batch, with
        the timings of this process."""
        started = time.perf_counter()
        records = self.processes.share(self.stream.batch(self.iteration))
        batch, metrics = self.dynamic_sampler.rollout(records) if self.dynamic_sampler else self.rollout(records)
        if type(self.parts.advantage).needs_baseline_scores:  # a flag of the class, as the recipe check reads it
            batch, timing = self.greedy_baseline(records, batch)
            metrics.update(timing)
        forward_started = time.perf_counter()
        batch = self.with_advantages(batch)
        train_started = time.perf_counter()
        metrics.update(self.train_on(batch))
        finished = time.perf_counter()

        batch = self.processes.gather_batch(batch, self.tokenizer.pad_token_id)  # the metrics are global
        mask = batch.response_mask
        kl_per_sequence = masked_sum(batch.kl, mask, dim=1)
        kl_now = float(kl_per_sequence.mean())
        beta = self.parts.kl.beta
        self.parts.kl.update(kl_now, len(batch))
        self.iteration += 1
        metrics.update({
            "score/mean": float(batch.scores.mean()),
            "score/std": float(batch.scores.std()) if len(batch) > 1 else 0.0,
            "kl/ref": kl_now,
            "kl/ref_per_token": float(masked_mean(batch.kl, mask)),
            "kl/beta": beta,
            "response/length": float(mask.sum(dim=1).float().mean()),
            "response/eos_rate": float(batch.ended.float().mean()),
            "check/logprob_gap": float(masked_mean((batch.old_logprobs - batch.sampled_logprobs).abs(), mask)),
            "time/forward": train_started - forward_started,
            "time/train": finished - train_started,
            "time/iteration": finished - started,
            "time/tokens_per_second": float(mask.sum()) / (finished - started),
        })
        if batch.values is not None:
            metrics.update(critic_metrics(batch.values, batch.returns, mask))
        self.last_batch = batch
        return metrics

    def skip_iteration(self) -> None:
        """Count iteration `self.iteration + 1` as done without training on its batch (a reward
        failed on it and the recipe says skip): no optimiser step, no KL update."""
        self.iteration += 1

    def sample_responses(self, records: list[dict], greedy: bool = False) -> list[str]:
        """Responses of the current weights to `records`, a batch at a time, without touching the
        training random stream (for before/after reports)."""
        size = self.recipe.ppo.batch_size
        chunks = [encode_prompts(self.tokenizer, records[start:start + size], self.device, self.max_prompt_tokens)
                  for start in range(0, len(records), size)]
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            generations = self._generate(chunks, greedy)
        self.parts.generator.metrics()  # its sync time is the report's, not the next iteration's
        return [text for g in generations for text in self.tokenizer.batch_decode(g.response_ids, skip_special_tokens=True)]
