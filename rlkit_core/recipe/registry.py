"""The collection of registered components, and its rules.

A component is known by (kind, name). The registry remembers which plugin, distribution and version
supplied each one, so that a run can be traced to the code that produced it, and it refuses a
second component under a taken name instead of silently shadowing the first.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable

import attrs

from rlkit_core.errors import BrokenPluginContract, PluginError, Problem, RecipeError
from rlkit_core.interfaces import KINDS


@attrs.frozen
class Component:
    kind: str
    name: str
    factory: Callable
    config_class: type
    plugin: str  # entry-point name of the plugin that registered it
    distribution: str
    version: str


class Registry:
    def __init__(self):
        self._components: dict[str, dict[str, Component]] = {kind: {} for kind in KINDS}
        self.broken: dict[str, str] = {}  # plugin name -> why it could not be loaded
        self.filtered: dict[str, str] = {}  # plugin name -> "distribution version", installed but left out by RLKIT_PLUGINS

    def add(self, component: Component) -> None:
        if not attrs.has(component.config_class):
            raise BrokenPluginContract(
                f"plugin {component.plugin!r} registers {component.kind} {component.name!r} with config class "
                f"{component.config_class!r}, which is not an attrs class; decorate it with @attrs.frozen"
            )
        taken = self._components[component.kind].get(component.name)
        if taken is not None:
            raise PluginError(
                f"duplicate {component.kind} {component.name!r}: registered by plugin {taken.plugin!r} "
                f"({taken.distribution} {taken.version}) and by plugin {component.plugin!r} "
                f"({component.distribution} {component.version}); uninstall one of them, or rename the component"
            )
        self._components[component.kind][component.name] = component

    def discard_plugin(self, plugin: str) -> None:
        """Forget what a plugin registered before it turned out broken: none of it is offered."""
        for components in self._components.values():
            for name in [n for n, c in components.items() if c.plugin == plugin]:
                del components[name]

    def names(self, kind: str) -> list[str]:
        return sorted(self._components[kind])

    def all(self) -> list[Component]:
        return [c for kind in KINDS for c in sorted(self._components[kind].values(), key=lambda c: c.name)]

    def find(self, kind: str, name: str) -> Component | None:
        return self._components[kind].get(name)

    def get(self, kind: str, name: str, where: str) -> Component:
        """The component, or a located RecipeError naming the registered names and the closest match."""
        component = self.find(kind, name)
        if component is None:
            raise RecipeError([self.unknown_problem(kind, name, where)])
        return component

    def unknown_problem(self, kind: str, name: str, where: str) -> Problem:
        known = self.names(kind)
        message = f"unknown {kind} {name!r}; registered: {', '.join(known) or '(none)'}"
        close = difflib.get_close_matches(name, known, n=1)
        if close:
            message += f"; did you mean {close[0]!r}?"
        if self.broken:
            message += "; plugins that failed to load: " + "; ".join(f"{p} ({why})" for p, why in self.broken.items())
        if self.filtered:
            plugins = ", ".join(f"{p} ({dist})" for p, dist in self.filtered.items())
            message += (f"; installed but filtered out by RLKIT_PLUGINS: {plugins}; if {name!r} comes from one of them, "
                        "add its name to RLKIT_PLUGINS (or unset RLKIT_PLUGINS to load every installed plugin)")
        return Problem(where, message)
