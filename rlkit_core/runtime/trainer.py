# pyright: standard
"""One PPO iteration, read top to bottom:

prompts → generate → score → old/reference log-probs and values → per-token rewards with the KL
penalty → advantages → epochs of shuffled minibatches → KL controller update → metrics.

The trainer builds a run's parts once (the engine, the components, the prompts) and calls the
stages in order with them: `rollout` (stage 1), `targets` (stage 2), `update` (stage 3),
`after_update` (stage 4). Its state between iterations is a `RunState`; every stage's own logic
lives in its module, in a component or in `rlkit_core.functional`. Code that runs a stage by
itself (a test, a benchmark) calls the stage's function with the trainer's parts.
"""

from __future__ import annotations

import time
from pathlib import Path

import attrs
import torch

from rlkit_core.batch import RolloutBatch
from rlkit_core.context import BuildContext
from rlkit_core.errors import RunError
from rlkit_core.launch import Launch
from rlkit_core.prompts import PromptLengthLimit, prepare_prompts, within_context
from rlkit_core.randomness import sampling_seed
from rlkit_core.recipe.assemble import build_components
from rlkit_core.recipe.document import Recipe
from rlkit_core.runtime import rollout, targets, update
from rlkit_core.runtime.after_update import after_update, data_checksum
from rlkit_core.runtime.batch_sources import Batches, SamplingView, source_for
from rlkit_core.runtime.checkpoint import load_checkpoint
from rlkit_core.runtime.distributed import critic_problem
from rlkit_core.runtime.dynamic_sampling import DynamicSampler
from rlkit_core.runtime.engine import Engine, start_accelerator
from rlkit_core.runtime.evaluation import hold_out
from rlkit_core.runtime.forward import ForwardObserver
from rlkit_core.runtime.prompt_stream import Prompts, PromptStream
from rlkit_core.runtime.state import RunState


@attrs.frozen
class Iteration:
    metrics: dict[str, float]  # over the global batch, with the timings of this process
    batch: RolloutBatch  # the global batch it trained on, scored and with its targets (when it trained)
    trained: bool = True  # False: no token of the batch trained, and nothing was updated


class Trainer:
    """The engine, the components, the prompts and the run's state; `iterate` calls the stages with them.

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
        self.source: Batches | None = None  # built at the first iteration (after a resume has set the state)

    @property
    def state(self) -> RunState:
        return self._state

    @state.setter
    def state(self, state: RunState) -> None:
        """The run's state; the policy's weights are labelled with its iteration (`Policy.weights_version`)."""
        self._state = state
        self.components.policy.weights_version = state.iteration

    def close(self) -> None:
        """Close the batch source: batches made ahead and not taken are made again on resume."""
        if self.source is not None:
            self.source.close()
            self.source = None

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

    def stream_records(self, iteration: int) -> list[dict]:
        """This process's prompt records of iteration `iteration + 1` (its share of the prompt stream's batch)."""
        return self.engine.processes.share(self.stream.batch(iteration))

    # --- one whole iteration -------------------------------------------------------------------
    def step(self) -> dict[str, float]:
        """Run iteration `state.iteration + 1` and return its metrics (`iterate`)."""
        return self.iterate().metrics

    def iterate(self) -> Iteration:
        """Run iteration `state.iteration + 1`: its metrics, over the global batch, with the timings
        of this process, and that batch."""
        started = time.perf_counter()
        engine, components, recipe, iteration = self.engine, self.components, self.recipe, self.state.iteration
        records = self.stream_records(iteration)
        batch, metrics = self._rollouts(iteration)
        if not int(engine.processes.sum(batch.loss_mask.sum())):  # no token of any process's batch trains
            return self._untrained(batch, metrics, started)
        if type(components.advantage).needs_baseline_scores:  # a flag of the class, as the recipe check reads it
            batch, timing = rollout.greedy_baseline(engine, components, recipe, records, batch, self.prompts.max_tokens)
            metrics.update(timing)
        forward_started = time.perf_counter()
        batch = targets.with_advantages(engine, components, recipe, batch, self.observe)
        train_started = time.perf_counter()
        updated = update.update(engine, components, recipe, batch, self.state, self.observe)
        metrics.update(updated.metrics)
        finished = time.perf_counter()
        timings = {"time/forward": train_started - forward_started, "time/train": finished - train_started,
                   "time/iteration": finished - started}
        batch, after = after_update(engine, components, batch, timings)
        metrics.update(after)
        self.state = self.state.trained(updated.nonfinite_in_a_row)
        return Iteration(metrics, batch)

    def _rollouts(self, iteration: int) -> tuple[RolloutBatch, dict[str, float]]:
        """Stage 1 of iteration `iteration + 1`, from the recipe's batch source
        (`rlkit_core.runtime.batch_sources`), built at the first iteration."""
        if self.source is None:
            self.source = source_for(self.sampling_view(), self.state.iteration, self.dynamic_sampler)
        return self.source.take(iteration)

    def sampling_view(self) -> SamplingView:
        """What a batch source samples with: the trainer's parts that stage 1 reads, and no more."""
        return SamplingView(self.components, self.engine, self.recipe, self.context, self.stream_records, self.prompts.max_tokens)

    def _untrained(self, batch: RolloutBatch, metrics: dict[str, float], started: float) -> Iteration:
        """An iteration whose batch has no token to train (every episode kept out of training): no
        update, the KL controller and β as they were, no score or KL that was not measured; the
        rollout's own figures (`env/status_...`), counted in the state (the run stops on a streak of
        them: `rlkit_core.runtime.run`)."""
        batch = self.engine.processes.gather_batch(batch, self.components.policy.tokenizer.pad_token_id).by_episode().batch
        self.state = self.state.untrained()
        metrics.update({"run/untrained_batches": float(self.state.untrained_batches), "data/prompts_crc": data_checksum(batch),
                        "time/iteration": time.perf_counter() - started})
        return Iteration(metrics, batch, trained=False)

    def skip_iteration(self) -> None:
        """Count iteration `state.iteration + 1` as done without training on its batch (a reward
        failed on it and the recipe says skip): no optimiser step, no KL update."""
        self.state = self.state.reward_failed().skipped()
