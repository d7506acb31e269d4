"""The core tables of a recipe (`[run]`, `[ppo]`, `[optim]`, `[eval]`, `[health]`) and the checks across tables.

Component tables (`[policy]`, `[kl]`, ...) are described by their plugins' own config classes;
`COMPONENT_TABLES` maps each table to its component kind and the type used when the table is absent. What depends
on how the run is launched is checked in `rlkit_core.recipe.launch`.
"""

import os
from pathlib import Path

import attrs

from rlkit_core.config import at_least, between, greater_than, one_of, setting
from rlkit_core.errors import Problem
from rlkit_core.functional import KL_ESTIMATORS
from rlkit_core.interfaces import KIND_TABLE
from rlkit_core.settings import field_of

CHECKS = ("zero_reward_variance", "all_truncated", "logprob_gap_jump", "entropy_collapse", "kl_over_target", "zero_gradients")


def _names(instance, attribute, value):
    unknown = [name for name in value if name not in CHECKS and name != "all"]
    if unknown:
        raise ValueError(f"unknown check(s) {', '.join(map(repr, unknown))}; the checks are 'all', {', '.join(map(repr, CHECKS))}")


@attrs.frozen
class HealthConfig:
    zero_reward_variance: bool = setting(
        True, help="warn when every score of a batch is the same, or (with samples_per_prompt > 1) when most groups' scores are: no signal to learn from")
    zero_variance_groups: float = setting(0.9, help="share of groups with equal scores that counts as 'most' for zero_reward_variance",
                                          validator=between(0.0, 1.0))
    all_truncated: int = setting(
        3, help="warn after this many iterations in a row in which no response ended with EOS (response/eos_rate 0: all cut at max_new_tokens); 0: off",
        validator=at_least(0))
    logprob_gap_jump: float = setting(
        10.0, help="warn when check/logprob_gap exceeds this many times its earlier mean (and logprob_gap_floor): the generator samples other weights; 0: off",
        validator=at_least(0))
    logprob_gap_floor: float = setting(0.05, help="a check/logprob_gap below this (nats per token) never counts as a jump", validator=at_least(0))
    entropy_collapse: float = setting(
        0.05, help="warn when train/entropy falls below this share of the first iteration's: the policy samples almost deterministically; 0: off",
        validator=between(0.0, 1.0))
    kl_over_target: float = setting(
        10.0,
        help="warn when kl/ref exceeds this many times the KL controller's target (controllers with a target only; the default recipe peaks at 5); 0: off",
        validator=at_least(0))
    zero_gradients: bool = setting(
        True, help="warn when an iteration's gradient norm is exactly zero although its steps were finite: the loss does not depend on the weights")
    stop_on: list[str] = setting(factory=list, help="checks that stop the run when they fire (checkpoint, exit 3), by name or 'all'", validator=_names)


@attrs.frozen
class RunConfig:
    steps: int = setting(help="PPO iterations to run (one rollout batch each)", validator=greater_than(0))
    seed: int = setting(0, help="seed for torch, Python and the prompt order")
    output_dir: str = setting("runs/rlkit", help="where metrics.jsonl, checkpoints and the final model go")
    name: str = setting("", help="run name in the tracker; empty means the recipe file's name")
    device: str = setting("auto", help="'auto' (GPU when there is one), 'cpu', 'cuda' or 'cuda:N'")
    checkpoint_every: int = setting(0, help="write a checkpoint every N iterations (0: only at the end)", validator=at_least(0))
    keep_checkpoints: int = setting(2, help="how many of the latest checkpoints to keep", validator=at_least(1))
    sample_every: int = setting(10, help="log a table of sample prompts and responses every N iterations", validator=at_least(1))
    threads: int = setting(0, help="CPU threads for torch (0: torch's default)", validator=at_least(0))
    mixed_precision: str = setting("no", help="accelerate's autocast: 'no', 'bf16' or 'fp16' (fp32 master weights; fp16 scales the loss)",
                                   validator=one_of("no", "bf16", "fp16"))
    on_bad_reward: str = setting(
        "stop", help="a reward that raises or returns bad scores: 'stop' (checkpoint the last good state) or 'skip' (drop the batch, count it)",
        validator=one_of("stop", "skip"))
    max_skips_in_a_row: int = setting(10, help="stop after this many skipped batches, or optimiser steps with a non-finite loss or gradient, in a row",
                                      validator=greater_than(0))


@attrs.frozen
class PPOConfig:
    batch_size: int = setting(64, help="rollouts per iteration, over all processes (prompts × samples_per_prompt)", validator=greater_than(0))
    samples_per_prompt: int = setting(1, help="responses sampled for each prompt (critic-free estimators need ≥ 2)", validator=greater_than(0))
    minibatch_size: int = setting(16, help="rollouts per optimiser step, over all processes; must divide batch_size", validator=greater_than(0))
    gradient_accumulation_steps: int = setting(1, help="micro-batches per optimiser step in each process (same update, less memory)", validator=greater_than(0))
    forward_batch_size: int = setting(0, help="rollouts per no-grad forward pass of the rollout stage (0: minibatch_size)", validator=at_least(0))
    max_tokens_per_microbatch: int = setting(
        0, help="tokens per training micro-batch in each process, rows × (longest prompt + longest response), instead of gradient_accumulation_steps (0: off)",
        validator=at_least(0))
    max_tokens_per_forward: int = setting(0, help="the same budget for the no-grad forward passes of the rollout stage, instead of forward_batch_size (0: off)",
                                          validator=at_least(0))
    pack_sequences: bool = setting(
        False, help="lay rollouts end to end in each row, so no position computes padding (the policy and critic must declare packs_sequences)")
    epochs: int = setting(4, help="passes over the rollout batch per iteration", validator=greater_than(0))
    kl_penalty: str = setting("reward", help="'reward': −β·KL in the per-token rewards; 'loss': β·KL added to the loss", validator=one_of("reward", "loss"))
    kl_estimator: str = setting(attrs.Factory(lambda ppo: "k3" if ppo.kl_penalty == "loss" else "k1", takes_self=True),
                                help="per-token KL estimator: k1, k2, k3 or full (the logged KL uses the same); default k1, k3 with kl_penalty = 'loss'",
                                validator=one_of(*KL_ESTIMATORS))
    score_clip: float = setting(0.0, help="clip scores to ±score_clip (0: no clipping)", validator=at_least(0))
    missing_eos_penalty: float = setting(0.0, help="subtracted from the score of a response that never emitted EOS", validator=at_least(0))
    overlong_buffer: int = setting(
        0, help="DAPO's overlong penalty: over this many tokens before generator.max_new_tokens it rises linearly from 0 to overlong_penalty (0: off)",
        validator=at_least(0))
    overlong_penalty: float = setting(1.0, help="the penalty subtracted from the score of a response at the length limit, with overlong_buffer",
                                      validator=at_least(0))
    dynamic_sampling: bool = setting(
        False, help="DAPO's dynamic sampling: drop the groups whose scores are all equal and generate for more prompts until the batch is full")
    max_extra_rounds: int = setting(
        3,
        help="with dynamic_sampling: at most this many extra generation rounds per iteration; still short after them, the batch is filled with dropped groups",
        validator=greater_than(0))


# transformers' schedules that need nothing besides the warm-up and the run's length (not the ones
# that step on a metric or need extra settings).
SCHEDULES = ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial", "inverse_sqrt")


@attrs.frozen
class OptimConfig:
    learning_rate: float = setting(1e-5, help="AdamW learning rate of the policy", validator=greater_than(0))
    value_learning_rate: float = setting(
        0.0, help="learning rate of the critic (0: same as the policy, which suits the shared head; its zero start needs no larger one)", validator=at_least(0))
    weight_decay: float = setting(0.0, help="AdamW weight decay", validator=at_least(0))
    adam_eps: float = setting(1e-8, help="AdamW epsilon", validator=greater_than(0))
    schedule: str = setting("constant", help="learning-rate schedule over the run's optimiser steps (transformers' get_scheduler): " + ", ".join(SCHEDULES),
                            validator=one_of(*SCHEDULES))
    warmup_steps: int = setting(
        0, help="optimiser steps of linear warm-up from 0 (every schedule but constant; 0: none, since PPO's clipped ratio already bounds the first steps)",
        validator=at_least(0))
    max_grad_norm: float = setting(1.0, help="clip gradients to this global norm (0: no clipping); train/grad_clipped is the share of steps it shortened",
                                   validator=at_least(0))


@attrs.frozen
class EvalConfig:
    size: int = setting(0, help="held-out prompts, set aside from the data and never trained on (0: no evaluation)", validator=at_least(0))
    every: int = setting(0, help="evaluate every N iterations, besides before the first and after the last (0: only those two)", validator=at_least(0))
    greedy: bool = setting(True, help="greedy responses (the policy's best guess); false: sampled at the generator's temperature")
    metrics: list[str] = setting(factory=list, help="more reward components to report on the held-out responses, by registered name (e.g. 'fact-copied')")


CORE_TABLES = {"run": RunConfig, "ppo": PPOConfig, "optim": OptimConfig, "eval": EvalConfig, "health": HealthConfig}

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
    response limit (`SamplingSettings.response_limit`), at least as long as the buffer. `generator`
    is the checked component table."""
    if not ppo.overlong_buffer:
        return []
    limit, name = generator.config.response_limit, field_of(generator.config, "max_new_tokens")
    if not limit:
        return [Problem("$.ppo.overlong_buffer", f"generator {generator.component.name!r} has no {name} to count "
                                                 "back from; set overlong_buffer = 0")]
    if ppo.overlong_buffer > limit:
        return [Problem("$.ppo.overlong_buffer", f"{ppo.overlong_buffer} tokens is longer than generator.{name} = "
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
