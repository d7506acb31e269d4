"""What a run was made of: the components it used (with their distributions and versions) and
the recipe flattened to `table.key` parameters, for the tracker and `rlkit check`."""

from __future__ import annotations

from typing import Any

from rlkit_core.config import fields_help
from rlkit_core.recipe import Recipe
from rlkit_core.registry import Registry


def inventory_rows(recipe: Recipe) -> list[dict[str, str]]:
    return [
        {"table": table, "kind": c.component.kind, "type": c.component.name, "plugin": c.component.plugin,
         "distribution": c.component.distribution, "version": c.component.version}
        for table, c in recipe.components.items()
    ]


def registry_rows(registry: Registry) -> list[dict[str, Any]]:
    """Every registered component with its config fields, for `rlkit plugins`."""
    rows = []
    for c in registry.all():
        fields = [{"name": n, "type": t, "default": d, "required": r, "help": h} for n, t, d, r, h in fields_help(c.config_class)]
        rows.append({"kind": c.kind, "name": c.name, "plugin": c.plugin, "distribution": c.distribution,
                     "version": c.version, "fields": fields})
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
