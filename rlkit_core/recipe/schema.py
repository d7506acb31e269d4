"""The checks on a recipe's core tables (`[run]`, `[ppo]`, `[optim]`, ...; their classes are
records in `rlkit_core.records`, which plugins read) and across its tables.

Component tables (`[policy]`, `[kl]`, ...) are described by their plugins' own config classes;
`COMPONENT_TABLES` maps each table to its component kind and the type used when the table is absent. What depends
on how the run is launched is checked in `rlkit_core.recipe.launch`.
"""

import os
from pathlib import Path

from rlkit_core.errors import Problem
from rlkit_core.interfaces import KIND_TABLE
from rlkit_core.records import EvalConfig, HealthConfig, OptimConfig, PPOConfig, RunConfig, SchedulerConfig

CORE_TABLES = {"run": RunConfig, "ppo": PPOConfig, "optim": OptimConfig, "eval": EvalConfig, "health": HealthConfig,
               "scheduler": SchedulerConfig}

# table -> (component kind, type used when the table is absent; None: the table is required)
COMPONENT_TABLES = {kind.table: (kind.name, kind.default) for kind in KIND_TABLE}


def batch_arithmetic_problems(ppo: PPOConfig, processes: int = 1) -> list[Problem]:
    """Problems with how the rollout batch splits into groups, minibatches, processes and
    micro-batches, each located."""
    problems = []
    if ppo.batch_size % ppo.samples_per_prompt:
        problems.append(Problem(
            "$.ppo.batch_size", f"{ppo.batch_size} rollouts do not split into groups of samples_per_prompt="
                                f"{ppo.samples_per_prompt}; use a multiple of {ppo.samples_per_prompt}"
        ))
    if ppo.minibatch_size > ppo.batch_size:
        problems.append(Problem("$.ppo.minibatch_size", f"{ppo.minibatch_size} is larger than batch_size={ppo.batch_size}; "
                                                        f"use a divisor of {ppo.batch_size}"))
    elif ppo.batch_size % ppo.minibatch_size:
        problems.append(Problem(
            "$.ppo.minibatch_size", f"{ppo.minibatch_size} does not divide batch_size={ppo.batch_size}; "
                                    f"pick a divisor such as {_largest_divisor_at_most(ppo.batch_size, ppo.minibatch_size)}"
        ))
    prompts = ppo.batch_size // ppo.samples_per_prompt
    if problems:
        return problems
    if prompts % processes:
        problems.append(Problem("$.ppo.batch_size", f"its {prompts} prompts do not split evenly over {processes} processes; "
                                                    f"use a multiple of {processes * ppo.samples_per_prompt} rollouts"))
    if ppo.minibatch_size % processes:
        problems.append(Problem("$.ppo.minibatch_size", f"{ppo.minibatch_size} rollouts do not split evenly over {processes} "
                                                        f"processes; use a multiple of {processes}"))
    elif ppo.max_tokens_per_microbatch and ppo.gradient_accumulation_steps > 1:
        problems.append(Problem("$.ppo.gradient_accumulation_steps", f"{ppo.gradient_accumulation_steps} with max_tokens_per_microbatch "
                                                                     "set: the token budget decides the micro-batches; leave this at 1"))
    elif (ppo.minibatch_size // processes) % ppo.gradient_accumulation_steps:
        per_process = ppo.minibatch_size // processes
        problems.append(Problem("$.ppo.gradient_accumulation_steps",
                                f"the {per_process} rollouts of a minibatch in each of {processes} processes do not split into "
                                f"{ppo.gradient_accumulation_steps} micro-batches; pick a divisor such as "
                                f"{_largest_divisor_at_most(per_process, ppo.gradient_accumulation_steps)}"))
    if ppo.max_tokens_per_forward and ppo.forward_batch_size:
        problems.append(Problem("$.ppo.forward_batch_size", f"{ppo.forward_batch_size} with max_tokens_per_forward set: the token "
                                                            "budget decides the forward passes; leave this at 0"))
    return problems


def critic_problems(ppo: PPOConfig, advantage, value_head) -> list[Problem]:
    """An advantage estimator and the rest of the recipe that do not go together, each located:
    a critic-free estimator with a critic (trained for nothing) or with one sample per prompt when
    it compares a prompt's samples; `value_head.type = "none"` with an estimator that needs values.
    `advantage` and `value_head` are the checked component tables (`value_head` None: "none")."""
    estimator = advantage.component
    needs_values, needs_groups = estimator.factory.needs_values, estimator.factory.needs_groups
    problems = []
    if needs_values and value_head is None:
        problems.append(Problem("$.value_head.type", f"'none' builds no critic, but advantage estimator {estimator.name!r} needs "
                                                     "values; use 'shared' or 'separate', or a critic-free estimator such as 'grpo'"))
    elif not needs_values and value_head is not None:
        problems.append(Problem("$.value_head.type", f"advantage estimator {estimator.name!r} uses no critic, so the {value_head.component.name!r} "
                                                     "critic would cost memory and time for nothing; set value_head.type = 'none' "
                                                     "or leave [value_head] out"))
    if needs_groups and ppo.samples_per_prompt < 2:
        problems.append(Problem("$.ppo.samples_per_prompt", f"advantage estimator {estimator.name!r} compares the responses to "
                                                            f"each prompt, so it needs at least 2, got {ppo.samples_per_prompt}; "
                                                            "4 to 16 are usual"))
    if ppo.dynamic_sampling and not needs_groups:
        problems.append(Problem("$.ppo.dynamic_sampling", f"drops the groups of responses to one prompt that all score alike, but "
                                                          f"advantage estimator {estimator.name!r} does not compare a prompt's "
                                                          "responses; use a group estimator ('grpo', 'rloo') or set it to false"))
    return problems


def kl_penalty_problems(ppo: PPOConfig, loss) -> list[Problem]:
    """`ppo.kl_penalty = "loss"` asks the loss to add β·KL itself; a loss that does not say it does
    (`Loss.takes_kl_penalty`) would train without the penalty. `loss` is the checked component table."""
    if ppo.kl_penalty != "loss" or loss.component.factory.takes_kl_penalty:
        return []
    return [Problem("$.ppo.kl_penalty", f"'loss' adds β·KL to the loss, but loss {loss.component.name!r} does not take the KL "
                                        "penalty; put it in the reward (kl_penalty = \"reward\") or use a loss that takes it "
                                        "('ppo-clip')")]


def packing_problems(ppo: PPOConfig, policy, value_head) -> list[Problem]:
    """`ppo.pack_sequences` needs a policy and a critic that keep attention within each packed
    rollout (`Policy.packs_sequences`, `ValueHead.packs_sequences`); one that does not would let
    rollouts attend to each other. `policy` and `value_head` are the checked component tables
    (`value_head` None: no critic)."""
    if not ppo.pack_sequences:
        return []
    return [Problem("$.ppo.pack_sequences", f"{kind} {table.component.name!r} does not declare packs_sequences (that it keeps "
                                            "attention within each of several rollouts in one row); set pack_sequences = false")
            for kind, table in (("policy", policy), ("value head", value_head))
            if table is not None and not table.component.factory.packs_sequences]


def overlong_problems(ppo: PPOConfig, generator) -> list[Problem]:
    """`ppo.overlong_buffer` needs a length limit to count back from: the generator's
    response limit (`SamplingSettings.max_new_tokens`), at least as long as the buffer. `generator`
    is the checked component table."""
    if not ppo.overlong_buffer:
        return []
    limit = generator.config.max_new_tokens
    if not limit:
        return [Problem("$.ppo.overlong_buffer", f"generator {generator.component.name!r} has no max_new_tokens to count "
                                                 "back from; set overlong_buffer = 0")]
    if ppo.overlong_buffer > limit:
        return [Problem("$.ppo.overlong_buffer", f"{ppo.overlong_buffer} tokens is longer than generator.max_new_tokens = "
                                                 f"{limit}; use at most {limit}")]
    return []


def output_dir_problems(run: RunConfig) -> list[Problem]:
    """An output_dir that cannot hold a run, found before anything is written: a file in its place
    or on its way, or a folder this user may not write in."""
    path = Path(run.output_dir)
    existing = path
    while not existing.exists():  # the nearest part of the path that is there ("." at the latest)
        existing = existing.parent
    fix = "pick another folder: --set run.output_dir=PATH"
    if not existing.is_dir():
        where = "is a file" if existing == path else f"cannot be made: {str(existing)!r} on its path is a file"
        return [Problem("$.run.output_dir", f"{str(path)!r} {where}, not a folder; {fix}")]
    if not os.access(existing, os.W_OK | os.X_OK):
        return [Problem("$.run.output_dir", f"{str(existing)!r} is not writable by this user; {fix}")]
    return []


def kl_problems(ppo: PPOConfig) -> list[Problem]:
    """KL settings that cannot run: the loss sees only the sampled tokens' log-probs, not the full
    distributions that the "full" estimator sums over."""
    if ppo.kl_penalty == "loss" and ppo.kl_estimator == "full":
        return [Problem("$.ppo.kl_estimator", '"full" needs both models\' whole distributions, which the loss does not '
                        'keep; with kl_penalty = "loss" use "k3" (or put the penalty in the reward: kl_penalty = "reward")')]
    return []


def kl_warnings(ppo: PPOConfig) -> list[str]:
    """KL settings that run but probably do not do what the user meant."""
    if ppo.kl_penalty == "loss" and ppo.kl_estimator == "k1":
        return ['$.ppo.kl_estimator: "k1" in the loss has zero expected gradient (its gradient at tokens sampled '
                'from π is ∇log π, whose mean is 0, so it never pulls π towards the reference); use "k3" with kl_penalty = "loss"']
    return []


def schedule_problems(optim: OptimConfig) -> list[Problem]:
    if optim.schedule == "constant" and optim.warmup_steps:
        return [Problem("$.optim.warmup_steps", "the 'constant' schedule has no warm-up; use schedule = 'constant_with_warmup'")]
    return []


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, limit + 1) if n % d == 0)


