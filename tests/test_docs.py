"""The documentation site's recipes reference, generated from the code: a row for every setting."""

import importlib.util
from pathlib import Path

import attrs

HOOK = Path(__file__).resolve().parent.parent / "docs" / "hooks" / "reference.py"


def load_hook():
    spec = importlib.util.spec_from_file_location("docs_reference_hook", HOOK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sections(markdown: str) -> dict[tuple[str, str], str]:
    """The page cut at its headings: (`##` heading's table, `###` heading) -> the text under it."""
    cut = {}
    for block in ("\n" + markdown).split("\n## ")[1:]:
        title, _, body = block.partition("\n")
        table = title.split("`")[1] if "`" in title else title
        for part in body.split("\n### ")[1:]:
            heading, _, text = part.partition("\n")
            cut[(table, heading)] = text
    return cut


def test_every_core_and_builtin_setting_has_a_row():
    from rlkit_core.interfaces import FUNCTION_KINDS, KIND_TABLE, NESTED_KINDS
    from rlkit_core.recipe.plugins import BUILTIN_DISTRIBUTION, load_registry

    hook = load_hook()
    page = sections(hook.reference_markdown())
    expected = {("Core tables", f"`[{table}]`"): cls for table, cls in hook.core_tables().items()}
    table_of = {kind.name: f"[{kind.table}]" for kind in (*KIND_TABLE, *FUNCTION_KINDS, *NESTED_KINDS)}
    expected |= {(table_of[c.kind], f'`type = "{c.name}"`'): c.config_class
                 for c in load_registry().all() if c.distribution == BUILTIN_DISTRIBUTION}
    assert set(expected) <= set(page), set(expected) - set(page)
    for place, cls in expected.items():
        for field in attrs.fields(cls):
            assert f"| `{field.name}` |" in page[place], f"{place}: no row for {field.name}"
    assert {f"`[{t}]`" for t in ("run", "ppo", "optim", "eval", "health")} <= {h for _, h in expected}


def test_the_placeholder_is_replaced_only_where_it_stands():
    hook = load_hook()
    assert hook.on_page_markdown("# A page\n", page=None) == "# A page\n"
    rendered = hook.on_page_markdown(f"# Reference\n\n{hook.PLACEHOLDER}\n", page=None)
    assert hook.PLACEHOLDER not in rendered and "### `[ppo]`" in rendered


def test_a_pipe_in_a_help_text_stays_in_its_cell():
    hook = load_hook()
    table = hook.settings_table([{"name": "x", "type": "str", "default": "a|b", "required": False, "help": "one | two"}])
    assert table.splitlines()[-1] == "| `x` | `str` | `'a|b'` | one \\| two |"
