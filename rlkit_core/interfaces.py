"""The parts of the PPO loop. A plugin implements one of these and registers its class for it.

Every interface derives from `ComponentBase`, which declares the optional hooks rlkit reads from a
component's class (never from an instance, so before and after the build alike), each with its
default; the registry checks a registered class against them, and against the flags (`ClassVar[bool]`)
its interface declares. `KIND_TABLE` at the end is the one
list of component kinds: their recipe tables, hooks, defaults and interfaces; `FUNCTION_KINDS`
after it lists what plugins register as functions, chosen in a nested table of a component, and
`NESTED_KINDS` the classes chosen so that the core builds itself (tool-call formats).

Shapes follow `rlkit_core.batch`: B rollouts, L = P + R sequence positions, V vocabulary entries.
"""

from __future__ import annotations

import contextlib
import inspect
import typing
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import attrs
import torch

from rlkit_core.batch import RolloutBatch
from rlkit_core.chat_format import ChatFormat
from rlkit_core.episode_limits import StandardEpisode
from rlkit_core.functional import left_padded
from rlkit_core.messages import Reply, Reset, Step
from rlkit_core.settings import PolicySettings, SamplingSettings
from rlkit_core.surrogates import Surrogate
from rlkit_core.tool_call_formats import ToolCallFormat


@attrs.frozen
class PolicyOutput:
    logits: torch.Tensor  # [B, L - start, V] next-token logits at positions start..L-1 (see `Policy.forward`)
    hidden: torch.Tensor | None  # [B, L, H] last hidden state, for a value head on the shared trunk


@attrs.frozen
class Completion:
    """One request's answer: the ids sampled after its prompt (its end id last, unless it reached
    `max_new_tokens`) and the sampler's log-probability of each."""

    ids: list[int]
    logprobs: list[float]


@attrs.frozen
class Generation:
    response_ids: torch.Tensor  # [B, R] sampled tokens, padded after the first EOS
    response_mask: torch.Tensor  # [B, R] 1 up to and including the first EOS
    logprobs: torch.Tensor  # [B, R] the sampler's log-probability of each sampled token

    def completions(self) -> list[Completion]:
        """Each row's sampled ids and log-probs, without the padding after its end."""
        lengths = self.response_mask.sum(dim=1).tolist()
        return [Completion(ids[:n].tolist(), logprobs[:n].tolist()) for ids, logprobs, n in zip(self.response_ids, self.logprobs, lengths)]


class Requests(typing.Protocol):
    """Prompts that arrive while a generator serves them (`Generator.serve`), each under a key of the
    caller's, and where each answer goes. The prompts are token ids, left as they are."""

    pad_id: int  # what fills a batch's rows to one length (the attention mask leaves it out)
    device: torch.device  # where the prompts' tensors go

    def arrived(self, wait: bool) -> list[tuple[Any, list[int]]]:
        """(key, prompt ids) of the requests that arrived since the last call. `wait`: the generator
        has nothing left to decode, so block until one arrives; then [] means none ever will."""
        ...

    def completed(self, key: Any, completion: Completion) -> None:
        """The answer to the request under `key`, given as soon as its row ends."""
        ...


class ComponentBase(ABC):  # noqa: B024 (no abstract method of its own: each kind's interface declares them)
    """What rlkit reads from any component's class besides its kind's methods. A component class is
    its own factory: rlkit builds it as `cls(config, context)` (`rlkit_core.context.BuildContext`).
    Each hook below is optional; override it as a `@staticmethod` or a `@classmethod` with the same
    parameters."""

    # what the component imports beyond rlkit's own dependencies: {module: what to pip install for it};
    # `rlkit plugins` says "needs: pip install ..." beside a component while one of them is not installed
    requires: ClassVar[dict[str, str]] = {}

    @staticmethod
    def check(config, recipe, where: str) -> tuple[list[str], list[str]]:
        """(problems, notes) for `rlkit check` and before `rlkit run` builds anything: located
        problems (under `where`, the table's place, e.g. `$.reward.parts[1]`) and lines for the
        plan's "not checked". Cheap: it creates nothing and runs no code the recipe names."""
        return [], []

    @staticmethod
    def imports(config, where: str) -> list[str]:
        """The files or modules the recipe names that this component will import (the plan lists them)."""
        return []

    @staticmethod
    def probe(config, where: str) -> list[str]:
        """Located problems from one cheap request to a service the component calls; only
        `rlkit check` (without --offline) calls it. A class that calls no service leaves it alone."""
        return []

    @staticmethod
    def describe(config) -> list[str]:
        """Lines for the plan (the policy's size, say)."""
        return []


# the hooks of `ComponentBase` with the parameters rlkit passes them, for the registry's check
COMPONENT_HOOKS = {"check": ("config", "recipe", "where"), "imports": ("config", "where"), "probe": ("config", "where"),
              "describe": ("config",)}


def declares(factory: type, hook: str) -> bool:
    """Whether a component class overrides `ComponentBase`'s default for `hook` (a probe is only noted when there is one)."""
    return inspect.getattr_static(factory, hook) is not inspect.getattr_static(ComponentBase, hook)


def class_flags(interface: type) -> tuple[str, ...]:
    """The flags rlkit reads from a component class of `interface`: its `ClassVar[bool]` attributes,
    and the `bool` ones an instance may narrow for its config (a loss's declared needs)."""
    return tuple(name for name, hint in typing.get_type_hints(interface).items() if hint in (ClassVar[bool], bool))


def __getattr__(name: str):
    if name == "Part":  # the earlier name of ComponentBase, kept for plugins that import it
        warnings.warn("rlkit_core.interfaces.Part is now ComponentBase", DeprecationWarning, stacklevel=2)
        return ComponentBase
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class Policy(ComponentBase):
    """The trainable causal LM and its frozen reference."""

    tokenizer: Any  # a transformers tokenizer with distinct pad and EOS tokens
    eos_token_ids: tuple[int, ...]  # every id that ends a response; the tokenizer's EOS first
    suppressed_token_ids: tuple[int, ...] = ()  # ids never emitted (a PAD rlkit added): masked out of every softmax
    # the run's iterations done when the module's weights were current: set by the trainer (and a copy's by the
    # scheduler's producer, when it loads pushed weights); every turn an episode samples is labelled with it
    weights_version: int = 0
    # the longest prompt + response the model takes, or None when it has no such limit or cannot
    # tell: prompts are cut to fit it with the longest response (`data.max_prompt_tokens` checked against it)
    context_length: int | None = None
    # flag rlkit reads from the class: True when `forward` and `reference_logits` take packed rows
    # (`ppo.pack_sequences`): attention_mask None, position_ids that restart at 0 where each of
    # several sequences in a row starts, attention kept within each; `start` is then 0
    packs_sequences: ClassVar[bool] = False

    @property
    @abstractmethod
    def model(self) -> torch.nn.Module:
        """The module that is trained (and that an in-process generator samples from)."""

    @abstractmethod
    def forward(self, input_ids, attention_mask, position_ids, start: int = 0) -> PolicyOutput:
        """Logits (with gradient) of the current policy at positions `start` and after.

        The loop needs the distributions at the response positions only: a policy that projects
        only those hidden states onto the vocabulary saves most of the LM head's work and memory
        on a large vocabulary. `hidden` stays at every position."""

    @abstractmethod
    def reference_logits(self, input_ids, attention_mask, position_ids, start: int = 0) -> torch.Tensor:
        """[B, L - start, V] logits of the frozen reference at positions `start` and after, without gradient."""

    @abstractmethod
    def parameters(self) -> Iterable[torch.nn.Parameter]:
        """The trainable parameters (LoRA adapters only, when LoRA is on)."""

    @abstractmethod
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The trainable state, for checkpoints."""

    @abstractmethod
    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None: ...

    @abstractmethod
    def save_pretrained(self, path: str, merge_adapters: bool = True) -> None:
        """Write a plain transformers model directory (tokenizer included)."""

    def shard_units(self) -> list[type]:
        """The module classes of `model` that FSDP shards each as one unit (a transformer block);
        empty: FSDP wraps the model whole."""
        return []

    @staticmethod
    def shape(config):
        """The model's `rlkit_core.memory.ModelShape` from the config alone (no weights loaded), for
        the plan's memory estimate; None when it cannot be told."""
        return None


class ValueHead(ComponentBase):
    """The critic: a value for every position."""

    # flag rlkit reads from the class: True when `values` takes packed rows as `Policy.packs_sequences` says
    packs_sequences: ClassVar[bool] = False

    @abstractmethod
    def values(self, policy_output: PolicyOutput, input_ids, attention_mask, position_ids) -> torch.Tensor:
        """[B, L] values; a head on the shared trunk reads `policy_output.hidden`."""

    @abstractmethod
    def parameters(self) -> Iterable[torch.nn.Parameter]: ...

    @abstractmethod
    def state_dict(self) -> dict[str, torch.Tensor]: ...

    @abstractmethod
    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None: ...

    def module(self) -> torch.nn.Module | None:
        """The module that holds `parameters()` and computes `values` with them, or None.

        FSDP replaces a module's parameters with shards of its own, so under FSDP the head must be
        one module that trains inside the policy's engine; a head that returns None runs with one
        process and under DDP only (rlkit refuses it under FSDP)."""
        return None


class RewardSource(ComponentBase):
    """Scores (prompt, response) pairs: a learned model or a rule."""

    @abstractmethod
    def score(self, prompts: list[str], responses: list[str], **columns: list[Any]) -> list[float]:
        """One float per response. `columns` holds every other column of the prompt data."""


class KLController(ComponentBase):
    """The KL coefficient β and how it moves between iterations."""

    # The KL per sequence it steers towards, or None when it steers towards none. The `kl_over_target`
    # health check compares the run's KL with it, so a controller whose config has a `target`
    # setting sets it (the contract kit checks `instance.target == config.target`).
    target: float | None = None

    @property
    @abstractmethod
    def beta(self) -> float: ...

    @abstractmethod
    def update(self, kl: float, n_samples: int) -> None:
        """Move β after an iteration whose mean per-sequence KL was `kl` over `n_samples` rollouts."""

    def state_dict(self) -> dict[str, float]:
        return {"beta": self.beta}

    @abstractmethod
    def load_state_dict(self, state: Mapping[str, float]) -> None: ...


class AdvantageEstimator(ComponentBase):
    """Advantages and value targets from a scored batch."""

    # flags rlkit reads from the class, when it checks the recipe and when it runs alike
    needs_values: ClassVar[bool] = True  # critic-free estimators set False: value_head.type = "none", no critic is built
    needs_groups: ClassVar[bool] = False  # True: compares the samples of each prompt (batch.group_ids), so ppo.samples_per_prompt ≥ 2
    needs_baseline_scores: ClassVar[bool] = False  # True: reads batch.baseline_scores, the loop's score of a greedy response per prompt

    @abstractmethod
    def estimate(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(advantages [B, R], returns [B, R]); zero on positions outside `batch.loss_mask`."""


@attrs.frozen
class LossInputs:
    """What the current parameters say about a minibatch."""

    logprobs: torch.Tensor  # [b, R] log π_θ of the sampled tokens
    values: torch.Tensor | None  # [b, R] V_θ, None without a critic
    entropy: torch.Tensor  # [b, R] entropy of π_θ at each position; detached unless `Loss.needs_entropy_grad`
    # β of the KL penalty when the recipe puts it in the loss (`ppo.kl_penalty = "loss"`), else 0,
    # and the per-token estimator to take of log π_θ against `minibatch.ref_logprobs`
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    # [b, R, V] the policy's logits at the response positions, with their graph, before the
    # sampler's temperature; only for a loss that declares `needs_logits` (else None)
    logits: torch.Tensor | None = None


@attrs.frozen
class LossTerms:
    """What a loss returns for a minibatch: its terms by how the loop combines them over the
    micro-batches and processes of an optimiser step. Each is a scalar tensor.

    - `losses`: what is optimised. Each is a sum over the minibatch's counted tokens divided by the
      step's global count (the `token_count` the loss is given; a loss that averages per response
      divides by the step's rollouts over all processes, `recipe.ppo.minibatch_size`), so they add
      up over any split of the step. The loop sums them over micro-batches and processes,
      differentiates their total and logs each as `train/loss_<name>`, the total as `train/loss`.
    - `diagnostics`: detached means over the minibatch's own counted tokens; the loop weights each
      by the minibatch's share of the step's tokens, so the step's figure is the mean over all of
      them. Logged as `train/<name>`.
    - `maxima`: combined by their maximum, logged as `train/<name>`.
    - `skip`: 0 or 1; 1 in any micro-batch or process skips the step's optimiser step (the
      backward passes still run, in every process). Logged as `train/skipped`.
    - `log_ratio`: [b, R], not a scalar: log π_θ - log π_old as the policy term weighs it, when not
      each token's own (GSPO's one per response, on each of its tokens); None: the tokens' own.

    The loop logs every loss's `train/entropy` and `train/approx_kl` itself (the detached entropy
    of `LossInputs` and k3 of π_θ against π_old over the `log_ratio`, token means over the counted
    tokens). Logged names must differ from each other and from those the loop logs itself (`LOOP_METRICS`)."""

    LOOP_METRICS: ClassVar[tuple[str, ...]] = ("loss", "grad_norm", "grad_norm_max", "grad_clipped", "nonfinite", "lr", "entropy",
                                               "approx_kl", "approx_kl_last_epoch")

    losses: dict[str, torch.Tensor]
    diagnostics: dict[str, torch.Tensor] = attrs.field(factory=dict)
    maxima: dict[str, torch.Tensor] = attrs.field(factory=dict)
    skip: torch.Tensor = attrs.field(factory=lambda: torch.zeros(()))
    log_ratio: torch.Tensor | None = None

    def total(self) -> torch.Tensor:
        """The sum of the `losses`, which the loop differentiates."""
        return sum(self.losses.values())  # pyright: ignore[reportReturnType]  # a loss has at least one term

    def logged_names(self) -> list[tuple[str, str, str]]:
        """(field, term, name under `train/`) for every term, `skip` included."""
        return ([("losses", name, f"loss_{name}") for name in self.losses]
                + [(field, name, name) for field in ("diagnostics", "maxima") for name in getattr(self, field)]
                + [("skip", "skip", "skipped")])

    def naming_problems(self) -> list[str]:
        """Why the loop could not log these terms under their names (empty when it can)."""
        problems, seen = [], {}
        for field, term, name in self.logged_names():
            if name in self.LOOP_METRICS:
                problems.append(f"{field}[{term!r}] would be logged as train/{name}, which the loop logs itself")
            elif name in seen:
                problems.append(f"{field}[{term!r}] and {seen[name]} would both be logged as train/{name}")
            seen.setdefault(name, f"{field}[{term!r}]")
        return problems


class Loss(ComponentBase):
    """The objective over a minibatch: returns `LossTerms`, whose type says how the loop combines,
    optimises and logs each term."""

    # What the loss reads from the forward pass besides log-probs, values and detached entropy; the
    # loop computes and keeps only what is declared. Declared on the class, where rlkit checks them;
    # an instance may turn one off for its config in __init__ (never on).
    needs_entropy_grad: bool = False  # `current.entropy` with its graph, for a term that optimises it
    needs_logits: bool = False  # `current.logits`, the [b, R, V] response logits with their graph
    # flag rlkit reads from the class: True when `__call__` adds a `kl` loss, `current.kl_coef` times the
    # per-token KL aggregated as its other terms, so that `ppo.kl_penalty = "loss"` may choose it
    takes_kl_penalty: ClassVar[bool] = False

    @staticmethod
    def corrects_stale_samples(config) -> bool:
        """Whether the loss with `config` weights each token by π_old/π_sampler (truncated or masked):
        the behaviour correction of the decoupled objective, which a scheduler that trains on
        batches sampled by older weights requires (`[scheduler]`; π_old is recomputed with the
        weights that train, the proximal policy)."""
        return False

    @abstractmethod
    def __call__(self, minibatch: RolloutBatch, current: LossInputs, token_count: float | torch.Tensor) -> LossTerms:
        """`token_count`: the counted tokens of the whole optimiser step, over every micro-batch and
        process, which the `losses` divide by (see `LossTerms`); the loop gives it as a 0-dim tensor
        on the device (reading it would wait for the device)."""


class Generator(ComponentBase):
    """Samples responses and the sampler's log-probs for a batch of prompts."""

    temperature: float  # the loop divides logits by it when it recomputes log-probs
    # flag rlkit reads from the class: True when the generator samples with the policy module itself
    # (inside the training engine), so that it runs under FSDP, where weights are sharded
    runs_under_fsdp: ClassVar[bool] = False
    # flag rlkit reads from the class: True when the sampler runs in dtypes of its own (an engine
    # outside the training process's modules), so that the loop calls it outside the run's autocast
    runs_own_precision: ClassVar[bool] = False

    @abstractmethod
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, greedy: bool = False) -> Generation:
        """`greedy`: the likeliest token at every step (for evaluation; its log-probs are not used).

        The loop calls it, after `sync_weights`, inside the policy's full-weights block (under FSDP
        every process holds the whole model meanwhile) and under the run's autocast
        (`run.mixed_precision`), unless the class sets `runs_own_precision`."""

    @contextlib.contextmanager
    def continuing_streams(self):
        """A block in which calls may continue the streams an earlier call of the block sampled (the
        turns of a rollout's episodes, on unchanged weights): the generator may keep what it
        computed for a stream (its KV cache) and compute only the tokens added since. Whether a
        prompt continues a stream is decided by its ids alone. Nothing kept by default."""
        yield

    def serve(self, requests: Requests, greedy: bool = False) -> None:
        """Answer requests as they arrive, until none is running and none will come (the turns of a
        rollout's episodes when they do not wait on each other). Called where `generate` is called
        (after `sync_weights`, in the full-weights block, under the run's autocast), once for the
        whole rollout. By default the requests that arrived together are one `generate` call; a
        generator that joins newcomers into its running decode (continuous batching) overrides it."""
        while arrived := requests.arrived(wait=True):
            generation = self.generate(*left_padded([ids for _, ids in arrived], requests.pad_id, requests.device), greedy=greedy)
            for (key, _), completion in zip(arrived, generation.completions()):
                requests.completed(key, completion)

    def sync_weights(self, policy: Policy) -> None:
        """Bring the sampler's weights up to date with the policy; in-process samplers share them.
        Called just before `generate`, in the same full-weights block (outside the autocast)."""

    def score(self, ids: list[int]) -> list[float] | None:
        """The log-prob of each of `ids[1:]` after the ids before it, at temperature 1, from the
        weights it samples with. A generator that keeps weights of its own implements it: after
        each `sync_weights` the loop scores a fixed probe and compares with the policy's
        (`rlkit_core.runtime.push_check`), so that a push that did not land stops the run. The
        default (None) is for generators that sample with the policy's own module."""
        return None

    def pop_metrics(self) -> dict[str, float]:
        """Figures since the last call (e.g. `time/weight_sync`), merged into the iteration's metrics;
        the call resets them."""
        return {}


