"""The records a recipe is read into, which plugins read through `BuildContext.recipe`: the core
tables (`[run]`, `[ppo]`, `[optim]`, `[eval]`, `[health]`), each checked component table
(`ComponentChoice`, naming its registered `Component`) and the whole `Recipe`.

Reading TOML into these, and the checks across tables, are the recipe layer's (`rlkit_core.recipe`).
"""

import warnings
from typing import Any, Protocol

import attrs

from rlkit_core.config import at_least, between, greater_than, one_of, setting
from rlkit_core.errors import RecipeDeprecation
from rlkit_core.functional import KL_ESTIMATORS

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
    weight_push_tolerance: float = setting(
        0.05, help="after each push of new weights to a generator with weights of its own (vllm), stop the run when its log-probs of a fixed "
                   "probe differ from the policy's by more than this (nats per token, on average), or by more than half of what the "
                   "policy moved since the previous push (the push did not land); 0: off", validator=at_least(0))
    entropy_collapse: float = setting(
        0.05, help="warn when train/entropy falls below this share of the first iteration's: the policy samples almost deterministically; 0: off",
        validator=between(0.0, 1.0))
    kl_over_target: float = setting(
        2.0,
        help="warn when kl/ref, averaged over the last 5 iterations, exceeds this many times the KL controller's target (controllers with a "
             "target only): a controlled run stays within 1.5 times it; 0: off",
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
    sample_every: int = setting(
        10, help="log a table of sample prompts and responses every N iterations (rows of the trained batch: "
                 "no episode is played for it)", validator=at_least(1))
    report_samples: int = setting(
        5, help="the end-of-run report's samples: greedy episodes played before and after training on every "
                "held-out prompt, else on the first N training prompts, of which it shows N; 0: none, and no "
                "episode is played for the report", validator=at_least(0))
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
    target_kl: float = setting(
        0.0, help="end the update early, before the optimiser step whose minibatch finds π_θ more than 1.5 × target_kl (approx KL "
                  "per token) from the rollout's policy: an update that runs away stops there (0: every step is taken)",
        validator=at_least(0))
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


SCHEDULERS = ("sync", "one-step-off", "bounded")  # the earlier names of a staleness bound: max_staleness says it alone


def _earlier_scheduler_name(instance, attribute, value):
    """`scheduler.type` still works, with a warning that names the setting to use instead."""
    one_of("", *SCHEDULERS)(instance, attribute, value)
    if value:
        meaning = {"sync": "max_staleness = 0", "one-step-off": "max_staleness = 1"}.get(value, "max_staleness alone")
        warnings.warn(f"scheduler.type = {value!r} is deprecated: write {meaning} in [scheduler] instead", RecipeDeprecation, stacklevel=2)


@attrs.frozen
class SchedulerConfig:
    max_staleness: int = setting(
        0, help="the most policy versions a trained batch may be behind the weights it trains: 0 samples each batch after the update "
                "before it (sync); k > 0 samples up to k batches ahead, while the updates run, from copies of the weights (checked "
                "when a batch is consumed; a staler one is made again)", validator=at_least(0))
    type: str = setting("", help="deprecated: the bound by name ('sync' is max_staleness = 0, 'one-step-off' is 1, 'bounded' reads "
                                 "max_staleness); leave it out and set max_staleness", validator=_earlier_scheduler_name)
    wait_timeout_s: float = setting(600.0, help="seconds the update may wait for a batch before the run ends with a checkpoint (a "
                                               "generator or reward that stalls)", validator=greater_than(0))
    workers: str = setting("threads", help="where the workers that make batches ahead run: 'threads' of the trainer's process, each "
                                           "sampling from a copy of the weights, or 'processes' of their own, each building the recipe's "
                                           "components and receiving the weights through shared memory at each push (the only way under FSDP)",
                           validator=one_of("threads", "processes"))
    partial_rollouts: bool = setting(False, help="with max_staleness >= 1 and an environment that keeps the turn barrier: a worker "
                                                 "loads the weights pushed while its episodes are in flight, between their turns, so "
                                                 "later turns sample from newer weights; every sampled token keeps the version that "
                                                 "sampled it (the batch's `sampled_versions`), and the bound holds for the oldest")

    @property
    def staleness_bound(self) -> int:
        """The most versions a trained batch may lag."""
        return {"sync": 0, "one-step-off": 1}.get(self.type, self.max_staleness)

    @property
    def runs_ahead(self) -> bool:
        """Batches come from the producer (`rlkit_core.runtime.scheduling`): a bound above 0, or the
        earlier `bounded` at 0, which samples through the producer from the trainer's own module."""
        return self.staleness_bound > 0 or self.type == "bounded"


@attrs.frozen
class Component:
    """A registered component: its kind, its name, its class (its own factory) and config class,
    and the plugin, distribution and version that supplied it."""

    kind: str
    name: str
    factory: type  # the component's class, a subclass of its kind's interface
    config_class: type
    plugin: str  # entry-point name of the plugin that registered it
    distribution: str
    version: str


class ComponentLookup(Protocol):
    """What a factory may ask of the installed components (`BuildContext.registry`)."""

    def find(self, kind: str, name: str) -> Component | None:
        """The component of `kind` registered as `name`, or None."""
        ...

    def names(self, kind: str) -> list[str]:
        """The names registered for `kind`, sorted."""
        ...


@attrs.frozen
class ComponentChoice:
    """A checked component table (the recipe layer makes them; nested ones reach a factory): the
    registered component its `type` names and its structured config."""

    table: str  # where the table sits in the recipe: `reward`, or `reward.parts[1]` when nested
    component: Component
    config: Any
    extra: Any = None  # for a nested table: its keys for the parent (see `rlkit_core.config.Nested.extra`)


@attrs.frozen
class Recipe:
    """A whole checked recipe: the core tables, one `ComponentChoice` per component table (`recipe["reward"]`)."""

    run: RunConfig
    ppo: PPOConfig
    optim: OptimConfig
    components: dict[str, ComponentChoice]
    document: dict[str, Any]  # the TOML document after overrides, as logged with the run
    source: str | None = None
    eval: EvalConfig = EvalConfig()
    eval_metrics: tuple[Component, ...] = ()  # the reward components named by eval.metrics
    registry: ComponentLookup | None = attrs.field(default=None, eq=False, repr=False)  # where the components were found
    health: HealthConfig = HealthConfig()
    scheduler: SchedulerConfig = SchedulerConfig()

    def __getitem__(self, table: str) -> ComponentChoice:
        return self.components[table]
