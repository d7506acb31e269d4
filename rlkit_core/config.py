"""Helpers for the frozen attrs classes that describe recipe tables and plugin settings.

Every setting carries a one-line help text (shown by `rlkit plugins` and `rlkit check`), and range
validators phrase their failures so that the recipe loader can prefix them with a location:
`$.kl.target: must be > 0, got -1`.
"""

import attrs

HELP = "help"


def setting(default=attrs.NOTHING, *, help, validator=None, factory=None, kw_only=False):
    """An attrs field with a help text; `factory` for mutable defaults; `kw_only` for settings a
    base class shares with subclasses that have required fields."""
    if factory is not None:
        return attrs.field(factory=factory, validator=validator, metadata={HELP: help}, kw_only=kw_only)
    return attrs.field(default=default, validator=validator, metadata={HELP: help}, kw_only=kw_only)


def _check(predicate, words):
    def validate(instance, attribute, value):
        if not predicate(value):
            raise ValueError(f"must be {words}, got {value!r}")

    return validate


def greater_than(bound):
    return _check(lambda v: v > bound, f"> {bound}")


def at_least(bound):
    return _check(lambda v: v >= bound, f">= {bound}")


def between(low, high):
    """Closed interval [low, high]."""
    return _check(lambda v: low <= v <= high, f"between {low} and {high}")


def one_of(*choices):
    return _check(lambda v: v in choices, "one of " + ", ".join(repr(c) for c in choices))


def fields_help(config_class):
    """[(name, type name, default or None, required, help)] for a config class, in declaration order."""
    rows = []
    for f in attrs.fields(config_class):
        required = f.default is attrs.NOTHING
        if isinstance(f.default, attrs.Factory):
            default = f.default.factory()
        else:
            default = None if required else f.default
        type_name = f.type.__name__ if isinstance(f.type, type) else str(f.type)  # list[str] stays list[str]
        rows.append((f.name, type_name, default, required, f.metadata.get(HELP, "")))
    return rows