class PromptSource(ComponentBase):
    """Prompt records: each a dict with a `prompt` string and any other columns (passed to the reward)."""

    @abstractmethod
    def load(self) -> list[dict[str, Any]]: ...


class Tracker(ComponentBase):
    """Where metrics go besides `metrics.jsonl`."""

    location: str | None = None  # where a person finds the run (shown in the end-of-run report)

    @abstractmethod
    def start(self, *, run_name: str, params: dict[str, Any], tags: dict[str, str], resume_id: str | None) -> str | None:
        """Open (or reopen, with `resume_id`) a run; return its id for checkpoints."""

    @abstractmethod
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def log_samples(self, rows: list[dict[str, Any]], step: int) -> None:
        """A table of sample prompts and responses."""

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        """A file or folder to keep with the run."""

    def log_model(self, path: str) -> None:
        """The final model directory (a plain transformers model); kept like any artifact unless the tracker knows better."""
        self.log_artifact(path, "final_model")

    def log_checkpoint(self, path: str, step: int) -> None:
        """Where the latest checkpoint is, so a run found in the tracker can be resumed."""

    def log_note(self, name: str, text: str, step: int) -> None:
        """A line of text worth finding with the run: a health check that fired, the settings a
        resumed run changed. Dropped unless the tracker keeps text."""

    @abstractmethod
    def finish(self, status: str) -> None:
        """Close the run; `status` is "FINISHED", "FAILED" or "KILLED"."""