def _batch_source_problems(source, scheduler: SchedulerConfig, ppo: PPOConfig, advantage) -> list[Problem]:
    """A plugin's batch source gives every batch in place of the core's: nothing of the core's
    sources may be asked for beside it."""
    problems, named = [], f"batch_source {source.component.name!r} gives the batches in place of the core's source"
    if scheduler.runs_ahead:
        problems.append(Problem("$.batch_source", f"{named}, so [scheduler] max_staleness = {scheduler.staleness_bound} would do "
                                                  "nothing; leave it out (the source's class says how old its batches may be)"))
    if ppo.dynamic_sampling or (advantage is not None and advantage.component.factory.needs_baseline_scores):
        problems.append(Problem("$.batch_source", f"{named}; dynamic sampling and ReMax's greedy baseline run in the core's "
                                                  "own source only: leave out [batch_source]"))
    return problems


def _partial_rollout_problems(scheduler: SchedulerConfig, components: dict) -> list[Problem]:
    """Weights loaded between an episode's turns need batches made ahead, turns, the barrier (the
    loop without it keeps each episode's cache across turns) and a generator that samples from the
    policy's own module (an engine of its own would be pushed mid-batch, which is not tested)."""
    environment, generator, where = components.get("environment"), components.get("generator"), "$.scheduler.partial_rollouts"
    if scheduler.staleness_bound == 0:
        return [Problem(where, "weights pushed while a batch is in flight exist only when batches are made ahead; set max_staleness >= 1")]
    if environment is None:
        return [Problem(where, "a single-turn recipe has no turns between which to load weights; leave partial_rollouts out")]
    problems = []
    if not getattr(environment.config, "turn_barrier", True):
        problems.append(Problem(where, "without the turn barrier an episode's cache runs on across its turns; set "
                                       "environment.turn_barrier = true, or leave partial_rollouts out"))
    if generator is not None and generator.component.name != "hf":
        problems.append(Problem(where, f"generator {generator.component.name!r} samples on an engine of its own, which rlkit does not "
                                       "push weights to between turns; use the hf generator, or leave partial_rollouts out"))
    return problems


