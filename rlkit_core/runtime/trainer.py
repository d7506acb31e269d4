"""One PPO iteration, read top to bottom:

prompts → generate → score → old/reference log-probs and values → per-token rewards with the KL
penalty → advantages → epochs of shuffled minibatches → KL controller update → metrics.

The trainer builds a run's parts once (the engine, the components, the prompts) and calls the
stages in order with them: `rollout` (stage 1), `targets` (stage 2), `update` (stage 3). Its state
between iterations is a `RunState`; every stage's own logic lives in its module, in a component or
in `rlkit_core.functional`.
"""

from __future__ import annotations

import json
import time
import zlib
from pathlib import Path

import attrs
import torch

from rlkit_core.batch import RolloutBatch
from rlkit_core.context import BuildContext
from rlkit_core.errors import RunError
from rlkit_core.functional import explained_variance, masked_mean, masked_sum, masked_var
from rlkit_core.launch import Launch
from rlkit_core.prompts import PromptLengthLimit, prepare_prompts, within_context
from rlkit_core.randomness import sampling_seed
from rlkit_core.recipe.assemble import build_components
from rlkit_core.recipe.document import Recipe
from rlkit_core.runtime import rollout, targets, update
from rlkit_core.runtime.checkpoint import load_checkpoint
from rlkit_core.runtime.distributed import critic_problem
from rlkit_core.runtime.dynamic_sampling import DynamicSampler
from rlkit_core.runtime.engine import Engine, start_accelerator
from rlkit_core.runtime.evaluation import hold_out
from rlkit_core.runtime.forward import ForwardObserver
from rlkit_core.runtime.prompt_stream import Prompts, PromptStream
from rlkit_core.runtime.scheduling import Producer
from rlkit_core.runtime.state import RunState


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


@attrs.frozen
class Iteration:
    metrics: dict[str, float]  # over the global batch, with the timings of this process
    batch: RolloutBatch  # the global batch it trained on, scored and with its targets (when it trained)
    trained: bool = True  # False: no token of the batch trained, and nothing was updated