class NullTracker(Tracker):
    """Records nothing, so the run's metrics.jsonl is its whole record: the `none` tracker, what the
    processes other than the main one log to, and the contract kit's stand-in."""

    def __init__(self, config: Any = None, context: Any = None):
        pass

    def start(self, *, run_name, params, tags, resume_id):
        return None

    def log_metrics(self, metrics, step):
        pass

    def finish(self, status):
        pass


class Environment(ComponentBase):
    """What the model talks to over the turns of an episode (a game, a tool, a user simulator).

    It speaks messages (`rlkit_core.messages`), never token ids: the core renders them, keeps what
    the model sampled as sampled, and enforces the episode's bounds (`StandardEpisode`: turns,
    tokens, timeouts), so no environment can break the token accounting. One instance serves many
    episodes at once; each episode's own state is what `reset` returns."""

    def tools(self) -> list[dict[str, Any]]:
        """The tools the model may call, as JSON schemas (`{"type": "function", "function": {...}}`),
        which the chat template shows the model; none by default (`rlkit_core.tools.ToolEnvironment`
        derives them from typed methods)."""
        return []

    @abstractmethod
    def reset(self, record: dict[str, Any], seed: int) -> Reset:
        """Start an episode for a prompt record (its `prompt` and other columns); `seed` is the
        episode's own, so a replayed episode starts alike."""

    @abstractmethod
    def step(self, state: Any, reply: Reply) -> Step:
        """The environment's answer to the model's turn `reply` in the episode whose state is `state`."""

    def close(self, state: Any) -> dict[str, float] | None:
        """Release what the episode whose state is `state` holds (a process, a connection, a sandbox).
        Called once for every episode whose `reset` returned, after its last step, however it ended
        (done, cut off by the turns or the tokens, a step that failed or timed out: a step still
        running past its timeout may still be running); in the environment's call pool, within
        `step_timeout_s`. Nothing by default. It may return figures known only at the end (what an
        agent returned after its episode was cut off): they replace the info of those names, as a
        step's do, and are checked as a step's are."""
        return None


class BatchSource(ComponentBase):
    """Where the trainer takes each iteration's batch from, in place of the core's (sampled when
    taken, or made ahead within `[scheduler] max_staleness`): a replay buffer, a cluster's own
    scheduler, a recorder. Built with the run's other components; it samples through the view it
    is given (`rlkit_core.runtime.batch_sources.SamplingView`: the run's components, rollout engine,
    recipe and prompt stream), never the trainer. What it holds is not checkpointed: a resumed run
    builds it afresh and takes from the iteration it resumes at."""

    # policy versions a batch it gives may be behind the weights that train on it; above 0 the
    # recipe's loss must weight tokens by π_old/π_sampler, as for `[scheduler] max_staleness`
    max_staleness: ClassVar[int] = 0

    @abstractmethod
    def take(self, iteration: int, view: Any) -> tuple[RolloutBatch, dict[str, float]]:
        """The batch of iteration `iteration` (0-based) and its stage-1 metrics. `view.rollout(j)`
        samples the prompt stream's batch of iteration j now, as the core does, and
        `view.records(j)` gives its records: a source that keeps the stream's order trains every
        prompt once, in order, across a resume."""

    def close(self) -> None:
        """The run ends (or stops): stop whatever makes batches. Nothing by default."""


