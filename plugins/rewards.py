"""Reward sources: `python` (a function you name) and `reward-model` (a sequence classifier)."""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import importlib.util
import inspect
from pathlib import Path

import attrs
import torch

from rlkit_core import RecipeError, RewardSource, at_least, building_at, greater_than, hookimpl, setting, switch_off_dropout
from rlkit_core.hf import LOAD_ERRORS, check_model, load_problem


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


def _split_spec(spec: str, where: str) -> tuple[str, str]:
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise RecipeError([f"{where}: expected 'module:function' or 'path/to/file.py:function', got {spec!r}"])
    return target, name


def import_function(spec: str, where: str):
    """`module:function` or `file.py:function` → the callable, or a located RecipeError."""
    target, name = _split_spec(spec, where)
    try:
        if target.endswith(".py"):
            path = Path(target)
            if not path.is_file():
                raise RecipeError([f"{where}: no file {target!r} (relative paths start at the working directory)"])
            module_spec = importlib.util.spec_from_file_location(path.stem, path)
            assert module_spec is not None and module_spec.loader is not None  # a .py file always has its loader
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


def _signature_problem(spec: str, where: str, accepted: set[str], takes_everything: bool) -> str | None:
    missing = {"prompts", "responses"} - accepted
    if missing and not takes_everything:
        return (f"{where}: {spec} must accept keyword arguments prompts and responses (missing: {', '.join(sorted(missing))}); "
                "add **columns to receive the data's other columns")
    return None


def _source_file(target: str, where: str) -> Path | None:
    """The file that defines `target` (a .py path or a dotted module), found without importing it;
    None when only importing could tell (a module built into Python, a package that extends its path)."""
    if target.endswith(".py"):
        if not Path(target).is_file():
            raise RecipeError([f"{where}: no file {target!r} (relative paths start at the working directory)"])
        return Path(target)
    parts = target.split(".")
    try:
        spec = importlib.util.find_spec(parts[0])  # a top-level name is found without being imported
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise RecipeError([f"{where}: no module {parts[0]!r} on the Python path; install the package that holds "
                           f"{target!r}, or name a file: 'path/to/file.py:function'"])
    for index in range(1, len(parts)):  # look inside packages without running their __init__
        locations = spec.submodule_search_locations
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:index + 1]), locations) if locations else None
        if spec is None:
            return None
    return Path(spec.origin) if spec.origin and spec.origin.endswith(".py") else None


def _bound_otherwise(tree: ast.Module, name: str) -> bool:
    """Whether the module's top-level code binds `name` other than by a plain def (or may: `import *`)."""
    for statement in tree.body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(statement):
            if isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Store):
                return True
            if isinstance(node, ast.alias) and (node.name == "*" or (node.asname or node.name).split(".")[0] == name):
                return True
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return True
    return False


def check_function_statically(spec: str, where: str) -> list[str]:
    """Notes about what could not be checked; raises a located RecipeError for what is wrong:
    the file or module, the function, its keyword arguments. Reads the source, runs none of it,
    so `rlkit check` on a recipe from elsewhere runs no code the recipe names."""
    target, name = _split_spec(spec, where)
    path = _source_file(target, where)
    if path is None:
        return [f"{where}: {target!r} is not a plain source file; the function is checked when rlkit run imports it"]
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except SyntaxError as exc:
        raise RecipeError([f"{where}: {str(path)!r} line {exc.lineno}: {exc.msg}; fix the file"]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError([f"{where}: cannot read {str(path)!r}: {exc}"]) from None
    functions = {node.name: node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    if name not in functions:
        if _bound_otherwise(tree, name):  # made at import time (an import, an assignment, a class): only running it would tell
            return [f"{where}: {name!r} in {str(path)!r} is not a plain def; its signature is checked when rlkit run imports it"]
        known = ", ".join(sorted(functions)) or "none"
        raise RecipeError([f"{where}: {str(path)!r} has no function {name!r} (functions defined there: {known})"])
    arguments = functions[name].args
    accepted = {a.arg for a in arguments.args + arguments.kwonlyargs}
    problem = _signature_problem(spec, where, accepted, arguments.kwarg is not None)
    if problem:
        raise RecipeError([problem])
    return []


class PythonReward(RewardSource):
    def __init__(self, config: PythonRewardConfig, context=None):
        self.name = config.function
        where = f"{building_at(context, 'reward')}.function"
        self.function = import_function(config.function, where)
        parameters = inspect.signature(self.function).parameters
        self.takes_everything = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        self.accepted = set(parameters)
        problem = _signature_problem(config.function, where, self.accepted, self.takes_everything)
        if problem:
            raise RecipeError([problem])

    @staticmethod
    def check(config: PythonRewardConfig, recipe, where: str) -> tuple[list[str], list[str]]:
        """(problems, notes) of `rlkit check`: the function exists and takes prompts and responses,
        read from its source without running it."""
        try:
            return [], check_function_statically(config.function, f"{where}.function")
        except RecipeError as exc:
            return exc.problems, []

    @staticmethod
    def imports(config: PythonRewardConfig, where: str) -> list[str]:
        """The code `rlkit run` imports for this reward (listed by `rlkit check`)."""
        target, _, name = config.function.rpartition(":")
        what = f"the file {str(Path(target).resolve())!r}" if target.endswith(".py") else f"the module {target!r}"
        return [f"{what} for its function {name!r} ({where}.function)"]

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
        where = building_at(context, "reward")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model)
            self.model = AutoModelForSequenceClassification.from_pretrained(config.model)
        except LOAD_ERRORS as exc:
            raise RecipeError([load_problem(config.model, f"{where}.model", "a sequence classifier and its tokenizer", exc)]) from None
        rows = self.model.get_input_embeddings().num_embeddings
        if len(self.tokenizer) > rows:
            raise RecipeError([f"{where}.tokenizer: {config.tokenizer or config.model!r} has {len(self.tokenizer)} tokens but "
                               f"the reward model's embedding has {rows} rows; give the tokenizer the model was trained with"])
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "right"
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        switch_off_dropout(self.model)
        self.model.eval().to(context.device)
        self.device = context.device

    @staticmethod
    def check(config: RewardModelConfig, recipe, where: str) -> tuple[list[str], list[str]]:
        """(problems, notes) of `rlkit check`: a local model folder must hold a model, and the reward
        model's tokenizer must load."""
        problems, notes = [], []
        check_model(config.model, config.tokenizer, where, problems, notes)
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
