# pyright: standard
"""Held-out evaluation: how the policy does on prompts it never trains on.

The training batch's reward alone can rise through over-optimisation; a score on held-out prompts,
with greedy responses by default and any extra reward components as metrics, shows whether the
policy got better at the task. `[eval] size` prompts are set aside from the data before training
(a seeded choice, the same on every resume) and never reach a training batch. Evaluation runs in a
forked random stream with a fixed seed, so it changes nothing a resumed run would see.
"""

from __future__ import annotations

import torch

from rlkit_core.context import BuildContext
from rlkit_core.errors import RecipeError, RunError
from rlkit_core.functional import masked_sum
from rlkit_core.randomness import evaluation_seed, held_out_generator
from rlkit_core.recipe.assemble import Components
from rlkit_core.recipe.document import ComponentChoice, Recipe
from rlkit_core.runtime.engine import Engine
from rlkit_core.runtime.episodes import figure_means
from rlkit_core.runtime.faults import checked_scores
from rlkit_core.runtime.prompt_stream import Prompts
from rlkit_core.runtime.rollout import rollout
from rlkit_core.runtime.targets import compare_to_reference


def hold_out(records: list[dict], size: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(held-out records, training records): `size` records chosen by `seed`, each in its original order."""
    if not size:
        return [], records
    if size >= len(records):
        raise RecipeError([f"$.eval.size: {size} held-out prompts would leave none of the {len(records)} for training; "
                           "lower eval.size or give more data"])
    order = torch.randperm(len(records), generator=held_out_generator(seed)).tolist()
    held = set(order[:size])
    return [r for i, r in enumerate(records) if i in held], [r for i, r in enumerate(records) if i not in held]


class Evaluator:
    """Scores the current policy on the held-out records."""

    def __init__(self, recipe: Recipe, engine: Engine, components: Components, context: BuildContext, prompts: Prompts):
        self.recipe, self.engine, self.components = recipe, engine, components
        self.records, self.max_prompt_tokens = prompts.held_out, prompts.max_tokens
        self.config = recipe.eval
        self.metrics = {c.name: context.build(ComponentChoice(f"eval.metrics[{i}]", c, c.config_class()))
                        for i, c in enumerate(recipe.eval_metrics)}

    @property
    def enabled(self) -> bool:
        return bool(self.records)

    def due(self, iteration: int) -> bool:
        """Whether to evaluate after `iteration` (besides before the first, which the run does itself)."""
        every, last = self.config.every, self.recipe.run.steps
        return self.enabled and (iteration == last or bool(every) and iteration % every == 0)

    @torch.no_grad()
    def __call__(self) -> dict[str, float]:
        """Means over the held-out records: `eval/score` (the run's reward), `eval/<metric>` for each
        extra metric, `eval/length`, `eval/eos_rate`, and `eval/kl` when responses are sampled; in
        a multi-turn recipe also each `env/<name>` of the episodes as `eval/<name>` (`eval/won`): the
        mean over every held-out episode that reported it, whichever chunk it was played in."""
        recipe, engine, components = self.recipe, self.engine, self.components
        device = engine.device
        sums, count, totals, hung = {}, 0, [], {}
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(evaluation_seed(recipe.run.seed))
            for start in range(0, len(self.records), recipe.ppo.batch_size):
                chunk = self.records[start:start + recipe.ppo.batch_size]
                batch, stage = rollout(engine, components, recipe, chunk, 1, self.max_prompt_tokens,
                                       greedy=self.config.greedy, totals=totals)
                if "env/hung_calls" in stage:  # a count of calls still running, not a mean: the last chunk's
                    hung = {"eval/hung_calls": stage["env/hung_calls"]}
                assert batch.scores is not None and batch.ended is not None  # a rollout is scored
                values = {
                    "eval/score": batch.scores,
                    "eval/length": batch.loss_mask.sum(dim=1).float(),
                    "eval/eos_rate": batch.ended.float(),
                }
                if not self.config.greedy:  # a KL estimate needs tokens sampled from π
                    compared = compare_to_reference(engine, components, recipe, batch)
                    assert compared.kl is not None
                    values["eval/kl"] = masked_sum(compared.kl, compared.loss_mask, dim=1)
                for name, reward in self.metrics.items():
                    values[f"eval/{name}"] = torch.tensor(_metric_scores(name, reward, batch))
                for name, per_response in values.items():
                    sums[name] = sums.get(name, 0.0) + float(per_response.sum())
                count += len(batch)
        # an episode's outcomes (`env/won`) over every episode that reported them, whichever chunk it was in
        outcomes = {f"eval/{name.removeprefix('env/')}": mean for name, mean in figure_means(totals).items()}
        return {**{name: total / count for name, total in sums.items()}, **outcomes, **hung}


def _metric_scores(name: str, reward, batch) -> list[float]:
    """An extra metric's scores, checked as the trainer checks the run's reward."""
    try:
        return checked_scores(reward.score(batch.prompts, batch.responses, **batch.columns), len(batch))
    except ValueError as exc:
        raise RunError(f"eval.metrics {name!r} {exc}") from None
