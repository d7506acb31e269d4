"""Helpers for the frozen attrs classes that describe recipe tables and plugin settings.

Every setting carries a one-line help text (shown by `rlkit plugins` and `rlkit check`), and range
validators phrase their failures so that the recipe loader can prefix them with a location:
`$.kl.target: must be > 0, got -1`.

A setting may also hold other components' tables (`nested_component`, `nested_components`): a reward
that adds up other rewards, a KL schedule made of stages, a loss's surrogate. The recipe loader checks
each nested table against its own component's config class and hands the factory a `ComponentChoice`
per table, which the factory builds with `context.build(choice)` (or, for a function kind such as a
surrogate, calls `choice.component.factory` with `choice.config`).

A config class may name keys it does not take but a recipe may well write (a setting it no longer
has, one that belongs to another table) in a `refused_keys` class variable, key -> what to write
instead: the recipe loader refuses such a key at its place with that text, not as an unknown key.
"""

from __future__ import annotations

from typing import Any

import attrs

HELP = "help"
NESTED = "rlkit_nested"


@attrs.frozen
class Nested:
    """What a nested-component setting holds: tables of component `kind`, one or a list, and
    `extra`, an attrs class for keys the parent reads from each table besides the component's own
    settings (a part's `weight`)."""

    kind: str
    many: bool
    extra: type | None = None
    default_type: str | None = None  # the type of a table the recipe leaves out (one table only)


def setting(default=attrs.NOTHING, *, help, validator=None, factory=None, kw_only=False) -> Any:
    """An attrs field with a help text (typed Any, as `attrs.field` is to a type checker); `factory` for mutable defaults; `kw_only` for settings a
    base class shares with subclasses that have required fields."""
    if factory is not None:
        return attrs.field(factory=factory, validator=validator, metadata={HELP: help}, kw_only=kw_only)
    return attrs.field(default=default, validator=validator, metadata={HELP: help}, kw_only=kw_only)


def nested_component(kind: str, *, help, extra: type | None = None, default=attrs.NOTHING, validator=None,
                     default_type: str | None = None, kw_only: bool = False) -> Any:
    """A setting that holds one component table of `kind`: `[reward.judge]` with a `type` and that
    component's settings. The recipe loader puts a `rlkit_core.ComponentChoice` here
    (annotate the field so); `default=None` makes the table optional. With `default_type`, a
    recipe that leaves the table out gets that type with its default settings, and one may write
    a type alone as the setting's value (`surrogate = "gspo"`); the field's own default is then
    None, which only a config built outside a recipe holds. `kw_only` as for `setting`."""
    metadata = {HELP: help, NESTED: Nested(kind, many=False, extra=extra, default_type=default_type)}
    return attrs.field(default=None if default_type else default, validator=validator, metadata=metadata, kw_only=kw_only)


def nested_components(kind: str, *, help, extra: type | None = None, validator=None):
    """A setting that holds a list of component tables of `kind` (`[[reward.parts]]`), each
    checked on its own; the recipe loader puts a `list[ComponentChoice]` here."""
    metadata = {HELP: help, NESTED: Nested(kind, many=True, extra=extra)}
    return attrs.field(validator=validator, metadata=metadata)


def nested_spec(field: attrs.Attribute) -> Nested | None:
    return field.metadata.get(NESTED)


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


def fields_help(config_class, prefix: str = ""):
    """[(name, type name, default or None, required, help)] for a config class, in declaration order.
    A nested-component setting reads as `reward tables`, followed by its `extra` keys (`parts[].weight`)."""
    rows = []
    for f in attrs.fields(config_class):
        required = f.default is attrs.NOTHING
        # a factory (one that reads other fields: its value when they keep their defaults); attrs' stubs type
        # Factory as a function, which it is not at run time
        if isinstance(f.default, attrs.Factory):  # pyright: ignore[reportArgumentType]
            default = getattr(config_class(), f.name) if f.default.takes_self else f.default.factory()
        else:
            default = None if required else f.default
        nested = nested_spec(f)
        if nested and nested.default_type:
            default = nested.default_type
        if nested:
            type_name = f"[[{nested.kind}]]" if nested.many else f"[{nested.kind}]"  # TOML: a list of tables, a table
        else:
            type_name = f.type.__name__ if isinstance(f.type, type) else str(f.type)  # list[str] stays list[str]
        rows.append((prefix + f.name, type_name, default, required, f.metadata.get(HELP, "")))
        if nested and nested.extra:
            rows += fields_help(nested.extra, f"{prefix}{f.name}{'[]' if nested.many else ''}.")
    return rows
