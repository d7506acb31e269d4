"""Prompt sources: `jsonl` (one JSON object a line) and `hf-dataset` (local files or hub datasets through `datasets`)."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import attrs

from rlkit_core import PromptLengthLimit, PromptSource, RecipeError, at_least, building_at, hookimpl, setting


@attrs.frozen
class JsonlConfig(PromptLengthLimit):
    path: str = setting(help="a .jsonl file: one JSON object per line")
    prompt_field: str = setting("prompt", help="the key holding the prompt text (or use a `messages` list); other keys go to the reward as columns")
    limit: int = setting(0, help="use only the first N records (0: all)", validator=at_least(0))


@attrs.frozen
class HFDatasetConfig(PromptLengthLimit):
    path: str = setting(help="a dataset name for datasets.load_dataset ('json', 'csv', 'parquet' or a hub name)")
    name: str = setting("", help="the data set's configuration name, for hub data sets that have several")
    data_files: list[str] = setting(factory=list, help="local files for the 'json'/'csv'/'parquet' loaders")
    split: str = setting("train", help="which split to read")
    prompt_field: str = setting("prompt", help="the column holding the prompt text (or use a `messages` column)")
    fields: dict[str, str] = setting(factory=dict, help="rename columns for the reward: {name the reward expects = column in the data}")
    limit: int = setting(0, help="use only the first N records (0: all)", validator=at_least(0))


def _with_prompt(record: dict, field: str, where: str) -> dict:
    """The record with its prompt under `prompt`, or a conversation under `messages`."""
    if field not in record and "messages" in record:
        messages = record["messages"]
        if not (isinstance(messages, list) and messages and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages)):
            raise RecipeError([f"{where}: `messages` must be a non-empty list of {{\"role\": ..., \"content\": ...}} strings"])
        return {"prompt": None, **record}
    if field not in record:
        raise RecipeError([f"{where}: has no field {field!r} and no `messages` (fields: {', '.join(record) or 'none'}); set data.prompt_field"])
    if not isinstance(record[field], str):
        raise RecipeError([f"{where}: field {field!r} must be a string, got {type(record[field]).__name__}"])
    rest = {k: v for k, v in record.items() if k != field}
    return {"prompt": record[field], **rest}


class JsonlPrompts(PromptSource):
    def __init__(self, config: JsonlConfig, context=None, where: str = ""):
        self.config = config
        self.where = where or building_at(context, "data")  # `where` when `check` reads the file

    @staticmethod
    def check(config: JsonlConfig, recipe, where: str) -> tuple[list[str], list[str]]:
        """(problems, notes) of `rlkit check` and the start of `rlkit run`: the file reads as records
        with a prompt (reading it is cheap next to a run)."""
        try:
            JsonlPrompts(config, where=where).load()
        except RecipeError as exc:
            return exc.problems, []
        return [], []

    def load(self):
        path = Path(self.config.path)
        if not path.is_file():
            raise RecipeError([f"{self.where}.path: no file {str(path)!r} (relative paths start at the working directory)"])
        try:
            return self._records(path)
        except UnicodeDecodeError as exc:
            raise RecipeError([f"{self.where}.path: {str(path)!r} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
                               "give a .jsonl file: one JSON object a line"]) from None

    def _records(self, path: Path) -> list[dict]:
        records = []
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise RecipeError([f"{path}:{number}: not valid JSON: {exc.msg}"]) from None
                if not isinstance(record, dict):
                    raise RecipeError([f"{path}:{number}: expected a JSON object, got {type(record).__name__}"])
                records.append(_with_prompt(record, self.config.prompt_field, f"{path}:{number}"))
                if self.config.limit and len(records) == self.config.limit:
                    break
        if not records:
            raise RecipeError([f"{self.where}.path: {str(path)!r} holds no records; give a file with one JSON object a line"])
        return records


class HFDatasetPrompts(PromptSource):
    requires = {"datasets": "rlkit[datasets]"}

    def __init__(self, config: HFDatasetConfig, context=None):
        self.config = config
        self.where = building_at(context, "data")

    @staticmethod
    def check(config: HFDatasetConfig, recipe, where: str) -> tuple[list[str], list[str]]:
        """(problems, notes) of `rlkit check` and the start of `rlkit run`: every local data file is
        there (`datasets` would otherwise fail only after setting up its cache)."""
        missing = [pattern for pattern in config.data_files if "://" not in pattern and not glob.glob(pattern)]
        return [f"{where}.data_files: no file matches {pattern!r} (relative paths start at the working directory)"
                for pattern in missing], []

    def load(self):
        try:
            import datasets
        except ImportError:
            raise RecipeError([f"{self.where}.type: 'hf-dataset' needs the datasets package: pip install 'rlkit[datasets]'"]) from None
        config = self.config
        try:
            table = datasets.load_dataset(config.path, config.name or None, split=config.split,
                                          data_files=list(config.data_files) or None)
        except (FileNotFoundError, ValueError) as exc:
            raise RecipeError([f"{self.where}: cannot load {config.path!r} (split {config.split!r}): {str(exc).splitlines()[0]}"]) from None
        assert isinstance(table, datasets.Dataset)  # one split, read whole (not streamed)
        missing = [column for column in config.fields.values() if column not in table.column_names]
        if missing:
            raise RecipeError([f"{self.where}.fields: no column {missing[0]!r} in {config.path!r} (columns: {', '.join(table.column_names)})"])
        if config.limit:
            table = table.select(range(min(config.limit, len(table))))
        renamed = {column: name for name, column in config.fields.items()}
        return [_with_prompt({renamed.get(k, k): v for k, v in dict(row).items()}, config.prompt_field, f"{config.path}[{i}]")
                for i, row in enumerate(table)]


@hookimpl
def register_prompt_sources(register):
    register("jsonl", JsonlPrompts, JsonlConfig)
    register("hf-dataset", HFDatasetPrompts, HFDatasetConfig)
