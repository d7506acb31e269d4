# pyright: standard
"""Stage 1, rollouts: episodes played with the current policy, scored. Every recipe takes this one
path: a recipe without an environment plays episodes of one turn (`rlkit_core.runtime.episodes`)."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from rlkit_core.batch import RolloutBatch
from rlkit_core.errors import RecipeError, RunError
from rlkit_core.functional import shaped_scores
from rlkit_core.interfaces import Generation, RewardSource
from rlkit_core.recipe.assemble import Components
from rlkit_core.recipe.document import Recipe
from rlkit_core.runtime.distributed import Processes
from rlkit_core.runtime.engine import RolloutEngine
from rlkit_core.runtime.episodes import EpisodeRunner, episode_totals, episodes_batch, figure_means, transcript
from rlkit_core.runtime.faults import BadReward, checked_scores, failure_text


def record_columns(records: list[dict]) -> dict[str, list]:
    """The records' fields other than the prompt, as columns (the reward's keyword arguments)."""
    keys = dict.fromkeys(key for r in records for key in r if key != "prompt")
    return {key: [r.get(key) for r in records] for key in keys}


def rollout(engine: RolloutEngine, components: Components, recipe: Recipe, records: list[dict], samples_per_prompt: int, max_prompt_tokens: int,
            greedy: bool = False, rewarded: bool = True, totals: list[dict[str, tuple[float, int]]] | None = None
            ) -> tuple[RolloutBatch, dict[str, float]]:
    """`samples_per_prompt` episodes from each record, scored: the environment's rewards, plus the
    recipe's reward (when it has one) on each episode's transcript; and the stage's timings, the
    generator's metrics and, with an environment, `env/...` metrics (means over every process's
    episodes). One path for every recipe: without an environment an episode is one turn, the
    record's prompt (cut to `max_prompt_tokens`, 0: not cut) and one response
    (`rlkit_core.runtime.episodes`). `rewarded` False: the recipe's reward is not called (the
    report's rollouts, whose transcripts the report scores itself). `totals`: a list that each
    process's `episode_totals` are added to, for means over several rollouts (the held-out evaluation's chunks)."""
    k, processes, tokenizer = samples_per_prompt, engine.processes, components.policy.tokenizer
    records = [r for r in records for _ in range(k)]
    groups = [i // k + processes.index * (len(records) // k) for i in range(len(records))]
    # an environment's resets take seeds from the training stream (a resumed run replays them); one-turn episodes draw none
    seeds = torch.randint(2**31 - 1, (len(records),)).tolist() if components.environment is not None else [0] * len(records)
    runner = EpisodeRunner(engine, components, recipe, max_prompt_tokens)
    episodes = runner(records, groups, seeds, greedy)
    splits = sum(len(e.samples) - 1 for e in episodes)
    # only an environment's episodes can split (one-turn episodes skip this collective)
    if components.environment is not None and processes.count > 1 and processes.sum(torch.tensor(splits, device=engine.device)):
        raise RunError("the chat template rewrote an episode's history, which starts a new training sample, and samples "
                       "that split do not yet spread evenly over processes; run with one process, or use a chat format "
                       "that extends the stream (`rlkit check` audits it)")
    scored = time.perf_counter()
    transcripts = [transcript(tokenizer, e) for e in episodes]
    scores = [e.reward for e in episodes]
    if components.reward is not None and rewarded:
        extra = score(processes, components.reward, [str(r["prompt"]) for r in records], transcripts, record_columns(records))
        scores = [a + b for a, b in zip(scores, extra)]
    finished = time.perf_counter()
    batch = episodes_batch(episodes, scores, tokenizer.pad_token_id, engine.device, first_id=processes.index * len(episodes),
                           turn_rewards=components.environment is not None)
    batch = batch.with_(responses=[text for e, text in zip(episodes, transcripts) for _ in e.samples])
    metrics = {}
    if components.environment is not None:
        gathered = processes.gather_objects((episode_totals(episodes), runner.hung_calls))
        if totals is not None:
            totals += [t for t, _ in gathered]
        metrics = figure_means([t for t, _ in gathered])  # over every process's episodes, not a mean of their means
        metrics["env/hung_calls"] = float(sum(hung for _, hung in gathered))  # calls past their timeout still running
        metrics["time/environment"] = runner.timings["environment"]
    metrics.update({"time/generate": runner.timings["generate"], "time/score": finished - scored, **components.generator.pop_metrics(),
                    **engine.push_check.pop_metrics()})
    return batch, metrics


@contextlib.contextmanager
def sampling(engine: RolloutEngine, components: Components, prompts: list[tuple[torch.Tensor, torch.Tensor]]):
    """A block in which the generator samples from the current weights: read whole (FSDP gathers
    them in every process), synced once into an engine of its own (vLLM last saw them before the
    last update), under the run's mixed precision unless the generator runs its own
    (`Generator.runs_own_precision`). `prompts`: the first (ids, mask) chunks it will sample for
    (the weight push's probe comes from them). A rollout's episodes play every turn in one block."""
    with engine.full_weights():
        components.generator.sync_weights(components.policy)
        engine.push_check.after_push(engine, components.generator, components.policy, prompts)
        with contextlib.nullcontext() if type(components.generator).runs_own_precision else engine.autocast():
            yield components.generator


def generate(engine: RolloutEngine, components: Components, prompts: list[tuple[torch.Tensor, torch.Tensor]], greedy: bool
             ) -> list[Generation]:
    """The generator's output for each (prompt ids, mask) chunk, from the current weights (`sampling`):
    a generator's calls outside an episode (benchmarks, tests)."""
    with sampling(engine, components, prompts) as generator:
        return [generator.generate(ids, mask, greedy=greedy) for ids, mask in prompts]


def score(processes: Processes, reward: RewardSource, prompts: list[str], responses: list[str], columns: dict) -> list[float]:
    """The reward's scores, checked here, where every reward source passes. A reward that
    raises or breaks its contract on any process is a `BadReward` on every process, so that
    all of them stop or skip together."""
    problem: dict[str, Any] | None = None
    scores: list[float] = []
    try:
        returned = reward.score(prompts, responses, **columns)
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
    problems = [p for p in processes.gather_objects(problem) if p]
    if problems:
        raise BadReward(problems[0].pop("problem"), problems[0])
    return scores


def shaped(recipe: Recipe, scores: torch.Tensor, ended: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Scores as the rewards take them, with the recipe's penalties and clip (`shaped_scores`)."""
    ppo = recipe.ppo
    limit = recipe["generator"].config.max_new_tokens if ppo.overlong_buffer else 0
    return shaped_scores(scores, ended, lengths, ppo.missing_eos_penalty, limit, ppo.overlong_buffer, ppo.overlong_penalty,
                         ppo.score_clip)


def greedy_baseline(engine: RolloutEngine, components: Components, recipe: Recipe, records: list[dict], batch: RolloutBatch,
                    max_prompt_tokens: int) -> tuple[RolloutBatch, dict[str, float]]:
    """`batch` with `baseline_scores`: the shaped score of the greedy response to each of `records`
    (ReMax's baseline), given to every sample of that prompt."""
    greedy, timing = rollout(engine, components, recipe, records, 1, max_prompt_tokens, greedy=True)
    assert greedy.scores is not None and greedy.ended is not None  # a rollout is scored
    baseline = shaped(recipe, greedy.scores, greedy.ended, greedy.loss_mask.sum(dim=1)).repeat_interleave(recipe.ppo.samples_per_prompt)
    return batch.with_(baseline_scores=baseline), {"time/baseline": timing["time/generate"] + timing["time/score"]}


def _one_per_episode(batch: RolloutBatch) -> list[str]:
    """The transcript of each episode of `batch` once (a split episode has several rows)."""
    assert batch.responses is not None  # a rollout decodes its responses
    return list(dict(zip(batch.group_ids.tolist(), batch.responses)).values())


def sample_responses(engine: RolloutEngine, components: Components, recipe: Recipe, records: list[dict], batch_size: int, max_prompt_tokens: int,
                     greedy: bool = False) -> list[str]:
    """The transcripts of the current weights' episodes from `records` (a rollout of one episode
    each, the recipe's reward not called), `batch_size` at a time, without touching the training
    random stream (for before/after reports)."""
    device = engine.device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        # each rollout takes the generator's figures (its sync time) with it: they are the report's, not the next iteration's
        batches = [rollout(engine, components, recipe, records[start:start + batch_size], 1, max_prompt_tokens, greedy, rewarded=False)[0]
                   for start in range(0, len(records), batch_size)]
    return [response for batch in batches for response in _one_per_episode(batch)]
