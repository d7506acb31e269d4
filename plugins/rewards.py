"""Reward sources: `python` (a function you name) and `reward-model` (a sequence classifier)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from pathlib import Path

import attrs
import torch

from rlkit_core import hookimpl
from rlkit_core.config import at_least, greater_than, setting
from rlkit_core.errors import RecipeError
from rlkit_core.hf_loading import check_tokenizer
from rlkit_core.interfaces import RewardSource
from rlkit_core.randomness import switch_off_dropout


@attrs.frozen
class PythonRewardConfig:
    function: str = setting(help="'package.module:function' or 'path/to/file.py:function', called with prompts=, responses= and every data column")


@attrs.frozen
class RewardModelConfig:
    model: str = setting(help="a transformers sequence-classification model directory or hub name")
    tokenizer: str = setting("", help="its tokenizer (empty: the model's)")
    label_index: int = setting(0, help="which output logit is the score", validator=at_least(0))
    batch_size: int = setting(32, help="pairs scored per forward pass", validator=greater_than(0))
    max_length: int = setting(1024, help="longest prompt + response in tokens; longer inputs keep their end", validator=greater_than(0))


def import_function(spec: str, where: str):
    """`module:function` or `file.py:function` → the callable, or a located RecipeError."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise RecipeError([f"{where}: expected 'module:function' or 'path/to/file.py:function', got {spec!r}"])
    try:
        if target.endswith(".py"):
            path = Path(target)
            if not path.is_file():
                raise RecipeError([f"{where}: no file {target!r} (relative paths start at the working directory)"])
            module_spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except RecipeError:
        raise
    except Exception as exc:
        raise RecipeError([f"{where}: importing {target!r} failed: {type(exc).__name__}: {exc}"]) from None
    function = getattr(module, name, None)
    if not callable(function):
        raise RecipeError([f"{where}: {target!r} has no function {name!r}"])
    return function


class PythonReward(RewardSource):
    def __init__(self, config: PythonRewardConfig, context=None):
        self.name = config.function
        self.function = import_function(config.function, "$.reward.function")
        parameters = inspect.signature(self.function).parameters
        self.takes_everything = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        self.accepted = set(parameters)
        missing = {"prompts", "responses"} - self.accepted
        if missing and not self.takes_everything:
            raise RecipeError([f"$.reward.function: {config.function} must accept keyword arguments prompts and responses "
                               f"(missing: {', '.join(sorted(missing))}); add **columns to receive the data's other columns"])

    def score(self, prompts, responses, **columns):
        if not self.takes_everything:
            columns = {k: v for k, v in columns.items() if k in self.accepted}
        return self.function(prompts=prompts, responses=responses, **columns)  # the trainer checks what comes back


class RewardModel(RewardSource):
    """Scores prompt + response with a classifier read at the last real token.

    Its tokenizer may differ from the policy's: it scores text, re-tokenized here. A conversation
    (a `messages` column) is re-rendered with the reward model's own chat template, the response
    as the assistant's turn; without a template, or for a plain prompt, it reads prompt + response."""

    def __init__(self, config: RewardModelConfig, context):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.config = config
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model)
            self.model = AutoModelForSequenceClassification.from_pretrained(config.model)
        except OSError as exc:
            raise RecipeError([f"$.reward.model: cannot load {config.model!r}: {exc}"]) from None
        rows = self.model.get_input_embeddings().num_embeddings
        if len(self.tokenizer) > rows:
            raise RecipeError([f"$.reward.tokenizer: {config.tokenizer or config.model!r} has {len(self.tokenizer)} tokens but "
                               f"the reward model's embedding has {rows} rows; give the tokenizer the model was trained with"])
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "right"
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        switch_off_dropout(self.model)
        self.model.eval().to(context.device)
        self.device = context.device

    @staticmethod
    def check(config: RewardModelConfig, recipe) -> tuple[list[str], list[str]]:
        """(problems, notes) of `rlkit check`: the reward model's tokenizer must load."""
        problems, notes = [], []
        check_tokenizer(config.tokenizer or config.model, "$.reward.tokenizer" if config.tokenizer else "$.reward.model", problems, notes)
        return problems, notes

    def token_ids(self, prompt: str, response: str, messages) -> list[int]:
        """The reward model's view of one rollout, truncated from the left to `max_length`."""
        if messages and self.tokenizer.chat_template:
            conversation = [*messages, {"role": "assistant", "content": response}]
            text = self.tokenizer.apply_chat_template(conversation, tokenize=False)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]  # the template writes its own BOS
        else:
            ids = self.tokenizer(prompt + response)["input_ids"]
        return ids[-self.config.max_length:]

    @torch.no_grad()
    def score(self, prompts, responses, **columns):
        conversations = columns.get("messages") or [None] * len(prompts)
        rows = [self.token_ids(p, r, m) for p, r, m in zip(prompts, responses, conversations)]
        scores = []
        for start in range(0, len(rows), self.config.batch_size):
            enc = self.tokenizer.pad({"input_ids": rows[start:start + self.config.batch_size]}, return_tensors="pt").to(self.device)
            logits = self.model(**enc).logits
            scores += logits[:, self.config.label_index].float().tolist()
        return scores


@hookimpl
def register_rewards(register):
    register("python", PythonReward, PythonRewardConfig)
    register("reward-model", RewardModel, RewardModelConfig)