@attrs.frozen
class Kind:
    """One kind of component, in the three names a user meets it by."""

    name: str  # as `rlkit plugins` and the registry's errors say it: "kl_controller"
    table: str  # its recipe table, and its field in `rlkit_core.recipe.assemble.Components`: "kl" (a function kind: its nested table)
    interface: type  # what its components implement: KLController
    hook: str  # the hook a plugin implements to register them (`rlkit_core.hookspecs`)
    default: str | None  # the type a recipe without the table gets; None: the table is required
    settings: type | None = None  # the base its config classes inherit: the settings rlkit reads from them, as fields (`rlkit_core.settings`)
    optional: bool = False  # True: `type = "none"` (NO_COMPONENT) builds no component of this kind
    without: str = ""  # what the run does with `type = "none"`, where it is more than nothing (`rlkit plugins` says it)


# the type of an optional kind's table that builds nothing (no plugin registers it)
NO_COMPONENT = "none"


# in the order of a recipe's tables (and of `rlkit check`'s plan)
KIND_TABLE = (
    Kind("policy", "policy", Policy, "register_policies", None, PolicySettings),
    Kind("value_head", "value_head", ValueHead, "register_value_heads", "shared", optional=True),  # "none" when the estimator needs no values
    Kind("generator", "generator", Generator, "register_generators", "hf", SamplingSettings),
    # "none" only beside an environment, whose own rewards then train
    Kind("reward", "reward", RewardSource, "register_rewards", None, optional=True),
    Kind("kl_controller", "kl", KLController, "register_kl_controllers", "adaptive"),
    Kind("advantage_estimator", "advantage", AdvantageEstimator, "register_advantage_estimators", "gae"),
    Kind("loss", "loss", Loss, "register_losses", "ppo-clip"),
    Kind("environment", "environment", Environment, "register_environments", "none", StandardEpisode, optional=True),
    Kind("prompt_source", "data", PromptSource, "register_prompt_sources", None),
    Kind("tracker", "tracker", Tracker, "register_trackers", "mlflow"),
    # "none": the core's own source, by `[scheduler] max_staleness`
    Kind("batch_source", "batch_source", BatchSource, "register_batch_sources", "none", optional=True,
         without="the core's own source, by [scheduler] max_staleness"),
)
KINDS = {kind.name: kind.interface for kind in KIND_TABLE}
KIND_OF_TABLE = {kind.table: kind for kind in KIND_TABLE}
# kinds that plugins register as functions over the signature of `interface` (with a config class,
# as components), each chosen in a nested table of a component of another kind (`table` is that
# place; the component holding it says the default), never in a recipe table of its own; rlkit
# builds nothing from them, the component calls them
FUNCTION_KINDS = (
    Kind("surrogate", "loss.surrogate", Surrogate, "register_surrogates", None),
)
# kinds that plugins register as classes of `interface` (with a config class), each chosen in a
# nested table of a component of another kind (`table`), which the core builds itself as
# `cls(config)` where it needs one, never through `BuildContext.build`; `default` is the type the
# holding setting takes when a recipe leaves it out, one that the core answers for
NESTED_KINDS = (
    Kind("tool_call_format", "environment.tool_call_format", ToolCallFormat, "register_tool_call_formats", "auto"),
    Kind("chat_format", "environment.chat_format", ChatFormat, "register_chat_formats", "auto"),
)