def scheduler_problems(scheduler: SchedulerConfig | None, ppo: PPOConfig, components: dict, sharded: bool) -> list[Problem]:
    """What a scheduler that makes batches ahead (or a plugin's batch source whose batches may be
    older than the weights that train) needs: a loss that corrects for the older weights that
    sampled, the sampler's own log-probs, whole weights (no FSDP), and the plain rollout stage.
    (None: its table has problems of its own.)"""
    if scheduler is None:
        return []
    problems, loss, generator, advantage = [], components.get("loss"), components.get("generator"), components.get("advantage")
    bound = scheduler.staleness_bound
    # the problems are located where the recipe says it: the earlier type, or max_staleness
    where, named = ("$.scheduler.type", f"type = {scheduler.type!r}") if scheduler.type else \
        ("$.scheduler.max_staleness", f"max_staleness = {bound}")
    if scheduler.type in ("sync", "one-step-off") and scheduler.max_staleness:
        problems.append(Problem("$.scheduler.type", f"{scheduler.type!r} is the earlier name of max_staleness = {bound}, and "
                                                    f"max_staleness = {scheduler.max_staleness} is set too; keep max_staleness only"))
    if scheduler.runs_ahead:
        if ppo.dynamic_sampling or (advantage is not None and advantage.component.factory.needs_baseline_scores):
            problems.append(Problem(where, f"{named} makes one rollout batch per iteration ahead of the update; dynamic sampling "
                                           "and ReMax's greedy baseline run with max_staleness = 0 only"))
        if sharded and scheduler.workers != "processes":
            problems.append(Problem(where, f"{named} samples while the update runs, and FSDP holds the weights in shards a producer "
                                           "thread cannot read then; set scheduler.workers = 'processes' (the whole weights are "
                                           "gathered for them at each push), or max_staleness = 0"))
    if scheduler.workers == "processes":
        if scheduler.staleness_bound == 0:
            problems.append(Problem("$.scheduler.workers", "workers = 'processes' make batches ahead, and max_staleness = 0 makes each "
                                                           "batch after the update before it; set max_staleness >= 1, or leave workers out"))
    if scheduler.partial_rollouts:
        problems += _partial_rollout_problems(scheduler, components)
    if (source := components.get("batch_source")) is not None:
        problems += _batch_source_problems(source, scheduler, ppo, advantage)
        bound = max(bound, source.component.factory.max_staleness)
    if bound == 0:
        return problems
    if loss is not None and not loss.component.factory.corrects_stale_samples(loss.config):
        problems.append(Problem("$.loss", f"a batch may be {bound} policy version(s) old, and loss "
                                          f"{loss.component.name!r} with these settings does not weight tokens by π_old/π_sampler; "
                                          "set loss.tis_cap (e.g. 2.0) for the decoupled objective, with loss.is_level = 'sequence' "
                                          "(per token, the default recipe's KL ran away at staleness 1: docs/async.md)"))
    if generator is not None and (getattr(generator.config, "top_k", 0) or getattr(generator.config, "top_p", 1.0) < 1.0):
        problems.append(Problem("$.generator", "top_k/top_p make the sampled log-probs those of the truncated distribution, so the "
                                               "behaviour weight π_old/π_sampler would be biased; use top_k = 0 and top_p = 1.0 with a "
                                               "scheduler that trains on older weights' batches"))
    return problems
