"""Finding plugins: one pluggy manager over the `rlkit` entry-point group.

Built-ins and third-party plugins are found the same way. pluggy checks each plugin against the
hookspecs; a plugin that fails to import, fails those checks (a hook name rlkit does not define, a
hook argument other than `register`), raises while registering or registers a component that
breaks the contract (`rlkit_core.recipe.registry.contract_problems`: a factory that is not a class of the
kind's interface, a hook with other parameters, a config class that is not attrs) is recorded as
broken with its error, and what it registered is withdrawn; the others still load, so `rlkit plugins` keeps working and a recipe that needs the broken
one fails with that error.

`RLKIT_PLUGINS` limits which third-party plugins load: unset loads all; an empty value or `none`
loads only the built-ins; otherwise a comma-separated list of plugin (entry-point) names.
"""

from __future__ import annotations

import difflib
import os
from importlib.metadata import entry_points

import pluggy

from rlkit_core import hookspecs
from rlkit_core.errors import BrokenPluginContract, PluginError
from rlkit_core.interfaces import FUNCTION_KINDS, KIND_TABLE, NESTED_KINDS
from rlkit_core.recipe.registry import Registry
from rlkit_core.records import Component

ENTRY_POINT_GROUP = "rlkit"
BUILTIN_DISTRIBUTION = "rlkit"
HOOKS = {kind.hook: kind.name for kind in (*KIND_TABLE, *FUNCTION_KINDS, *NESTED_KINDS)}  # hook name -> kind, as `rlkit_core.hookspecs` declares them


def _allowed_third_party(environ) -> set[str] | None:
    """None means every third-party plugin is allowed."""
    raw = environ.get("RLKIT_PLUGINS")
    if raw is None:
        return None
    names = {n.strip() for n in raw.split(",") if n.strip()}
    return set() if names == {"none"} else names


def load_registry(environ=None, extra_plugins=()) -> Registry:
    """Load every allowed plugin into a fresh registry.

    `extra_plugins` are (name, module, distribution, version) tuples registered after the entry
    points, for tests and embedding.
    """
    environ = os.environ if environ is None else environ
    allowed = _allowed_third_party(environ)
    registry = Registry()
    manager = pluggy.PluginManager(hookspecs.PROJECT)
    manager.add_hookspecs(hookspecs)

    candidates = []
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        dist = ep.dist.name if ep.dist else "unknown"
        version = ep.dist.version if ep.dist else "unknown"
        if dist != BUILTIN_DISTRIBUTION and allowed is not None and ep.name not in allowed:
            registry.filtered[ep.name] = f"{dist} {version}"  # installed, left out by RLKIT_PLUGINS: never imported
            continue
        try:
            module = ep.load()
        except Exception as exc:  # a broken plugin must not take the others down
            registry.broken[ep.name] = f"import failed: {type(exc).__name__}: {exc}"
            continue
        candidates.append((ep.name, module, dist, version))
    candidates.extend(extra_plugins)

    sources: dict[str, tuple[str, str]] = {}  # plugin name -> (distribution, version)
    for name, module, dist, version in candidates:
        if name in sources:
            raise PluginError(f"two plugins are named {name!r}: one from {' '.join(sources[name])}, one from {dist} {version}; "
                              "plugin (entry-point) names must be unique: rename one, or uninstall it")
        sources[name] = (dist, version)
        problem = _register_with_pluggy(manager, name, module)
        if problem:
            registry.broken[name] = problem
    _call_hooks(manager, registry, sources)
    return registry


def _register_with_pluggy(manager: pluggy.PluginManager, name: str, module) -> str | None:
    """pluggy's own checks: hook arguments match the hookspecs, no hook rlkit does not define, no
    module registered twice. Why the plugin is broken, or None; a broken plugin stays unregistered."""
    try:
        manager.register(module, name=name)
    except ValueError:  # two entry points naming one module
        return f"module {module.__name__} is already registered by another plugin entry point"
    except pluggy.PluginValidationError as exc:
        return " ".join(str(exc).split())
    try:
        manager.check_pending()
    except pluggy.PluginValidationError:
        unknown = [caller.name for caller in manager.get_hookcallers(module) or [] if not caller.has_spec()]
        manager.unregister(module)
        return "; ".join(f"hook {hook!r} is not an rlkit hook{_closest_hook(hook)}" for hook in unknown)
    return None


def _closest_hook(name: str) -> str:
    close = difflib.get_close_matches(name, HOOKS, n=1)
    return f"; did you mean {close[0]!r}?" if close else f"; rlkit's hooks are {', '.join(HOOKS)}"


def _call_hooks(manager: pluggy.PluginManager, registry: Registry, sources: dict[str, tuple[str, str]]) -> None:
    """Each hook implementation called with a `register` that records its plugin, distribution and
    version (one call of the hook would lose who registered what). A plugin that raises is broken:
    what it registered is withdrawn and it is not called again. A plugin that registers components
    that break the contract is broken with every such component named, from all its hooks. A
    duplicate name is a conflict between two plugins, so it stays loud."""
    contract: dict[str, list[str]] = {}  # plugin -> every way its components break the contract, all named at once
    for hook_name, kind in HOOKS.items():
        for implementation in getattr(manager.hook, hook_name).get_hookimpls():
            plugin = implementation.plugin_name
            if plugin in registry.broken:
                continue
            dist, version = sources[plugin]

            def register(component_name, factory, config_class, _kind=kind, _plugin=plugin, _dist=dist, _version=version):
                try:
                    registry.add(Component(_kind, component_name, factory, config_class, _plugin, _dist, _version))
                except BrokenPluginContract as exc:
                    contract.setdefault(_plugin, []).append(str(exc))

            try:
                implementation.function(**{arg: register for arg in implementation.argnames})  # as pluggy would call it
            except PluginError:
                raise  # a duplicate name is a conflict between plugins: loud, never skipped
            except Exception as exc:
                registry.broken[plugin] = f"{hook_name} failed: {type(exc).__name__}: {exc}"
                registry.discard_plugin(plugin)
    for plugin, reasons in contract.items():
        registry.broken[plugin] = "; ".join(reasons + ([registry.broken[plugin]] if plugin in registry.broken else []))
        registry.discard_plugin(plugin)