class Trainer:
    """The engine, the components, the prompts and the run's state, and the stages called with them.

    `observe`: told of every forward pass (a benchmark's `PositionCount`); None in real runs.
    `launch`: the one the recipe was checked for (default: this process's, read from the environment)."""

    def __init__(self, recipe: Recipe, device: torch.device | None = None, observe: ForwardObserver | None = None,
                 launch: Launch | None = None):
        self.recipe = recipe
        self.launch = launch or Launch.from_environment()
        run, ppo = recipe.run, recipe.ppo
        if run.threads:
            torch.set_num_threads(run.threads)
        torch.manual_seed(run.seed)
        accelerator, processes, device = start_accelerator(recipe, self.launch, device)
        self.context = BuildContext(recipe=recipe, device=device, output_dir=str(Path(run.output_dir)), seed=run.seed,
                                    launch=self.launch)
        self.components = components = build_components(recipe, self.context)
        if processes.sharded and (problem := critic_problem(components.value_head)):
            raise RunError(problem)
        self.prompts = self._prompts(processes.index)
        self.stream = PromptStream(self.prompts.train, ppo.batch_size // ppo.samples_per_prompt, run.seed)
        self.engine = Engine(recipe, accelerator, processes, device, components.policy, components.value_head)
        self.dynamic_sampler = DynamicSampler(recipe, self.engine, components, self.prompts) if ppo.dynamic_sampling else None
        self.observe = observe
        self.state = RunState()
        self.producer: Producer | None = None  # started at the first iteration (after a resume has set the state)

    def close(self) -> None:
        """Stop the thread that makes batches ahead, if any (its batches are made again on resume)."""
        if self.producer is not None:
            self.producer.close()
            self.producer = None

    def _prompts(self, process: int) -> Prompts:
        """The data's prompts, rendered, within the length limit and the policy's context, with the
        hold-out set aside; then this process's own sampling stream is seeded."""
        recipe, policy = self.recipe, self.components.policy
        limit = recipe["data"].config if isinstance(recipe["data"].config, PromptLengthLimit) else None
        generator = recipe["generator"].config
        limit = within_context(limit, policy.context_length, generator.max_new_tokens)
        records, counts = prepare_prompts(self.components.data.load(), policy.tokenizer, limit)
        held_out, train = hold_out(records, recipe.eval.size, recipe.run.seed)
        if process:  # every process built the same components; now each samples its own
            torch.manual_seed(sampling_seed(recipe.run.seed, process))
        return Prompts(train=train, held_out=held_out, counts=counts, max_tokens=limit.max_prompt_tokens if limit else 0)

    def resume(self, path: Path) -> dict:
        """Continue from the checkpoint at `path`; returns its meta (iteration, run id, recipe)."""
        self.state, meta = load_checkpoint(self.engine, self.components, path)
        return meta

    # --- the stages, with this run's parts ---------------------------------------------------
    def stream_records(self, iteration: int) -> list[dict]:
        """This process's prompt records of iteration `iteration + 1`."""
        return self.engine.processes.share(self.stream.batch(iteration))

    def make_batch(self, records: list[dict], components, engine) -> tuple[RolloutBatch, dict[str, float]]:
        """Stage 1 with `components` and `engine` (the run's, or a scheduler producer's: a generator
        on a copy of the weights, collectives over a process group of its own)."""
        return rollout.rollout(engine, components, self.recipe, records, self.recipe.ppo.samples_per_prompt, self.prompts.max_tokens)

    def rollout(self, records: list[dict], samples_per_prompt: int | None = None, greedy: bool = False) -> tuple[RolloutBatch, dict[str, float]]:
        """Sample `samples_per_prompt` (default: the recipe's) responses for each record and score them."""
        return rollout.rollout(self.engine, self.components, self.recipe, records, samples_per_prompt or self.recipe.ppo.samples_per_prompt,
                               self.prompts.max_tokens, greedy)

    def greedy_baseline(self, records: list[dict], batch: RolloutBatch) -> tuple[RolloutBatch, dict[str, float]]:
        return rollout.greedy_baseline(self.engine, self.components, self.recipe, records, batch, self.prompts.max_tokens)

    def shaped(self, scores: torch.Tensor, ended: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return rollout.shaped(self.recipe, scores, ended, lengths)

    def compare_to_reference(self, batch: RolloutBatch) -> RolloutBatch:
        return targets.compare_to_reference(self.engine, self.components, self.recipe, batch, self.observe)

    def with_advantages(self, batch: RolloutBatch) -> RolloutBatch:
        return targets.with_advantages(self.engine, self.components, self.recipe, batch, self.observe)

    def train_on(self, batch: RolloutBatch) -> dict[str, float]:
        """The update on `batch` (`rlkit_core.runtime.update`); its count of non-finite steps is kept."""
        result = update.update(self.engine, self.components, self.recipe, batch, self.state, self.observe)
        self.state = attrs.evolve(self.state, nonfinite_in_a_row=result.nonfinite_in_a_row)
        return result.metrics

    def sample_responses(self, records: list[dict], greedy: bool = False) -> list[str]:
        """Responses of the current weights to `records`, a batch at a time, without touching the
        training random stream (for before/after reports)."""
        return rollout.sample_responses(self.engine, self.components, self.recipe, records, self.recipe.ppo.batch_size, self.prompts.max_tokens, greedy)

    # --- one whole iteration -------------------------------------------------------------------
    def step(self) -> dict[str, float]:
        """Run iteration `state.iteration + 1` and return its metrics (`iterate`)."""
        return self.iterate().metrics

    def iterate(self) -> Iteration:
        """Run iteration `state.iteration + 1`: its metrics, over the global batch, with the timings
        of this process, and that batch."""
        started = time.perf_counter()
        engine, components, iteration = self.engine, self.components, self.state.iteration
        records = self.stream_records(iteration)
        scheduler = self.recipe.scheduler
        if scheduler.type == "sync":
            batch, metrics = self.dynamic_sampler.rollout(records, iteration) if self.dynamic_sampler else self.rollout(records)
        else:  # made ahead, from a copy of the weights (`rlkit_core.runtime.scheduling`)
            if self.producer is None:
                self.producer = Producer(self, scheduler.staleness_bound, scheduler.wait_timeout_s)
            batch, metrics = self.producer.take(iteration)
        if not int(engine.processes.sum(batch.loss_mask.sum())):  # no token of any process's batch trains
            return self._untrained(batch, metrics, started)
        if type(components.advantage).needs_baseline_scores:  # a flag of the class, as the recipe check reads it
            batch, timing = self.greedy_baseline(records, batch)
            metrics.update(timing)
        forward_started = time.perf_counter()
        batch = self.with_advantages(batch)
        train_started = time.perf_counter()
        updated = update.update(engine, components, self.recipe, batch, self.state, self.observe)
        metrics.update(updated.metrics)
        finished = time.perf_counter()

        batch = engine.processes.gather_batch(batch, components.policy.tokenizer.pad_token_id)  # the metrics are global
        # the rollouts that train (some do, `_untrained` otherwise): an episode kept out of training (a fault) has no counted token
        trained = batch.loss_mask.any(dim=1)
        batch_trained = batch if trained.all() else batch.select(trained.nonzero().squeeze(1))
        assert batch_trained.kl is not None  # compared with the reference before the update
        mask = batch_trained.loss_mask
        kl_per_sequence = masked_sum(batch_trained.kl, mask, dim=1)
        kl_now = float(kl_per_sequence.mean())
        beta = components.kl.beta
        components.kl.update(kl_now, len(batch_trained))
        assert batch_trained.scores is not None and batch_trained.ended is not None and batch_trained.old_logprobs is not None
        self.state = self.state.trained(updated.nonfinite_in_a_row)
        metrics.update({
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
            "time/forward": train_started - forward_started,
            "time/train": finished - train_started,
            "time/iteration": finished - started,
            "time/tokens_per_second": float(batch.response_mask.sum()) / (finished - started),  # every response position forwarded
            "data/prompts_crc": data_checksum(batch),
        })
        if batch_trained.values is not None and batch_trained.returns is not None:
            metrics.update(critic_metrics(batch_trained.values, batch_trained.returns, mask))
        return Iteration(metrics, batch)

    def _untrained(self, batch: RolloutBatch, metrics: dict[str, float], started: float) -> Iteration:
        """An iteration whose batch has no token to train (every episode kept out of training): no
        update, the KL controller and β as they were, no score or KL that was not measured; the
        rollout's own figures (`env/status_...`), counted in the state (the run stops on a streak of
        them: `rlkit_core.runtime.run`)."""
        batch = self.engine.processes.gather_batch(batch, self.components.policy.tokenizer.pad_token_id)
        self.state = self.state.untrained()
        metrics.update({"run/untrained_batches": float(self.state.untrained_batches), "data/prompts_crc": data_checksum(batch),
                        "time/iteration": time.perf_counter() - started})
        return Iteration(metrics, batch, trained=False)

    def skip_iteration(self) -> None:
        """Count iteration `state.iteration + 1` as done without training on its batch (a reward
        failed on it and the recipe says skip): no optimiser step, no KL update."""
        self.state = self.state.reward_failed().skipped()
