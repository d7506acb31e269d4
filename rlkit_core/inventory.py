"""What a run was made of: the components it used (with their distributions and versions) and
the recipe flattened to `table.key` parameters, for the tracker and `rlkit check`."""

from __future__ import annotations

from typing import Any

from rlkit_core.config import fields_help
from rlkit_core.recipe import Recipe
from rlkit_core.registry import Registry
from rlkit_core.schema import CORE_TABLES


def inventory_rows(recipe: Recipe) -> list[dict[str, str]]:
    return [
        {"table": table, "kind": c.component.kind, "type": c.component.name, "plugin": c.component.plugin,
         "distribution": c.component.distribution, "version": c.component.version}
        for table, c in recipe.components.items()
    ]


def field_rows(config_class) -> list[dict[str, Any]]:
    return [{"name": n, "type": t, "default": d, "required": r, "help": h} for n, t, d, r, h in fields_help(config_class)]


def core_table_rows() -> list[dict[str, Any]]:
    """The core tables `[run]`, `[ppo]`, `[optim]` with their fields, for `rlkit plugins`."""
    return [{"table": table, "fields": field_rows(cls)} for table, cls in CORE_TABLES.items()]


def registry_rows(registry: Registry) -> list[dict[str, Any]]:
    """Every registered component with its config fields, for `rlkit plugins`."""
    return [{"kind": c.kind, "name": c.name, "plugin": c.plugin, "distribution": c.distribution, "version": c.version,
             "fields": field_rows(c.config_class)} for c in registry.all()]


def flatten(document: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in document.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat
