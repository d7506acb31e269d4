"""Reading a recipe: TOML in, frozen attrs objects out, every problem located and reported together.

The document is parsed at the edge by one cattrs converter. Core tables become `rlkit_core.recipe.schema`
classes; each component table's `type` picks a registered component and the rest of the table is
structured into that component's own config class. A component table may hold component tables of
its own (settings declared with `rlkit_core.config.nested_component(s)`); each is read the same way,
and its problems are located where it sits (`$.reward.parts[1].weight`). Problems travel as
`rlkit_core.errors.Problem` records until they are reported.
"""

from __future__ import annotations

import copy
import difflib
import json
import sys
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import cattrs
from cattrs.errors import AttributeValidationNote, ClassValidationError, ForbiddenExtraKeysError, IterableValidationError

from rlkit_core.config import nested_spec
from rlkit_core.errors import Problem, RecipeError
from rlkit_core.interfaces import KIND_OF_TABLE, NO_COMPONENT
from rlkit_core.launch import ONE_PROCESS, Launch
from rlkit_core.recipe.launch import launch_problems, sharding_problems
from rlkit_core.recipe.registry import Registry
from rlkit_core.recipe.schema import (
    COMPONENT_TABLES,
    CORE_TABLES,
    batch_arithmetic_problems,
    critic_problems,
    kl_penalty_problems,
    kl_problems,
    overlong_problems,
    packing_problems,
    schedule_problems,
    scheduler_problems,
)
from rlkit_core.records import Component, ComponentChoice, EvalConfig, PPOConfig, Recipe

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib  # pyright: ignore[reportMissingImports] (a dependency on Python 3.10 only)


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


def _scalars() -> cattrs.Converter:
    converter = cattrs.Converter(forbid_extra_keys=True)
    converter.register_structure_hook(int, _strict(int, "an integer"))
    converter.register_structure_hook(float, _strict(float, "a number"))
    converter.register_structure_hook(str, _strict(str, "a string"))
    converter.register_structure_hook(bool, _strict(bool, "true or false"))
    return converter


def make_converter() -> cattrs.Converter:
    """Strict about every value: cattrs alone would read 2.5 as the integer 2 and the string
    "c_attn" as the list of its letters."""
    converter, items = _scalars(), _scalars()  # `items` reads a list's or a table's contents once its kind is right
    for origin, words in ((list, "an array ([...])"), (dict, "a table ({...})")):
        def structure(value, cls, origin=origin, words=words):
            if not isinstance(value, origin):
                raise TypeError(f"expected {words}, got {value!r} ({type(value).__name__})")
            return items.structure(value, cls)

        converter.register_structure_hook_func(lambda t, origin=origin: typing.get_origin(t) is origin, structure)
    return converter


CONVERTER = make_converter()


# Nested component tables are read by `read_component_table` before cattrs runs; cattrs passes
# them through, whether a setting holds one (`ComponentChoice`, `ComponentChoice | None`) or a list.
CONVERTER.register_structure_hook_func(lambda t: t is ComponentChoice or ComponentChoice in typing.get_args(t),
                                       lambda value, _type: value)


def structure_table(data: Any, cls: type, where: str, registry: Registry | None = None,
                    also_known: tuple[str, ...] = ()) -> tuple[Any, list[Problem]]:
    """(instance or None, problems) for one table. Validators run after structuring so that every
    failing field is reported, not just the first. Nested component tables need the `registry`;
    `also_known` are keys the caller took out of `data` (named in "did you mean" hints)."""
    if not isinstance(data, dict):
        return None, [Problem(where, f"expected a table, got {data!r}")]
    data, problems, broken = _nested_tables(data, cls, where, registry)
    with attrs.validators.disabled():
        try:
            instance = CONVERTER.structure(data, cls)
        except ClassValidationError as exc:
            return None, problems + _located(exc, where, cls, also_known)
    for field in attrs.fields(cls):
        if field.validator is None or field.name in broken:
            continue
        try:
            field.validator(instance, field, getattr(instance, field.name))
        except (ValueError, TypeError) as exc:
            problems.append(Problem(f"{where}.{field.name}", str(exc)))
    return (None if problems else instance), problems


def _located(exc: BaseException, where: str, cls: type, also_known: tuple[str, ...]) -> list[Problem]:
    """cattrs' tree of exceptions → one located problem per leaf, one per unknown key."""
    if isinstance(exc, (ClassValidationError, IterableValidationError)):
        with_notes, without = exc.group_exceptions()
        problems = []
        for inner, note in with_notes:
            step = f".{note.name}" if isinstance(note, AttributeValidationNote) else f"[{note.index!r}]"
            problems += _located(inner, where + step, cls, also_known)
        for inner in without:
            problems += _located(inner, where, cls, also_known)
        return problems
    if isinstance(exc, ForbiddenExtraKeysError):
        known = [f.name for f in attrs.fields(exc.cl)] + (list(also_known) if exc.cl is cls else [])
        refused = getattr(exc.cl, "refused_keys", {})  # `rlkit_core.config`: keys it does not take, with what to write
        problems = []
        for key in sorted(exc.extra_fields):
            if key in refused:
                problems.append(Problem(f"{where}.{key}", refused[key]))
                continue
            hint = difflib.get_close_matches(key, known, n=1)
            suggestion = f"did you mean {hint[0]!r}?" if hint else f"known keys: {', '.join(known)}" if known else "it takes no settings"
            problems.append(Problem(f"{where}.{key}", f"unknown key; {suggestion}"))
        return problems
    if isinstance(exc, KeyError):
        return [Problem(where, "required key is missing")]
    return [Problem(where, str(exc))]


def _nested_tables(data: dict, cls: type, where: str, registry: Registry | None) -> tuple[dict, list[Problem], set[str]]:
    """`data` with each nested-component setting's tables replaced by `ComponentChoice`s, the
    problems, and the settings with a broken table (None in `data`: the problems say why)."""
    data, problems, broken = dict(data), [], set()
    table = where.removeprefix("$.")
    for field in attrs.fields(cls):
        spec = nested_spec(field)
        if spec is None or (field.name not in data and not spec.default_type):
            continue
        if registry is None:
            raise ValueError(f"{cls.__name__}.{field.name} holds component tables: structure it with the registry")
        value, here = data.get(field.name, {"type": spec.default_type}), f"{table}.{field.name}"
        if not spec.many and spec.default_type and isinstance(value, str):  # a type alone: its default settings
            choice, found = read_component_table({"type": value}, spec.kind, here, registry, extra=spec.extra)
            found = [Problem(f"$.{here}", p.message) if p.where == f"$.{here}.type" else p for p in found]
        elif not spec.many:
            choice, found = read_component_table(value, spec.kind, here, registry, extra=spec.extra)
        elif not isinstance(value, list):
            choice, found = None, [Problem(f"$.{here}", f"expected a list of {spec.kind} tables ([[{here}]] in TOML), got {value!r}")]
        else:
            pairs = [read_component_table(item, spec.kind, f"{here}[{i}]", registry, extra=spec.extra) for i, item in enumerate(value)]
            choice, found = [choice for choice, _ in pairs], [problem for _, item_problems in pairs for problem in item_problems]
        problems += found
        data[field.name] = None if found else choice
        if found:
            broken.add(field.name)
    return data, problems, broken


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


def retype_problems(before: dict, after: dict, registry: Registry) -> list[Problem]:
    """`--set kl.type=fixed` keeps the old type's other keys, which the new type may not take: say
    which keys belong to the old type and give the `--set` that replaces the table whole."""
    problems = []
    for table, (kind, default_type) in COMPONENT_TABLES.items():
        old_table, new_table = before.get(table), after.get(table)
        if not (isinstance(old_table, dict) and isinstance(new_table, dict)):
            continue
        old, new = old_table.get("type", default_type), new_table.get("type", default_type)
        component = registry.find(kind, new) if isinstance(new, str) else None
        if old == new or component is None:
            continue
        known = {f.name for f in attrs.fields(component.config_class)}
        stale = [key for key in new_table if key != "type" and key not in known and key in old_table]
        if stale:
            kept = ", ".join([f"type={toml_literal(new)}"] + [f"{key}={toml_literal(value)}"
                                                              for key, value in new_table.items() if key in known])
            problems.append(Problem(f"$.{table}", f"the type changed from {old!r} to {new!r}, but {', '.join(stale)} "
                                                  f"{'is a setting' if len(stale) == 1 else 'are settings'} of {old!r} that {new!r} does not "
                                                  f"have; replace the whole table instead: --set '{table}={{{kept}}}'"))
    return problems


