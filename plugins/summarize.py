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
from rlkit_plugins import summarize_task
from rlkit_plugins.hf_policy import DTYPES, HFPolicy, HFPolicyConfig

from rlkit_core import hookimpl
from rlkit_core.config import at_least, between, greater_than, one_of, setting
from rlkit_core.context import building_at
from rlkit_core.errors import RecipeError
from rlkit_core.interfaces import ComponentBase, Policy, PromptSource, RewardSource
from rlkit_core.progress import Progress
from rlkit_core.prompts import PromptLengthLimit
from rlkit_core.settings import PolicySettings


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
    renamed = {"model": None, "tokenizer": None, "trust_remote_code": None, "gradient_checkpointing": None}  # the model is built, not named

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


class WarmStartPolicy(HFPolicy):
    """Build the warm start on first use (minutes on two CPU cores), then load it like any `hf` model."""

    # the hf policy's plan hooks read a model directory, which the warm start has only once it is built
    check, shape, describe = ComponentBase.__dict__["check"], Policy.__dict__["shape"], ComponentBase.__dict__["describe"]

    def __init__(self, config: WarmStartConfig, context):
        from rlkit_plugins.warm_start import build_warm_start

        if config.n_embd % config.n_head:
            raise RecipeError([f"{building_at(context, 'policy')}.n_head: {config.n_head} does not divide n_embd={config.n_embd}"])
        folder = Path(config.cache_dir) / (
            f"summarizer-l{config.n_layer}-d{config.n_embd}-h{config.n_head}-s{config.sft_steps}-f{config.sft_filler_share:g}-seed{config.seed}")
        if not (folder / "warm_start.json").exists():
            print(f"rlkit: building the warm-start summarizer in {folder} (once; later runs reuse it)", file=sys.stderr, flush=True)
        path = build_warm_start(folder, n_layer=config.n_layer, n_embd=config.n_embd, n_head=config.n_head,
                                sft_steps=config.sft_steps, batch_size=config.sft_batch_size, lr=config.sft_learning_rate,
                                seed=config.seed, filler_share=config.sft_filler_share, progress=Progress(config.sft_steps, label="warm-start step"))
        super().__init__(HFPolicyConfig(model=str(path), dtype=config.dtype), context)


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
