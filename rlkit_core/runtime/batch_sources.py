# pyright: standard
"""Where each iteration's batch comes from: the seam between stage 1 and the update.

The trainer takes iteration j's batch from a batch source (`take(j)`), built once, at its first
iteration (after a resume has set where the run starts), and closed with the run. A source sees a
declared view of what it samples with (`SamplingView`), not the trainer: the run's components (the
policy to sample from, the generator, the environment and reward), its rollout engine, the recipe,
how to build another generator of the recipe's, and the prompt stream. The update, the optimiser
and the run's state are not in it.

The core has two sources, chosen by `[scheduler] max_staleness`: 0, `SyncSource`, which samples
each batch when it is taken, from the module being trained; above 0, the producer that makes
batches ahead (`rlkit_core.runtime.scheduling.Producer`). A recipe's `[batch_source]` table names a
plugin's source (`rlkit_core.interfaces.BatchSource`) in their place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import attrs

from rlkit_core import interfaces
from rlkit_core.batch import RolloutBatch
from rlkit_core.context import BuildContext
from rlkit_core.recipe.assemble import Components
from rlkit_core.recipe.document import Recipe
from rlkit_core.runtime import rollout
from rlkit_core.runtime.dynamic_sampling import DynamicSampler
from rlkit_core.runtime.engine import Engine, RolloutEngine


@attrs.frozen
class SamplingView:
    """What a batch source samples with (see the module)."""

    components: Components
    engine: Engine
    recipe: Recipe
    context: BuildContext  # builds a generator of the recipe's on another policy view (a producer's copy)
    records: Callable[[int], list[dict]]  # this process's share of the prompt stream's batch of iteration j (0-based)
    max_prompt_tokens: int  # the prompts' length limit, for the rows stage 1 makes

    def rollout(self, iteration: int, components: Components | None = None,
                engine: RolloutEngine | None = None) -> tuple[RolloutBatch, dict[str, float]]:
        """Stage 1 on the prompt stream's batch of `iteration`, with the run's components and engine
        or those given (a producer's generator on a copy of the weights, its own process group)."""
        return rollout.rollout(engine or self.engine, components or self.components, self.recipe, self.records(iteration),
                               self.recipe.ppo.samples_per_prompt, self.max_prompt_tokens)


class Batches(Protocol):
    """What the trainer takes each iteration's batch from: a core source, or a plugin's behind `PluginSource`."""

    def take(self, iteration: int) -> tuple[RolloutBatch, dict[str, float]]:
        """The batch of `iteration` (0-based) and its stage-1 metrics."""
        ...

    def close(self) -> None:
        """Stop whatever makes batches; a batch not taken is made again on resume."""
        ...


class SyncSource:
    """Each batch sampled when it is taken, from the module being trained (with DAPO's dynamic
    sampling when the recipe asks)."""

    def __init__(self, view: SamplingView, dynamic_sampler: DynamicSampler | None):
        self.view, self.dynamic_sampler = view, dynamic_sampler

    def take(self, iteration: int) -> tuple[RolloutBatch, dict[str, float]]:
        if self.dynamic_sampler is not None:
            return self.dynamic_sampler.rollout(self.view.records(iteration), iteration)
        return self.view.rollout(iteration)

    def close(self) -> None:
        pass


class PluginSource:
    """A plugin's `BatchSource` behind the seam: given the view at each take."""

    def __init__(self, source: interfaces.BatchSource, view: SamplingView):
        self.source, self.view = source, view

    def take(self, iteration: int) -> tuple[RolloutBatch, dict[str, float]]:
        return self.source.take(iteration, self.view)

    def close(self) -> None:
        self.source.close()


def source_for(view: SamplingView, start: int, dynamic_sampler: DynamicSampler | None) -> Batches:
    """The recipe's source, its first batch that of iteration `start`: the `[batch_source]`'s, else the core's."""
    from rlkit_core.runtime.scheduling import Producer

    if view.components.batch_source is not None:
        return PluginSource(view.components.batch_source, view)
    scheduler = view.recipe.scheduler
    if scheduler.runs_ahead:
        return Producer(view, start, scheduler.staleness_bound, scheduler.wait_timeout_s)
    return SyncSource(view, dynamic_sampler)