def toml_literal(value) -> str:
    """A TOML literal for a recipe value (a string, number, boolean, list or table): JSON's
    spelling of a string, number or boolean is TOML's too."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}={toml_literal(item)}" for key, item in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(toml_literal(item) for item in value) + "]"
    return json.dumps(value)


def parse_recipe(document: dict, registry: Registry, source: str | None = None, launch: Launch = ONE_PROCESS) -> Recipe:
    """The checked recipe for `launch` (default: one process, no GPU), or a RecipeError with every problem located."""
    problems: list[Problem | str] = []
    known_tables = [*CORE_TABLES, *COMPONENT_TABLES]
    for table in document:
        if table not in known_tables:
            hint = difflib.get_close_matches(table, known_tables, n=1)
            suggestion = f"did you mean [{hint[0]}]?" if hint else f"known tables: {', '.join(known_tables)}"
            problems.append(Problem(f"$.{table}", f"unknown table; {suggestion}"))

    core: dict[str, Any] = {}  # each table's instance, or None when it has problems
    for table, cls in CORE_TABLES.items():
        core[table], found = structure_table(document.get(table, {}), cls, f"$.{table}")
        problems += found
    run, ppo, optim = core["run"], core["ppo"], core["optim"]  # each checked below; a Recipe needs all three
    if core["ppo"] is not None:
        problems += batch_arithmetic_problems(core["ppo"], launch.processes) + kl_problems(core["ppo"])
    if core["optim"] is not None:
        problems += schedule_problems(core["optim"])

    components, nothing = {}, set()  # `nothing`: the optional tables whose type is "none"
    for table, (kind, default_type) in COMPONENT_TABLES.items():
        data = document.get(table)
        if table == "value_head" and data is None:
            default_type = _default_critic(document, registry)
        if table == "reward" and data is None and _has_environment(document):
            default_type = NO_COMPONENT  # the environment's rewards alone
        if KIND_OF_TABLE[table].optional and (data.get("type") if isinstance(data, dict) else default_type) == NO_COMPONENT:
            nothing.add(table)
            problems += [Problem(f"$.{table}.{key}", f"unknown key; type = {NO_COMPONENT!r} builds no {kind}, so it takes no settings")
                         for key in (data or {}) if key != "type"]
            continue
        if data is None and default_type is None:
            names = ", ".join(registry.names(kind)) or "(none registered)"
            problems.append(Problem(f"$.{table}", f"this table is required; add [{table}] with type = one of {names}"))
            continue
        components[table], found = read_component_table({"type": default_type} if data is None else data, kind, table,
                                                        registry, default_type)
        problems += found

    if "reward" in nothing and not _has_environment(document):
        problems.append(Problem("$.reward.type", f"{NO_COMPONENT!r} scores nothing in a recipe without an [environment] (whose "
                                                 "rewards would train); name a reward"))
    if core["ppo"] is not None and components.get("advantage") is not None and ("value_head" in components or "value_head" in nothing):
        problems += critic_problems(core["ppo"], components["advantage"], components.get("value_head"))
    if core["run"] is not None and components.get("policy") is not None:
        problems += launch_problems(core["run"], components["policy"].config, launch)
        if components.get("generator") is not None:
            problems += sharding_problems(components["policy"].config, components["generator"], launch)
    if core["ppo"] is not None and components.get("generator") is not None:
        problems += overlong_problems(core["ppo"], components["generator"])
    if core["ppo"] is not None and components.get("loss") is not None:
        problems += kl_penalty_problems(core["ppo"], components["loss"])
    if core["ppo"] is not None and components.get("policy") is not None and ("value_head" in components or "value_head" in nothing):
        problems += packing_problems(core["ppo"], components["policy"], components.get("value_head"))
    problems += scheduler_problems(core["scheduler"], core["ppo"] or PPOConfig(), components, launch.sharded)
    eval_metrics, found = _eval_metrics(core["eval"], registry)
    problems += found
    if problems:
        raise RecipeError(problems, source)
    return Recipe(run, ppo, optim, components, document, source, core["eval"], eval_metrics,
                  registry, core["health"], core["scheduler"])


def _has_environment(document: dict) -> bool:
    """Whether the recipe names an environment (a multi-turn recipe)."""
    table = document.get("environment")
    return isinstance(table, dict) and table.get("type", NO_COMPONENT) != NO_COMPONENT


def _default_critic(document: dict, registry: Registry) -> str | None:
    """The value head of a recipe without [value_head]: a critic only when the advantage estimator needs values."""
    advantage = document.get("advantage")
    default = COMPONENT_TABLES["advantage"][1]
    name = advantage.get("type", default) if isinstance(advantage, dict) else default
    estimator = registry.find("advantage_estimator", name) if isinstance(name, str) else None
    return NO_COMPONENT if estimator is not None and not estimator.factory.needs_values else COMPONENT_TABLES["value_head"][1]


def _eval_metrics(config: EvalConfig | None, registry: Registry) -> tuple[tuple[Component, ...], list[Problem | str]]:
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


def read_component_table(data: Any, kind: str, table: str, registry: Registry, default_type: str | None = None,
                         extra: type | None = None) -> tuple[ComponentChoice | None, list[Problem]]:
    """A component table (`type` and the component's settings, plus the `extra` class's keys for a
    nested table) → its ComponentChoice, or the problems located under `$.{table}`."""
    where = f"$.{table}"
    if not isinstance(data, dict):
        return None, [Problem(where, f"expected a table, got {data!r}")]
    options = dict(data)
    name = options.pop("type", default_type)
    if name is None:
        return None, [Problem(f"{where}.type", f"required; one of {', '.join(registry.names(kind)) or '(none registered)'}")]
    if not isinstance(name, str):
        return None, [Problem(f"{where}.type", f"expected a string, got {name!r}")]
    component = registry.find(kind, name)
    if component is None:
        return None, [registry.unknown_problem(kind, name, f"{where}.type", offer_none=extra is None)]
    extra_values, problems, extra_keys = None, [], ()
    if extra is not None:
        extra_keys = tuple(f.name for f in attrs.fields(extra))
        shared = sorted(set(extra_keys) & {f.name for f in attrs.fields(component.config_class)})
        if shared:
            return None, [Problem(where, f"{kind} {name!r} has settings named {', '.join(shared)}, which this table "
                                         "also reads for the component it sits in; the two cannot be told apart here")]
        extra_values, found = structure_table({k: options.pop(k) for k in extra_keys if k in options}, extra, where)
        problems += found
    config, found = structure_table(options, component.config_class, where, registry, also_known=extra_keys)
    problems += found
    return (None if problems else ComponentChoice(table, component, config, extra_values)), problems


def load_recipe(path: str | Path, registry: Registry, overrides: Sequence[str] = (), launch: Launch = ONE_PROCESS) -> Recipe:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError([f"no recipe at {path}; check the path (recipes ship in the repository's recipes/ folder)"]) from None
    except OSError as exc:
        raise RecipeError([f"cannot read {path}: {exc.strerror}; give the path of a TOML recipe file"]) from None
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError([f"not valid TOML: {exc}"], str(path)) from None
    overridden = apply_overrides(document, list(overrides))
    problems = retype_problems(document, overridden, registry)
    if problems:
        raise RecipeError(problems, str(path))
    recipe = parse_recipe(overridden, registry, str(path), launch)
    if not recipe.run.name:
        recipe = attrs.evolve(recipe, run=attrs.evolve(recipe.run, name=path.stem))
    return recipe
