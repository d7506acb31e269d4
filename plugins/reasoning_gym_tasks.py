"""reasoning-gym's procedural datasets as rlkit parts: the `reasoning-gym` prompt source, whose
records carry each entry as the dataset made it, and the `reasoning-gym` reward, which reads the
answer between <answer> tags with reasoning-gym's own extraction and scores it with the dataset's
own `score_answer`. So rlkit adds no scoring rule of its own, and a dataset scores as it does in
reasoning-gym. The package is imported only when a part is checked or built, so that `rlkit
plugins` works without it. Single-turn tasks only: each entry is one question and one answer.

And `warm-start-answerer`, a policy for the offline recipe: the byte-level toy supervised on the
recipe's own questions, answered right only a share of the time and otherwise off by a little, so
that it starts near the answers and RL has something to reinforce and room to improve.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import random
from typing import Any

import attrs

from rlkit_core import PromptLengthLimit, PromptSource, RecipeError, RewardSource, between, building_at, greater_than, hookimpl, setting

from .warm_start import EOS_ID, Example, WarmStartConfig, WarmStartPolicy

INSTALL = "pip install 'rlkit[reasoning-gym]'"
INSTRUCTION = "Give your final answer between <answer> and </answer> tags, with nothing else inside them."
# registered in reasoning-gym but not taken here: `composite` mixes datasets through nested config
# classes that a recipe's table does not build
UNSUPPORTED = {"composite": "mix datasets in a python reward or run one recipe per dataset"}


@attrs.frozen
class ReasoningGymConfig(PromptLengthLimit):
    dataset: str = setting(help="a reasoning-gym dataset name, e.g. 'chain_sum' (the keys of reasoning_gym.factory.DATASETS)")
    size: int = setting(1000, help="entries to generate", validator=greater_than(0))
    seed: int = setting(0, help="seed of the generator (the same seed gives the same entries)")
    dataset_config: dict[str, Any] = setting(factory=dict, help="the dataset's own settings besides seed and size, e.g. {max_terms = 3}")
    instruction: str = setting(INSTRUCTION, help="put after each question: how to give the answer the reward reads ('': none)")
    chat: bool = setting(False, help="give each prompt as a user message for the policy's chat template instead of plain text")


@attrs.frozen
class ReasoningGymRewardConfig:
    pass


def import_reasoning_gym(where: str):
    try:
        import reasoning_gym
    except ImportError:
        raise RecipeError([f"{where}.type: 'reasoning-gym' needs the reasoning-gym package: {INSTALL}"]) from None
    return reasoning_gym


def make_dataset(name: str, settings: dict[str, Any], seed: int, size: int, where: str):
    """reasoning-gym's dataset `name` built from `settings` (its config class's fields besides seed
    and size), or a located error: an unknown name with the close ones, an unknown setting, or
    settings the dataset refuses."""
    reasoning_gym = import_reasoning_gym(where)
    from reasoning_gym.factory import DATASETS

    if name in UNSUPPORTED:
        raise RecipeError([f"{where}.dataset: {name!r} is not supported here; {UNSUPPORTED[name]}"])
    if name not in DATASETS:
        known = sorted(set(DATASETS) - set(UNSUPPORTED))
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(map(repr, close))}?" if close else f"some are {', '.join(known[:6])}, ... ({len(known)} in all)"
        raise RecipeError([f"{where}.dataset: reasoning-gym has no dataset {name!r}; {hint}"])
    fields = [field.name for field in dataclasses.fields(DATASETS[name][1]) if field.init]
    problems = []
    for key in settings:
        if key in ("seed", "size"):
            problems.append(f"{where}.dataset_config.{key}: set data.{key} instead")
        elif key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"its settings: {', '.join(f for f in fields if f not in ('seed', 'size'))}"
            problems.append(f"{where}.dataset_config.{key}: {name!r} has no setting {key!r}; {hint}")
    if problems:
        raise RecipeError(problems)
    try:
        return reasoning_gym.create_dataset(name, **settings, seed=seed, size=size)
    except Exception as exc:  # the dataset's own validate(): an AssertionError or ValueError with its reason
        raise RecipeError([f"{where}.dataset_config: {name!r} refuses these settings: {type(exc).__name__}: {exc}"]) from None


class ReasoningGymPrompts(PromptSource):
    """Each record: `prompt` (the question and the instruction), `entry` (the dataset's entry:
    question, answer, metadata, what `score_answer` reads) and `dataset` (name and settings, from
    which the reward rebuilds the dataset that scores it)."""

    requires = {"reasoning_gym": "rlkit[reasoning-gym]"}

    def __init__(self, config: ReasoningGymConfig, context=None, where: str = ""):
        self.config = config
        self.where = where or building_at(context, "data")  # `where` when `check` builds it

    @staticmethod
    def check(config: ReasoningGymConfig, recipe, where: str) -> tuple[list[str], list[str]]:
        """(problems, notes) of `rlkit check` and the start of `rlkit run`: the dataset builds from
        its settings and makes its first record (one entry: cheap next to a run)."""
        try:
            ReasoningGymPrompts(config, where=where).records(1)
        except RecipeError as exc:
            return exc.problems, []
        return [], []

    def load(self):
        return self.records(self.config.size)

    def records(self, count: int) -> list[dict[str, Any]]:
        config = self.config
        dataset = make_dataset(config.dataset, config.dataset_config, config.seed, config.size, self.where)
        described = {"name": config.dataset, "settings": dict(config.dataset_config), "seed": config.seed, "size": config.size}
        made = []
        for index in range(count):
            try:
                entry = dataset[index]
            except Exception as exc:  # the generator's own failure on these settings
                raise RecipeError([f"{self.where}: reasoning-gym's {config.dataset!r} failed to make entry {index}: "
                                   f"{type(exc).__name__}: {exc}; change data.dataset_config or data.seed"]) from None
            made.append(self._record(entry, described))
        return made

    def _record(self, entry: dict[str, Any], described: dict[str, Any]) -> dict[str, Any]:
        text = f"{entry['question']}\n\n{self.config.instruction}" if self.config.instruction else entry["question"]
        record = {"prompt": text, "entry": entry, "dataset": described}
        if self.config.chat:
            record["messages"] = [{"role": "user", "content": text}]
        return record


class ReasoningGymReward(RewardSource):
    """The dataset's own score of the answer between the response's last <answer> tags; a response
    without them is scored as reasoning-gym scores no answer (`score_answer(None, entry)`)."""

    requires = {"reasoning_gym": "rlkit[reasoning-gym]"}

    def __init__(self, config: ReasoningGymRewardConfig, context=None):
        self.where = building_at(context, "reward")
        import_reasoning_gym(self.where)
        self.datasets: dict[str, Any] = {}  # by name and settings: one instance scores every record made with them

    @staticmethod
    def check(config: ReasoningGymRewardConfig, recipe, where: str) -> tuple[list[str], list[str]]:
        """(problems, notes): the package is there, and the data says whose entries these are."""
        try:
            import_reasoning_gym(where)
        except RecipeError as exc:
            return exc.problems, []
        data = recipe.components.get("data")
        if data is not None and data.component.factory is not ReasoningGymPrompts:
            return [], [f"{where}: scores records with reasoning-gym's `entry` and `dataset` columns; data.type is {data.component.name!r}"]
        return [], []

    def score(self, prompts, responses, **columns):
        from reasoning_gym.utils import extract_answer

        entries, described = columns.get("entry"), columns.get("dataset")
        if entries is None or described is None:
            raise RecipeError([f"{self.where}: the data has no `entry` and `dataset` columns (columns: {', '.join(columns) or 'none'}); "
                               "use data.type = 'reasoning-gym'"])
        return [float(self._dataset(about).score_answer(extract_answer(response), entry))
                for response, entry, about in zip(responses, entries, described)]

    def _dataset(self, described: dict[str, Any]):
        key = json.dumps(described, sort_keys=True, default=str)
        if key not in self.datasets:
            self.datasets[key] = make_dataset(described["name"], described["settings"], described["seed"], described["size"], self.where)
        return self.datasets[key]


@attrs.frozen
class AnswererConfig(WarmStartConfig):
    right_share: float = setting(0.3, help="share of the supervised answers that are right; the others are off by 1 or 2 (a slip)",
                                 validator=between(0.0, 1.0))


class WarmStartAnswerer(WarmStartPolicy):
    """The warm start supervised on the questions of the recipe's `[data]` (a `reasoning-gym`
    source: its dataset, settings and instruction, from another seed), each answered in <answer>
    tags: right for a `right_share` of them, else off by 1 or 2, as a careless solver slips. A slip
    is made on the number, so the dataset's answers must be integers."""

    def __init__(self, config: AnswererConfig, context):
        where = building_at(context, "policy")
        data = context.recipe["data"]
        if data.component.name != "reasoning-gym":
            raise RecipeError([f"{where}.type: 'warm-start-answerer' learns the questions of a [data] table of type 'reasoning-gym', "
                               f"not {data.component.name!r}"])
        self.data, self.where = data.config, where
        super().__init__(config, context)

    def folder_name(self, config) -> str:
        questions = hashlib.sha256(json.dumps(self.corpus(config), sort_keys=True).encode()).hexdigest()[:10]
        return (f"answerer-{self.data.dataset}-{questions}-l{config.n_layer}-d{config.n_embd}-h{config.n_head}"
                f"-s{config.sft_steps}-seed{config.seed}")

    def corpus(self, config) -> dict[str, Any]:
        return {"corpus": "reasoning-gym", "dataset": self.data.dataset, "dataset_config": dict(self.data.dataset_config),
                "instruction": self.data.instruction, "right_share": config.right_share, "wrong": "off by 1 or 2"}

    def examples(self, config, tokenizer, size: int, seed: int) -> list[Example]:
        questions = ReasoningGymPrompts(attrs.evolve(self.data, seed=self.data.seed + 1 + seed, size=size, chat=False), where=self.where)
        records = questions.records(size)
        try:
            answers = [int(record["entry"]["answer"]) for record in records]
        except ValueError:
            raise RecipeError([f"{self.where}.type: 'warm-start-answerer' slips on integer answers, and "
                               f"{self.data.dataset!r} with these settings answers otherwise"]) from None
        rng = random.Random(f"answerer/{seed}")
        examples = []
        for record, answer in zip(records, answers):
            given = answer if rng.random() < config.right_share else answer + rng.choice((-2, -1, 1, 2))  # a slip
            prompt = tokenizer(record["prompt"], add_special_tokens=False)["input_ids"]
            target = tokenizer(f"<answer>{given}</answer>", add_special_tokens=False)["input_ids"] + [EOS_ID]
            examples.append((prompt + target, [False] * len(prompt) + [True] * len(target)))
        return examples


@hookimpl
def register_prompt_sources(register):
    register("reasoning-gym", ReasoningGymPrompts, ReasoningGymConfig)


@hookimpl
def register_rewards(register):
    register("reasoning-gym", ReasoningGymReward, ReasoningGymRewardConfig)


@hookimpl
def register_policies(register):
    register("warm-start-answerer", WarmStartAnswerer, AnswererConfig)
