"""The layout is the architecture: imports run one way, runtime → recipe → plugin API, and plugins
import only the API: `rlkit_core` itself and its declared helper modules, never another plugin. The
modules of plugins/ that no entry point names are helpers the plugins share, which import no module
of plugins/, so no import among the built-ins circles back. An import under `if TYPE_CHECKING:` runs
for type checkers only and is allowed."""

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "rlkit_core"

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# the modules of `rlkit_core` a plugin may import besides `rlkit_core` itself (its docstring says so)
HELPER_MODULES = ("rlkit_core.functional", "rlkit_core.hf", "rlkit_core.testing")
# the built-in plugins, each an entry point of the `rlkit` group, and the helper modules they share (the rest of plugins/)
PLUGINS = {module.removeprefix("rlkit_plugins.") for module in
           tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["rlkit"].values()}
HELPERS = {path.stem for path in (ROOT / "plugins").glob("*.py")} - PLUGINS - {"__init__"}
EXAMPLE_PACKAGE = ROOT / "examples" / "rlkit-example-plugins" / "src" / "rlkit_example_plugins"

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
        elif isinstance(node, ast.ImportFrom) and node.level == 1:  # within the plugins' package
            yield from ((f"rlkit_plugins.{name}", node.lineno) for name in
                        ([node.module] if node.module else [alias.name for alias in node.names]))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, node.lineno
            if node.module == "rlkit_core":  # `from rlkit_core import checkpoint` may name a module
                yield from ((f"rlkit_core.{alias.name}", node.lineno) for alias in node.names
                            if (CORE / alias.name).is_dir() or (CORE / f"{alias.name}.py").is_file())
            if node.module == "rlkit_plugins":  # `from rlkit_plugins import summarize_task` names one
                yield from ((f"rlkit_plugins.{alias.name}", node.lineno) for alias in node.names)
        stack.extend(ast.iter_child_nodes(node))


SOURCES = sorted([*CORE.rglob("*.py"), *(ROOT / "plugins").glob("*.py")])


def test_every_source_file_belongs_to_a_layer():
    assert {layer_of_file(path) for path in SOURCES} == set(ALLOWED)


def test_the_runtime_is_type_checked_in_standard_mode():
    """pyright checks the project in basic mode (pyproject.toml) and the runtime in standard mode,
    which its modules ask for on their first line (pyright sets the mode per file), a new one too."""
    basic = [path.name for path in sorted((CORE / "runtime").glob("*.py")) if path.read_text().split("\n", 1)[0] != "# pyright: standard"]
    assert basic == [], "start these modules with the line `# pyright: standard`"


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


def plugin_problems(source: str, plugin: str | None) -> list[str]:
    """The imports of the module `plugin` of plugins/ that reach past the API: a module of
    `rlkit_core` other than the package and its helper modules, or another plugin (a helper module:
    any module of plugins/; `plugin` None, a package of its own: any module of plugins/)."""
    problems = []
    for module, line in imported_modules(ast.parse(source)):
        top, _, rest = module.partition(".")
        if top == "rlkit_core" and module != "rlkit_core" and not module.startswith(tuple(f"{h}." for h in HELPER_MODULES) + HELPER_MODULES):
            problems.append((line, f"line {line}: {module} (import it from rlkit_core, or use a helper module: {', '.join(HELPER_MODULES)})"))
        elif top == "rlkit_plugins" and rest and plugin in HELPERS:
            problems.append((line, f"line {line}: {module} (a helper module imports no module of plugins/)"))
        elif top == "rlkit_plugins" and rest and (plugin is None or rest.split(".")[0] not in HELPERS | {plugin}):
            problems.append((line, f"line {line}: {module} (another plugin's)"))
    return [problem for _, problem in sorted(problems)]


def test_every_entry_point_is_a_module_of_plugins():
    assert PLUGINS <= {path.stem for path in (ROOT / "plugins").glob("*.py")} and HELPERS


@pytest.mark.parametrize("path", sorted((ROOT / "plugins").glob("*.py")), ids=lambda path: path.name)
def test_plugins_import_only_the_api_and_the_helper_modules(path):
    wrong = plugin_problems(path.read_text(), path.stem)
    assert not wrong, f"plugins/{path.name}: {wrong}"


@pytest.mark.parametrize("path", sorted(EXAMPLE_PACKAGE.glob("*.py")), ids=lambda path: path.name)
def test_the_example_plugins_import_only_the_api(path):
    wrong = plugin_problems(path.read_text(), None)
    assert not wrong, f"{path.relative_to(ROOT)}: {wrong}"


def test_the_plugin_checker_sees_what_reaches_past_the_api():
    source = ("from rlkit_core import Policy, hookimpl\nfrom rlkit_core.functional import gae\nfrom rlkit_core.hf import DTYPES\n"
              "from rlkit_core.randomness import sampling_seed\nfrom rlkit_core import prompts\n"
              "from . import summarize_task\nfrom .hf_policy import HFPolicy\n")
    assert plugin_problems(source, "summarize") == [
        "line 4: rlkit_core.randomness (import it from rlkit_core, or use a helper module: rlkit_core.functional, rlkit_core.hf, rlkit_core.testing)",
        "line 5: rlkit_core.prompts (import it from rlkit_core, or use a helper module: rlkit_core.functional, rlkit_core.hf, rlkit_core.testing)",
        "line 7: rlkit_plugins.hf_policy (another plugin's)"]
    assert plugin_problems(source, "warm_start")[-2:] == ["line 6: rlkit_plugins.summarize_task (a helper module imports no module of plugins/)",
                                                          "line 7: rlkit_plugins.hf_policy (a helper module imports no module of plugins/)"]
