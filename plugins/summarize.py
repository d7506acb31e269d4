"""The default recipe's parts, as ordinary plugins: a miniature summarisation corpus
(`toy-summaries`), a ROUGE reward against a reference column (`rouge`), and a policy that is a
small byte-level GPT-2 warm-started by supervised fine-tuning, built once and cached
(`warm-start-summarizer`). Everything is made here, offline; nothing is downloaded."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import attrs

from rlkit_core import (
    ComponentChoice,
    Policy,
    PolicySettings,
    Progress,
    PromptLengthLimit,
    PromptSource,
    RecipeError,
    RewardSource,
    at_least,
    between,
    building_at,
    greater_than,
    hookimpl,
    one_of,
    setting,
)
from rlkit_core.hf import DTYPES

from . import summarize_task


def default_cache_dir() -> str:
    return str(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rlkit")


@attrs.frozen
class ToySummariesConfig(PromptLengthLimit):
    size: int = setting(4096, help="documents to generate", validator=greater_than(0))
    seed: int = setting(0, help="seed of the generator (the same seed gives the same documents)")
    split: str = setting("train", help="'train' or 'eval': the two splits share no fact", validator=one_of("train", "eval"))


@attrs.frozen
class RougeConfig:
    reference_field: str = setting("reference", help="data column holding the reference summary")
    rouge_l_weight: float = setting(0.0, help="share of ROUGE-L F1 in the score; the rest is ROUGE-1 F1", validator=between(0.0, 1.0))
    fact_bonus: float = setting(0.0, help="added to the score of a summary that copies every part of the fact (see fact-copied)", validator=at_least(0))


@attrs.frozen
class WarmStartConfig(PolicySettings):
    """The model is built, not named (no `ModelSettings`); `dtype` and `gradient_checkpointing` act on it during RL."""

    cache_dir: str = setting(factory=default_cache_dir, help="where the warm-start model is built once and reused")
    n_layer: int = setting(2, help="transformer layers", validator=greater_than(0))
    n_embd: int = setting(128, help="model width", validator=greater_than(0))
    n_head: int = setting(4, help="attention heads (must divide n_embd)", validator=greater_than(0))
    sft_steps: int = setting(800, help="supervised steps of the warm start; too few, and the model never copies a whole fact for PPO to reinforce",
                             validator=at_least(0))
    sft_batch_size: int = setting(32, help="examples per supervised step", validator=greater_than(0))
    sft_learning_rate: float = setting(3e-3, help="AdamW learning rate of the supervised warm start", validator=greater_than(0))
    seed: int = setting(0, help="seed of the initial weights and the supervised data order")
    sft_filler_share: float = setting(
        0.0, help="share of supervised summaries that carelessly go on with a filler sentence of the document (the reward still wants the clean reference)",
        validator=between(0.0, 1.0))
    dtype: str = setting("float32", help="weights dtype during RL", validator=one_of(*DTYPES))


class ToySummaries(PromptSource):
    def __init__(self, config: ToySummariesConfig, context=None):
        self.config = config

    def load(self):
        return summarize_task.make_corpus(self.config.size, self.config.seed, split=self.config.split)


def references_in(columns: dict, field: str, where: str) -> list[str]:
    """The data column of reference summaries, or a located error naming the columns there are."""
    references = columns.get(field)
    if references is None:
        raise RecipeError([f"{where}: the data has no column {field!r} (columns: {', '.join(columns) or 'none'})"])
    return references


class Rouge(RewardSource):
    """ROUGE-1 F1 (optionally mixed with ROUGE-L F1) of each response against its reference."""

    def __init__(self, config: RougeConfig, context=None):
        self.config = config
        self.where = building_at(context, "reward")

    def score(self, prompts, responses, **columns):
        references = references_in(columns, self.config.reference_field, f"{self.where}.reference_field")
        return [summarize_task.summary_reward(r, ref, rouge_l_weight=self.config.rouge_l_weight)
                + self.config.fact_bonus * summarize_task.fact_copied(r, ref) for r, ref in zip(responses, references)]


@attrs.frozen
class ReferenceMetricConfig:
    reference_field: str = setting("reference", help="data column holding the reference summary")


class ReferenceMetric(RewardSource):
    """A 0/1 check (`measure`) of each summary against its reference, for `[eval] metrics`."""

    name: str
    measure: Callable[[str, str], float]

    def __init__(self, config: ReferenceMetricConfig, context=None):
        self.config = config

    def score(self, prompts, responses, **columns):
        references = references_in(columns, self.config.reference_field, f"$.eval.metrics: {self.name}")
        return [self.measure(r, ref) for r, ref in zip(responses, references)]


class FactCopied(ReferenceMetric):
    """1 when the summary names every part of the reference's fact (who, did what, where), else 0:
    the strict task metric that the default recipe's evaluation reports beside ROUGE."""

    name = "fact-copied"
    measure = staticmethod(summarize_task.fact_copied)


class ExactSummary(ReferenceMetric):
    """1 when the summary is the reference word for word (the fact and nothing else), else 0."""

    name = "exact-summary"
    measure = staticmethod(summarize_task.exact_summary)


class WarmStartPolicy(Policy):
    """Build the warm start on first use (minutes on two CPU cores), then load it with the installed
    `hf` policy (found in the registry, as any plugin finds another's component) and pass every
    call on to it."""

    packs_sequences = True  # as the `hf` policy it passes its calls on to
    corpus = "summaries"  # what the warm start is supervised on (`warm_start.build_warm_start`)

    @staticmethod
    def folder_name(config) -> str:
        """The cache folder of the build these settings make."""
        return (f"summarizer-l{config.n_layer}-d{config.n_embd}-h{config.n_head}-s{config.sft_steps}-f{config.sft_filler_share:g}"
                f"-seed{config.seed}")

    def __init__(self, config: WarmStartConfig, context):
        from .warm_start import build_warm_start

        where = building_at(context, "policy")
        if config.n_embd % config.n_head:
            raise RecipeError([f"{where}.n_head: {config.n_head} does not divide n_embd={config.n_embd}"])
        loader = context.registry.find("policy", "hf") if context.registry is not None else None
        if loader is None:
            raise RecipeError([f"{where}.type: {type(self).__name__} loads its model with the 'hf' policy, which is not installed"])
        folder = Path(config.cache_dir) / self.folder_name(config)
        if not (folder / "warm_start.json").exists():
            print(f"rlkit: building the warm-start policy in {folder} (once; later runs reuse it)", file=sys.stderr, flush=True)
        path = build_warm_start(folder, n_layer=config.n_layer, n_embd=config.n_embd, n_head=config.n_head,
                                sft_steps=config.sft_steps, batch_size=config.sft_batch_size, lr=config.sft_learning_rate,
                                seed=config.seed, filler_share=config.sft_filler_share, corpus=self.corpus,
                                progress=Progress(config.sft_steps, label="warm-start step"))
        hf_config = loader.config_class(model=str(path), dtype=config.dtype, gradient_checkpointing=config.gradient_checkpointing)
        loaded = context.build(ComponentChoice(where.removeprefix("$."), loader, hf_config))
        self._loaded: Policy = loaded
        self.tokenizer, self.eos_token_ids = loaded.tokenizer, loaded.eos_token_ids
        self.suppressed_token_ids, self.context_length = loaded.suppressed_token_ids, loaded.context_length

    @property
    def model(self):
        return self._loaded.model

    def forward(self, input_ids, attention_mask, position_ids, start: int = 0):
        return self._loaded.forward(input_ids, attention_mask, position_ids, start)

    def reference_logits(self, input_ids, attention_mask, position_ids, start: int = 0):
        return self._loaded.reference_logits(input_ids, attention_mask, position_ids, start)

    def parameters(self):
        return self._loaded.parameters()

    def state_dict(self):
        return self._loaded.state_dict()

    def load_state_dict(self, state) -> None:
        self._loaded.load_state_dict(state)

    def save_pretrained(self, path: str, merge_adapters: bool = True) -> None:
        self._loaded.save_pretrained(path, merge_adapters)

    def shard_units(self) -> list[type]:
        return self._loaded.shard_units()


@hookimpl
def register_prompt_sources(register):
    register("toy-summaries", ToySummaries, ToySummariesConfig)


@hookimpl
def register_rewards(register):
    register("rouge", Rouge, RougeConfig)
    for metric in (FactCopied, ExactSummary):
        register(metric.name, metric, ReferenceMetricConfig)


@hookimpl
def register_policies(register):
    register("warm-start-summarizer", WarmStartPolicy, WarmStartConfig)
