"""mkdocs hook: the recipes reference, rendered from the settings the code declares, so the page
cannot drift from `rlkit plugins`. It goes through the same entry points as `rlkit plugins --json`
(`rlkit_core.recipe.inventory` and the registry loader), never through the modules that define the
tables, so that moving those classes does not break the site."""

from __future__ import annotations

import os
from typing import Any

PLACEHOLDER = "<!-- rlkit-reference -->"


def core_tables() -> dict[str, type]:
    """The core tables' config classes by table name: the one place the hook reaches them."""
    from rlkit_core.recipe import inventory

    return dict(inventory.CORE_TABLES)


def builtin_rows() -> list[dict[str, Any]]:
    """Every built-in component with its settings, as `rlkit plugins --json` lists it; installed
    third-party plugins are left out, so the page does not depend on the machine that builds it."""
    from rlkit_core.recipe.inventory import registry_rows
    from rlkit_core.recipe.plugins import BUILTIN_DISTRIBUTION, load_registry

    return [row for row in registry_rows(load_registry()) if row["distribution"] == BUILTIN_DISTRIBUTION]


def _cell(text: str) -> str:
    """Prose for a table cell, where a pipe would end the cell (inside backticks it would not)."""
    return text.replace("|", "\\|").replace("\n", " ")


def _default(field: dict[str, Any]) -> str:
    if field["required"]:
        return "**required**"
    value = field["default"]
    if isinstance(value, str) and value.startswith(os.path.expanduser("~") + os.sep):
        value = "~" + value[len(os.path.expanduser("~")):]  # the builder's home, not a reader's
    return f"`{value!r}`"


def settings_table(fields: list[dict[str, Any]]) -> str:
    if not fields:
        return "No settings.\n"
    lines = ["| setting | type | default | what it does |", "|---|---|---|---|"]
    lines += [f"| `{f['name']}` | `{f['type']}` | {_default(f)} | {_cell(f['help'])} |" for f in fields]
    return "\n".join(lines) + "\n"


def reference_markdown() -> str:
    """The reference's generated part: the core tables, then every built-in component by kind."""
    from rlkit_core.interfaces import FUNCTION_KINDS, KIND_TABLE, NESTED_KINDS
    from rlkit_core.recipe.inventory import core_table_rows

    out = ["## Core tables\n"]
    for table in core_table_rows():
        out += [f"### `[{table['table']}]`\n", settings_table(table["fields"])]
    rows = builtin_rows()
    for kind in (*KIND_TABLE, *FUNCTION_KINDS, *NESTED_KINDS):
        if kind in FUNCTION_KINDS:  # a table nested in another component's, whose setting says the default
            default = f"a registered function, picked by `type` inside `[{kind.table.partition('.')[0]}]`"
        elif kind in NESTED_KINDS:
            default = f"a registered class, picked inside `[{kind.table.partition('.')[0]}]`; default type `{kind.default}`"
        elif kind.default:
            default = f"default type `{kind.default}`"
        elif kind.optional:  # the reward: `none` beside an environment, whose own rewards then train
            default = "required, or `none` beside an `[environment]`"
        else:
            default = "required"
        words = kind.name.replace("_", " ").replace("kl ", "KL ")
        out.append(f"## `[{kind.table}]`: {words} ({default})\n")
        for row in (r for r in rows if r["kind"] == kind.name):
            out += [f"### `type = \"{row['name']}\"`\n", f"From `{row['plugin']}`.\n", settings_table(row["fields"])]
    return "\n".join(out)


def on_page_markdown(markdown: str, page, **kwargs) -> str:
    if PLACEHOLDER not in markdown:
        return markdown
    return markdown.replace(PLACEHOLDER, reference_markdown())
