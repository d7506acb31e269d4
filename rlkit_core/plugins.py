"""Finding plugins: one pluggy manager over the `rlkit` entry-point group.

Built-ins and third-party plugins are found the same way. A plugin that fails to import, uses a
hook name rlkit does not define, or raises while registering is recorded as broken with its error;
the others still load, so `rlkit plugins` keeps working and a recipe that needs the broken one
fails with that error.

`RLKIT_PLUGINS` limits which third-party plugins load: unset loads all; an empty value or `none`
loads only the built-ins; otherwise a comma-separated list of plugin (entry-point) names.
"""

from __future__ import annotations

import difflib
import os
from importlib.metadata import entry_points

import pluggy

from rlkit_core import hookspecs
from rlkit_core.errors import PluginError
from rlkit_core.registry import Component, Registry

ENTRY_POINT_GROUP = "rlkit"
BUILTIN_DISTRIBUTION = "rlkit"
HOOKS = {
    "register_policies": "policy",
    "register_value_heads": "value_head",
    "register_rewards": "reward",
    "register_kl_controllers": "kl_controller",
    "register_advantage_estimators": "advantage_estimator",
    "register_losses": "loss",
    "register_generators": "generator",
    "register_prompt_sources": "prompt_source",
    "register_trackers": "tracker",
}


def _allowed_third_party(environ) -> set[str] | None:
    """None means every third-party plugin is allowed."""
    raw = environ.get("RLKIT_PLUGINS")
    if raw is None:
        return None
    names = {n.strip() for n in raw.split(",") if n.strip()}
    return set() if names == {"none"} else names


def _misspelled_hooks(plugin) -> list[str]:
    """Hook implementations whose names rlkit does not define."""
    wrong = []
    for attr in dir(plugin):
        function = getattr(plugin, attr, None)
        if callable(function) and hasattr(function, f"{hookspecs.PROJECT}_impl") and attr not in HOOKS:
            close = difflib.get_close_matches(attr, HOOKS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; rlkit's hooks are {', '.join(HOOKS)}"
            wrong.append(f"hook {attr!r} is not an rlkit hook{hint}")
    return wrong


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
            continue
        try:
            module = ep.load()
        except Exception as exc:  # a broken plugin must not take the others down
            registry.broken[ep.name] = f"import failed: {type(exc).__name__}: {exc}"
            continue
        candidates.append((ep.name, module, dist, version))
    candidates.extend(extra_plugins)

    seen: dict[str, str] = {}
    for name, module, dist, version in candidates:
        if name in seen:
            raise PluginError(f"two plugins are named {name!r}: one from {seen[name]}, one from {dist} {version}; "
                              "plugin (entry-point) names must be unique: rename one, or uninstall it")
        seen[name] = f"{dist} {version}"
        _register_plugin(manager, registry, name, module, dist, version)
    return registry


def _register_plugin(manager, registry, name, module, dist, version) -> None:
    wrong = _misspelled_hooks(module)
    if wrong:
        registry.broken[name] = "; ".join(wrong)
        return
    try:
        manager.register(module, name=name)
    except ValueError:  # pluggy refuses a module registered twice (two entry points naming it)
        registry.broken[name] = f"module {module.__name__} is already registered by another plugin entry point"
        return
    for hook_name, kind in HOOKS.items():
        implementation = getattr(module, hook_name, None)
        if implementation is None:
            continue

        def register(component_name, factory, config_class, _kind=kind):
            registry.add(Component(_kind, component_name, factory, config_class, name, dist, version))

        try:
            implementation(register=register)
        except PluginError:
            raise  # a duplicate name is a conflict between plugins: loud, never skipped
        except Exception as exc:
            registry.broken[name] = f"{hook_name} failed: {type(exc).__name__}: {exc}"
