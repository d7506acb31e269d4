"""What a run was made of: the components it used (with their distributions and versions) and
the recipe flattened to `table.key` parameters, for the tracker and `rlkit check`."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any

import attrs

from rlkit_core import __version__
from rlkit_core.config import fields_help, nested_spec
from rlkit_core.interfaces import FUNCTION_KINDS, KIND_TABLE, KINDS, NESTED_KINDS, NO_COMPONENT, Kind
from rlkit_core.recipe.document import ComponentChoice, Recipe
from rlkit_core.recipe.plugins import BUILTIN_DISTRIBUTION
from rlkit_core.recipe.registry import Registry
from rlkit_core.recipe.schema import CORE_TABLES


def inventory_rows(recipe: Recipe) -> list[dict[str, str]]:
    """One row per component table, nested ones after the table that holds them; their place reads
    `reward.parts.1` (dots only, as tracker tag names allow). An optional table that builds
    nothing (`type = "none"`) is a row of rlkit's own."""
    rows = []
    for kind in KIND_TABLE:
        if kind.table not in recipe.components:
            rows += [{"table": kind.table, "kind": kind.name, **_nothing_row(kind)}] if kind.optional else []
            continue
        rows += [{"table": c.table.replace("[", ".").replace("]", ""), "kind": c.component.kind, "type": c.component.name,
                  "plugin": c.component.plugin, "distribution": c.component.distribution, "version": c.component.version}
                 for c in with_nested(recipe.components[kind.table])]
    return rows


def _nothing_row(kind: Kind) -> dict[str, str]:
    """`type = "none"` of an optional kind, which no plugin registers: rlkit builds nothing."""
    plugin = f"core: builds no {kind.name}" + (f"; {kind.without}" if kind.without else "")
    return {"type": NO_COMPONENT, "plugin": plugin, "distribution": BUILTIN_DISTRIBUTION, "version": __version__}


def with_nested(choice: ComponentChoice) -> Iterator[ComponentChoice]:
    """The choice, then every component table nested in it, depth first."""
    yield choice
    for field in attrs.fields(type(choice.config)):
        if nested_spec(field):
            value = getattr(choice.config, field.name)
            for inner in value if isinstance(value, list) else [value]:
                if inner is not None:
                    yield from with_nested(inner)


def component_choices(recipe: Recipe) -> Iterator[ComponentChoice]:
    """Every component table of the recipe, nested ones included, whose factory is a component
    class with the hooks of `rlkit_core.ComponentBase` (a function kind's table, such as
    `[loss.surrogate]`, has none)."""
    for top in recipe.components.values():
        yield from (choice for choice in with_nested(top) if choice.component.kind in KINDS)


def field_rows(config_class) -> list[dict[str, Any]]:
    return [{"name": n, "type": t, "default": d, "required": r, "help": h} for n, t, d, r, h in fields_help(config_class)]


def core_table_rows() -> list[dict[str, Any]]:
    """The core tables (`[run]`, `[ppo]`, ...) with their fields, for `rlkit plugins`."""
    return [{"table": table, "fields": field_rows(cls)} for table, cls in CORE_TABLES.items()]


def missing_requirements(factory) -> list[str]:
    """What to pip install for the modules a component requires (`ComponentBase.requires`) that are not installed."""
    requires = getattr(factory, "requires", None)
    if not isinstance(requires, dict):
        return []
    return sorted({install for module, install in requires.items() if importlib.util.find_spec(module) is None})


def registry_rows(registry: Registry) -> list[dict[str, Any]]:
    """Every registered component (and function: surrogates; and nested class: tool-call formats,
    the core's `auto` among them) with its config fields, for `rlkit plugins`, and the `none` of each optional kind."""
    rows = []
    for kind in (*KIND_TABLE, *FUNCTION_KINDS, *NESTED_KINDS):
        found = [{"kind": c.kind, "name": c.name, "plugin": c.plugin, "distribution": c.distribution, "version": c.version,
                  "needs": missing_requirements(c.factory), "fields": field_rows(c.config_class)} for c in registry.all() if c.kind == kind.name]
        nothing = {"kind": kind.name, "name": NO_COMPONENT, **{k: v for k, v in _nothing_row(kind).items() if k != "type"}, "fields": []}
        rows += sorted([*found, nothing] if kind.optional else found, key=lambda row: row["name"])
    return rows


def flatten(document: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in document.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat
