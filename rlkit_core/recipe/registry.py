"""The collection of registered components, and its rules.

A component is known by (kind, name). The registry remembers which plugin, distribution and version
supplied each one, so that a run can be traced to the code that produced it, and it refuses a
second component under a taken name instead of silently shadowing the first. A function kind's
functions (`rlkit_core.interfaces.FUNCTION_KINDS`: surrogates) and a nested class kind's classes
(`NESTED_KINDS`: tool-call and chat formats) are held and checked the same way. The components the
core answers for itself, the tool-call format `auto` and the chat formats `auto`, `template` and
`plain`, are in every registry from the start.
"""

from __future__ import annotations

import difflib
import inspect

import attrs

from rlkit_core import __version__
from rlkit_core.chat_format import KIND as CHAT_KIND
from rlkit_core.chat_format import ChatFormat, CoreChatSettings, PlainFormat, TemplateFormat
from rlkit_core.errors import BrokenPluginContract, PluginError, Problem, RecipeError
from rlkit_core.interfaces import COMPONENT_HOOKS, FUNCTION_KINDS, KIND_TABLE, KINDS, NESTED_KINDS, NO_COMPONENT, Kind, Policy, class_flags
from rlkit_core.records import Component
from rlkit_core.tool_call_formats import AUTO, KIND, AutoSettings, ToolCallFormat

_KIND_NAMED = {kind.name: kind for kind in (*KIND_TABLE, *FUNCTION_KINDS, *NESTED_KINDS)}
# the core's own: `tool_call_format = "auto"`, the format the chat template writes (`rlkit_core.tool_call_formats.chosen_format`)
CORE_PLUGIN = "core: the format the chat template writes"
AUTO_FORMAT = Component(KIND, AUTO, ToolCallFormat, AutoSettings, CORE_PLUGIN, "rlkit", __version__)
CORE_CHAT_FORMATS = {name: Component(CHAT_KIND, name, factory, CoreChatSettings, f"core: {why}", "rlkit", __version__)
                     for name, factory, why in (("auto", ChatFormat, "the template when the tokenizer has one, else plain"),
                                                ("template", TemplateFormat, "the tokenizer's chat template"),
                                                ("plain", PlainFormat, "text lines"))}


class Registry:
    def __init__(self):
        self._components: dict[str, dict[str, Component]] = {kind: {} for kind in _KIND_NAMED}
        self._components[KIND][AUTO] = AUTO_FORMAT
        self._components[CHAT_KIND].update(CORE_CHAT_FORMATS)
        self.broken: dict[str, str] = {}  # plugin name -> why it could not be loaded
        self.filtered: dict[str, str] = {}  # plugin name -> "distribution version", installed but left out by RLKIT_PLUGINS

    def add(self, component: Component) -> None:
        """Record a component; a duplicate name is a PluginError, a component that breaks the contract
        (`contract_problems`) a BrokenPluginContract naming every way it does."""
        taken = self._components[component.kind].get(component.name)
        if taken is not None:
            raise PluginError(
                f"duplicate {component.kind} {component.name!r}: registered by plugin {taken.plugin!r} "
                f"({taken.distribution} {taken.version}) and by plugin {component.plugin!r} "
                f"({component.distribution} {component.version}); uninstall one of them, or rename the component"
            )
        problems = contract_problems(component.kind, component.factory, component.config_class)
        if component.name == NO_COMPONENT and _KIND_NAMED[component.kind].optional:
            problems.append(f"{component.name!r} is the type that builds no {component.kind}; give the component another name")
        if problems:
            raise BrokenPluginContract(f"plugin {component.plugin!r} registers {component.kind} {component.name!r}, which breaks "
                                       f"the plugin contract: {'; '.join(problems)}")
        self._components[component.kind][component.name] = component

    def discard_plugin(self, plugin: str) -> None:
        """Forget what a plugin registered before it turned out broken: none of it is offered."""
        for components in self._components.values():
            for name in [n for n, c in components.items() if c.plugin == plugin]:
                del components[name]

    def names(self, kind: str) -> list[str]:
        return sorted(self._components[kind])

    def all(self) -> list[Component]:
        return [c for kind in _KIND_NAMED for c in sorted(self._components[kind].values(), key=lambda c: c.name)]

    def find(self, kind: str, name: str) -> Component | None:
        return self._components[kind].get(name)

    def get(self, kind: str, name: str, where: str) -> Component:
        """The component, or a located RecipeError naming the registered names and the closest match."""
        component = self.find(kind, name)
        if component is None:
            raise RecipeError([self.unknown_problem(kind, name, where)])
        return component

    def unknown_problem(self, kind: str, name: str, where: str, offer_none: bool = True) -> Problem:
        """`offer_none`: the place may say `type = "none"` (a recipe's own table, not a nested one)."""
        known = self.names(kind)
        message = f"unknown {kind} {name!r}; registered: {', '.join(known) or '(none)'}"
        if _KIND_NAMED[kind].optional and offer_none:
            message += f"; or {NO_COMPONENT!r} for no {kind}"
            known = [*known, NO_COMPONENT]
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


def contract_problems(kind: str, factory, config_class) -> list[str]:
    """How a component breaks its kind's contract, checked when it registers: its class must derive
    from the interface and declare the optional hooks with the parameters rlkit passes them (as
    static or class methods), the flags its interface declares (`ClassVar[bool]`) must be booleans, and its config must be an attrs class
    (which inherits its kind's settings base: the fields rlkit reads). A function kind's function must take the parameters of its
    kind's signature."""
    if not attrs.has(config_class):
        return [f"config class {config_class!r} is not an attrs class; decorate it with @attrs.frozen"]
    if _KIND_NAMED[kind] in FUNCTION_KINDS:
        return function_problems(_KIND_NAMED[kind], factory)
    if _KIND_NAMED[kind] in NESTED_KINDS:
        return nested_class_problems(_KIND_NAMED[kind], factory)
    interface = KINDS[kind]
    if not (isinstance(factory, type) and issubclass(factory, interface)):
        return [f"its factory {factory!r} is not a class deriving from rlkit_core.{interface.__name__}; "
                f"register a subclass of {interface.__name__} whose __init__ takes (config, context)"]
    problems = []
    settings = next(k.settings for k in KIND_TABLE if k.name == kind)
    if settings is not None and not issubclass(config_class, settings):
        problems.append(f"config class {config_class.__name__} does not inherit rlkit_core.{settings.__name__}, which declares the {kind} "
                        "settings rlkit reads; inherit it")
    hooks = {**COMPONENT_HOOKS, **({"shape": ("config",)} if issubclass(factory, Policy) else {})}
    for hook, parameters in hooks.items():
        if not isinstance(inspect.getattr_static(factory, hook), (staticmethod, classmethod)):
            problems.append(f"{factory.__name__}.{hook} must be a @staticmethod {hook}({', '.join(parameters)}) or a @classmethod")
            continue
        try:
            inspect.signature(getattr(factory, hook)).bind(*parameters)
        except TypeError as exc:
            problems.append(f"{factory.__name__}.{hook} must take ({', '.join(parameters)}): {exc}")
    for flag in class_flags(interface):
        if not isinstance(getattr(factory, flag), bool):
            problems.append(f"{factory.__name__}.{flag} must be True or False, got {getattr(factory, flag)!r}")
    return problems


def function_problems(kind: Kind, function) -> list[str]:
    """How a function registered for a function kind breaks its contract: it must be a function
    (not a class) that takes the parameters of the kind's signature, `kind.interface.__call__`."""
    parameters = list(inspect.signature(kind.interface.__call__).parameters)[1:]  # without `self`
    wanted = f"a function ({', '.join(parameters)}) as rlkit_core.{kind.interface.__name__} says"
    if isinstance(function, type) or not callable(function):
        return [f"{function!r} is not a function; register {wanted}"]
    try:
        inspect.signature(function).bind(*parameters)
    except TypeError as exc:
        return [f"{getattr(function, '__qualname__', function)!r} must take ({', '.join(parameters)}): {exc}"]
    return []


def nested_class_problems(kind: Kind, factory) -> list[str]:
    """How a class registered for a nested class kind breaks its contract: it must derive from the
    kind's interface, implement its abstract methods and (a tool-call format) keep `recognises(template)`
    a static or class method."""
    interface = kind.interface
    if not (isinstance(factory, type) and issubclass(factory, interface)):
        return [f"its factory {factory!r} is not a class deriving from rlkit_core.{interface.__name__}; "
                f"register a subclass of {interface.__name__}" + (" whose __init__ takes (config)" if interface is ToolCallFormat else "")]
    problems = []
    if abstract := sorted(getattr(factory, "__abstractmethods__", ())):
        problems.append(f"{factory.__name__} does not implement {', '.join(abstract)}")
    if hasattr(interface, "recognises") and not isinstance(inspect.getattr_static(factory, "recognises"), (staticmethod, classmethod)):
        problems.append(f"{factory.__name__}.recognises must be a @staticmethod recognises(template) or a @classmethod")
    return problems
