"""The layout is the architecture: imports run one way, runtime → recipe → plugin API, and plugins
import only the API. An import under `if TYPE_CHECKING:` runs for type checkers only and is allowed."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "rlkit_core"

# layer -> the layers its modules may import
ALLOWED = {
    "api": {"api"},
    "recipe": {"api", "recipe"},
    "runtime": {"api", "recipe", "runtime"},
    "testing": {"api", "recipe", "testing"},
    "plugins": {"api", "plugins"},
}


def layer_of_module(name: str) -> str | None:
    """The layer of a dotted module name, or None for a module outside the project."""
    parts = name.split(".")
    if parts[0] == "rlkit_plugins":
        return "plugins"
    if parts[0] != "rlkit_core":
        return None
    if len(parts) > 1 and parts[1] in {"recipe", "runtime", "testing"}:
        return parts[1]
    return "api"


def layer_of_file(path: Path) -> str:
    if path.is_relative_to(ROOT / "plugins"):
        return "plugins"
    inside = path.relative_to(CORE).parts
    return inside[0] if len(inside) > 1 else "api"


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported_modules(tree: ast.AST):
    """Every module a file imports when it runs (lazy imports in functions included)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _type_checking_only(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            yield from ((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, node.lineno
            if node.module == "rlkit_core":  # `from rlkit_core import checkpoint` may name a module
                yield from ((f"rlkit_core.{alias.name}", node.lineno) for alias in node.names
                            if (CORE / alias.name).is_dir())
        stack.extend(ast.iter_child_nodes(node))


SOURCES = sorted([*CORE.rglob("*.py"), *(ROOT / "plugins").glob("*.py")])


def test_every_source_file_belongs_to_a_layer():
    assert {layer_of_file(path) for path in SOURCES} == set(ALLOWED)


def wrong_way(layer: str, source: str) -> list[str]:
    return sorted(f"line {line}: {module} ({layer_of_module(module)})"
                  for module, line in imported_modules(ast.parse(source))
                  if layer_of_module(module) not in (None, *ALLOWED[layer]))


@pytest.mark.parametrize("path", SOURCES, ids=lambda path: str(path.relative_to(ROOT)))
def test_imports_run_one_way(path):
    layer = layer_of_file(path)
    wrong = wrong_way(layer, path.read_text())
    assert not wrong, f"{path.relative_to(ROOT)} is in the {layer} layer, which may import {sorted(ALLOWED[layer])}: {wrong}"


def test_the_checker_sees_a_wrong_way_import():
    source = ("import typing\nif typing.TYPE_CHECKING:\n    import rlkit_core.runtime.trainer\n"
              "def later():\n    from rlkit_core.recipe.plan import build_plan\nfrom rlkit_core import runtime\n")
    assert wrong_way("api", source) == ["line 5: rlkit_core.recipe.plan (recipe)", "line 6: rlkit_core.runtime (runtime)"]
    assert wrong_way("runtime", source) == []
