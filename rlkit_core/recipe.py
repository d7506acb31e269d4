"""Reading a recipe: TOML in, frozen attrs objects out, every problem located and reported together.

The document is parsed at the edge by one cattrs converter. Core tables become `rlkit_core.schema`
classes; each component table's `type` picks a registered component and the rest of the table is
structured into that component's own config class.
"""

from __future__ import annotations

import copy
import difflib
import sys
from pathlib import Path
from typing import Any

import attrs
import cattrs
import torch
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError
from cattrs.v import transform_error

from rlkit_core.errors import RecipeError
from rlkit_core.registry import Component, Registry
from rlkit_core.schema import (
    COMPONENT_TABLES, CORE_TABLES, EvalConfig, OptimConfig, PPOConfig, RunConfig, batch_arithmetic_problems, kl_problems,
    launch_problems, launched_processes,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@attrs.frozen
class ComponentChoice:
    table: str
    component: Component
    config: Any


@attrs.frozen
class Recipe:
    run: RunConfig
    ppo: PPOConfig
    optim: OptimConfig
    components: dict[str, ComponentChoice]
    document: dict[str, Any]  # the TOML document after overrides, as logged with the run
    source: str | None = None
    eval: EvalConfig = EvalConfig()
    eval_metrics: tuple[Component, ...] = ()  # the reward components named by eval.metrics

    def __getitem__(self, table: str) -> ComponentChoice:
        return self.components[table]


def _strict(expected: type, words: str):
    """Structure hook that refuses what TOML would only reach by accident (2.5 for an int, 5 for a str)."""

    def structure(value, _type):
        ok = isinstance(value, expected) and not (expected is not bool and isinstance(value, bool))
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if not ok:
            raise TypeError(f"expected {words}, got {value!r} ({type(value).__name__})")
        return value

    return structure


def make_converter() -> cattrs.Converter:
    converter = cattrs.Converter(forbid_extra_keys=True)
    converter.register_structure_hook(int, _strict(int, "an integer"))
    converter.register_structure_hook(float, _strict(float, "a number"))
    converter.register_structure_hook(str, _strict(str, "a string"))
    converter.register_structure_hook(bool, _strict(bool, "true or false"))
    return converter


CONVERTER = make_converter()


_UNKNOWN_KEYS = "\1unknown keys\1"


def _describe(exc: BaseException, _type) -> str:
    if isinstance(exc, ForbiddenExtraKeysError):
        return _UNKNOWN_KEYS + "\0".join(sorted(exc.extra_fields))  # split into one message per key below
    if isinstance(exc, KeyError):
        return "required key is missing"
    return str(exc)


def structure_table(data: Any, cls: type, where: str) -> tuple[Any, list[str]]:
    """(instance or None, problems) for one table; validators run after structuring so that every
    failing field is reported, not just the first."""
    if not isinstance(data, dict):
        return None, [f"{where}: expected a table, got {data!r}"]
    known = [f.name for f in attrs.fields(cls)]
    with attrs.validators.disabled():
        try:
            instance = CONVERTER.structure(data, cls)
        except ClassValidationError as exc:
            return None, [p for line in transform_error(exc, path=where, format_exception=_describe) for p in _split(line, known)]
    problems = []
    for field in attrs.fields(cls):
        if field.validator is None:
            continue
        try:
            field.validator(instance, field, getattr(instance, field.name))
        except (ValueError, TypeError) as exc:
            problems.append(f"{where}.{field.name}: {exc}")
    return (None if problems else instance), problems


def _split(line: str, known: list[str]) -> list[str]:
    """`msg @ $.path` lines from cattrs → `$.path: msg`, one per unknown key."""
    message, _, path = line.rpartition(" @ ")
    if not message.startswith(_UNKNOWN_KEYS):
        return [f"{path}: {message}"]
    problems = []
    for key in message[len(_UNKNOWN_KEYS):].split("\0"):
        hint = difflib.get_close_matches(key, known, n=1)
        suggestion = f"did you mean {hint[0]!r}?" if hint else f"known keys: {', '.join(known)}"
        problems.append(f"{path}.{key}: unknown key; {suggestion}")
    return problems


def apply_overrides(document: dict, overrides: list[str]) -> dict:
    """`--set a.b=value` into a copy of the document. Values are TOML literals (`4`, `true`,
    `"text"`, `[1, 2]`); anything that is not one is taken as a plain string."""
    result = copy.deepcopy(document)
    problems = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            problems.append(f"--set {item}: expected KEY=VALUE with a dotted key, such as kl.target=4")
            continue
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        table = result
        for part in parts[:-1]:
            table = table.setdefault(part, {})
            if not isinstance(table, dict):
                problems.append(f"--set {item}: {part!r} is not a table in the recipe")
                break
        else:
            table[parts[-1]] = value
    if problems:
        raise RecipeError(problems)
    return result


def parse_recipe(document: dict, registry: Registry, source: str | None = None) -> Recipe:
    problems: list[str] = []
    known_tables = [*CORE_TABLES, *COMPONENT_TABLES]
    for table in document:
        if table not in known_tables:
            hint = difflib.get_close_matches(table, known_tables, n=1)
            suggestion = f"did you mean [{hint[0]}]?" if hint else f"known tables: {', '.join(known_tables)}"
            problems.append(f"$.{table}: unknown table; {suggestion}")

    core = {}
    for table, cls in CORE_TABLES.items():
        core[table], found = structure_table(document.get(table, {}), cls, f"$.{table}")
        problems += found
    if core["ppo"] is not None:
        problems += batch_arithmetic_problems(core["ppo"], launched_processes()) + kl_problems(core["ppo"])

    components = {}
    for table, (kind, default_type) in COMPONENT_TABLES.items():
        choice, found = _component(document, table, kind, default_type, registry)
        problems += found
        components[table] = choice

    if core["run"] is not None and components.get("policy") is not None:
        problems += launch_problems(core["run"], components["policy"].config, torch.cuda.is_available())
    eval_metrics, found = _eval_metrics(core["eval"], registry)
    problems += found
    if problems:
        raise RecipeError(problems, source)
    return Recipe(core["run"], core["ppo"], core["optim"], components, document, source, core["eval"], eval_metrics)


def _eval_metrics(config: EvalConfig | None, registry: Registry) -> tuple[tuple[Component, ...], list[str]]:
    """The reward components `[eval] metrics` names; each is built with its default settings."""
    if config is None:
        return (), []
    found, problems = [], []
    for index, name in enumerate(config.metrics):
        where = f"$.eval.metrics[{index}]"
        try:
            component = registry.get("reward", name, where)
        except RecipeError as exc:
            problems += exc.problems
            continue
        required = [f.name for f in attrs.fields(component.config_class) if f.default is attrs.NOTHING]
        if required:
            problems.append(f"{where}: reward {name!r} needs settings ({', '.join(required)}); an eval metric is built "
                            "with its defaults, so name a reward whose settings all have defaults")
            continue
        found.append(component)
    return tuple(found), problems


def _component(document, table, kind, default_type, registry) -> tuple[ComponentChoice | None, list[str]]:
    where = f"$.{table}"
    data = document.get(table)
    if data is None:
        if default_type is None:
            return None, [f"{where}: this table is required; add [{table}] with type = one of {', '.join(registry.names(kind)) or '(none registered)'}"]
        data = {"type": default_type}
    if not isinstance(data, dict):
        return None, [f"{where}: expected a table, got {data!r}"]
    options = dict(data)
    name = options.pop("type", default_type)
    if name is None:
        return None, [f"{where}.type: required; one of {', '.join(registry.names(kind)) or '(none registered)'}"]
    if not isinstance(name, str):
        return None, [f"{where}.type: expected a string, got {name!r}"]
    try:
        component = registry.get(kind, name, f"{where}.type")
    except RecipeError as exc:
        return None, exc.problems
    config, problems = structure_table(options, component.config_class, where)
    return (None if problems else ComponentChoice(table, component, config)), problems


def load_recipe(path: str | Path, registry: Registry, overrides: list[str] = ()) -> Recipe:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError([f"no recipe at {path}; check the path (recipes ship in the repository's recipes/ folder)"]) from None
    except OSError as exc:
        raise RecipeError([f"cannot read {path}: {exc.strerror}"]) from None
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError([f"not valid TOML: {exc}"], str(path)) from None
    document = apply_overrides(document, list(overrides))
    recipe = parse_recipe(document, registry, str(path))
    if not recipe.run.name:
        recipe = attrs.evolve(recipe, run=attrs.evolve(recipe.run, name=path.stem))
    return recipe
