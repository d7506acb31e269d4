# pyright: standard
"""Stage 1, rollouts: responses sampled from the current policy, scored by the reward."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from rlkit_core.batch import RolloutBatch
from rlkit_core.errors import RecipeError
from rlkit_core.functional import shaped_scores
from rlkit_core.interfaces import Generation, RewardSource
from rlkit_core.prompts import encode_prompts
from rlkit_core.recipe.assemble import Components
from rlkit_core.recipe.document import Recipe
from rlkit_core.runtime.distributed import Processes
from rlkit_core.runtime.engine import RolloutEngine
from rlkit_core.runtime.episodes import episode_rollout
from rlkit_core.runtime.faults import BadReward, checked_scores, failure_text


def record_columns(records: list[dict]) -> dict[str, list]:
    """The records' fields other than the prompt, as columns (the reward's keyword arguments)."""
    keys = dict.fromkeys(key for r in records for key in r if key != "prompt")
    return {key: [r.get(key) for r in records] for key in keys}


def rollout(engine: RolloutEngine, components: Components, recipe: Recipe, records: list[dict], samples_per_prompt: int, max_prompt_tokens: int,
            greedy: bool = False) -> tuple[RolloutBatch, dict[str, float]]:
    """`samples_per_prompt` responses to each record, scored; and the stage's timings and the
    generator's metrics. Prompts are cut to `max_prompt_tokens` (0: not cut). A recipe with an
    environment plays episodes instead (`rlkit_core.runtime.episodes`)."""
    if components.environment is not None:
        return episode_rollout(engine, components, recipe, records, samples_per_prompt, greedy)
    assert components.reward is not None  # a recipe without an environment names a reward (the recipe check)
    k, device, tokenizer = samples_per_prompt, engine.device, components.policy.tokenizer
    records = [r for r in records for _ in range(k)]
    prompts = [r["prompt"] for r in records]
    columns = record_columns(records)
    group_ids = torch.arange(len(records), device=device) // k + engine.processes.index * (len(records) // k)
    prompt_ids, prompt_mask = encode_prompts(tokenizer, records, device, max_prompt_tokens)

    started = time.perf_counter()
    [generation] = generate(engine, components, [(prompt_ids, prompt_mask)], greedy)
    generated = time.perf_counter()
    mask = generation.response_mask  # single turn: every response token was sampled, so all of them count
    ended = torch.isin(generation.response_ids, torch.tensor(components.policy.eos_token_ids, device=device)).any(dim=1)
    responses = tokenizer.batch_decode(generation.response_ids, skip_special_tokens=True)
    scores = score(engine.processes, components.reward, prompts, responses, columns)
    scored = time.perf_counter()
    batch = RolloutBatch(
        prompts=prompts, columns=columns, group_ids=group_ids, prompt_ids=prompt_ids, prompt_mask=prompt_mask,
        response_ids=generation.response_ids, response_mask=mask, loss_mask=mask, sampled_logprobs=generation.logprobs,
        responses=responses, ended=ended, scores=torch.tensor(scores, dtype=torch.float32, device=device),
    )
    return batch, {"time/generate": generated - started, "time/score": scored - generated, **components.generator.pop_metrics(),
                   **engine.push_check.pop_metrics()}


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
    """The generator's output for each (prompt ids, mask) chunk, from the current weights (`sampling`)."""
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
    """Responses of the current weights to `records`, `batch_size` at a time, without touching the
    training random stream (for before/after reports)."""
    device, tokenizer = engine.device, components.policy.tokenizer
    if components.environment is not None:  # the episodes' transcripts, a batch at a time
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            batches = [rollout(engine, components, recipe, records[start:start + batch_size], 1, max_prompt_tokens, greedy)[0]
                       for start in range(0, len(records), batch_size)]
        return [response for b in batches for response in _one_per_episode(b)]
    prompts = [encode_prompts(tokenizer, records[start:start + batch_size], device, max_prompt_tokens)
               for start in range(0, len(records), batch_size)]
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        generations = generate(engine, components, prompts, greedy)
    components.generator.pop_metrics()  # its sync time is the report's, not the next iteration's
    engine.push_check.pop_metrics()
    return [text for g in generations for text in tokenizer.batch_decode(g.response_ids, skip_special_tokens=True)]
