"""The default recipe's parts, as ordinary plugins: a miniature summarisation corpus
(`toy-summaries`), a ROUGE reward against a reference column (`rouge`), and a policy that is a
small byte-level GPT-2 warm-started by supervised fine-tuning, built once and cached
(`warm-start-summarizer`). Everything is made here, offline; nothing is downloaded."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import attrs

from rlkit_core import (
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

from . import summarize_task
from .warm_start import EOS_ID, Example, WarmStartConfig, WarmStartPolicy


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


@attrs.frozen
class SummarizerConfig(WarmStartConfig):
    sft_filler_share: float = setting(
        0.0, help="share of supervised summaries that carelessly go on with a filler sentence of the document (the reward still wants the clean reference)",
        validator=between(0.0, 1.0))


def summary_examples(tokenizer, records: Sequence[dict], filler_share: float, rng: random.Random) -> list[Example]:
    """(prompt ids + summary ids + EOS, which of them the loss counts: the summary and EOS) for each
    record; a `filler_share` of the summaries go on with one filler sentence of the document."""
    examples = []
    for record in records:
        prompt = tokenizer(record["prompt"], add_special_tokens=False)["input_ids"]  # ByT5Tokenizer appends EOS unless told not to
        summary = record["reference"]
        if rng.random() < filler_share:
            summary += " " + rng.choice(summarize_task.filler_sentences(record))
        target = tokenizer(summary, add_special_tokens=False)["input_ids"] + [EOS_ID]
        ids = prompt + target
        examples.append((ids, [False] * len(prompt) + [True] * len(target)))
    return examples


class WarmStartSummarizer(WarmStartPolicy):
    """The warm start supervised on prompt + reference summary + EOS of `summarize_task.make_corpus`.

    The supervised summary is the reference, except that a share `sft_filler_share` of them go on
    with one filler sentence of the document ("The baker sold bread in Paris. The sky was grey."):
    careless human summaries, of the kind real SFT data holds. The reward still compares against
    the clean reference, so PPO has a flaw to fix that a reader sees at once, besides wrong facts.
    The warm start is measured the way PPO sees it: the first iterations of the default recipe
    report its sampled score.

    It is deliberately short: the policy should write summary-shaped text with facts often wrong,
    so PPO has room to improve on it. Measured on a 2-core CPU (2 layers, width 128, 4 heads: 0.48 M
    parameters; AdamW, batch 32, lr 3e-3), summaries sampled at temperature 1 unless said otherwise:
    - `sft_filler_share` 0 (the defaults, the algorithm-variant recipes): SFT crosses into copying
      facts between 700 and 800 steps. At 700 the summaries score a mean ROUGE-1 F1 of 0.40 and never
      copy a whole fact, and 150 PPO iterations leave them there (0.40 -> 0.42); at 800 they score
      0.72 and one in eight copies the whole fact (one in three greedy summaries), which PPO then raises.
    - `sft_filler_share` 0.75 (the default recipe): the filler delays copying; at 800 steps no greedy
      summary copies a fact, at 1100 three in five do, half of the sampled ones, and every greedy
      summary goes on with a filler sentence.
    Fewer steps leave more room on paper but none that PPO can use.
    """

    @staticmethod
    def folder_name(config) -> str:
        return (f"summarizer-l{config.n_layer}-d{config.n_embd}-h{config.n_head}-s{config.sft_steps}-f{config.sft_filler_share:g}"
                f"-seed{config.seed}")

    @staticmethod
    def corpus(config) -> dict:
        return {"prompt_separator": summarize_task.PROMPT_SEPARATOR, "filler_share": config.sft_filler_share}

    @staticmethod
    def examples(config, tokenizer, size: int, seed: int) -> list[Example]:
        return summary_examples(tokenizer, summarize_task.make_corpus(size, seed), config.sft_filler_share, random.Random(f"filler/{seed}"))


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
    register("warm-start-summarizer", WarmStartSummarizer, SummarizerConfig)
