"""Turning a checked recipe into live components, in the order their factories need them."""

from __future__ import annotations

import attrs

from rlkit_core.context import BuildContext
from rlkit_core.interfaces import KIND_TABLE
from rlkit_core.recipe.document import Recipe

Components = attrs.make_class(
    "Components",
    {kind.table: attrs.field(type=kind.interface | None if kind.table == "value_head" else kind.interface) for kind in KIND_TABLE},
    frozen=True,
)
Components.__doc__ = """The live components of a run, one field per recipe table (`rlkit_core.interfaces.KIND_TABLE`),
typed with its kind's interface; `value_head` is None when the advantage estimator needs no critic."""


def build_components(recipe: Recipe, context: BuildContext) -> Components:
    policy = context.build(recipe["policy"])
    context.policy = policy
    advantage = context.build(recipe["advantage"])
    critic = recipe.components.get("value_head")  # none with `value_head.type = "none"`
    return Components(
        policy=policy,
        value_head=context.build(critic) if critic is not None else None,
        generator=context.build(recipe["generator"]),
        reward=context.build(recipe["reward"]),
        kl=context.build(recipe["kl"]),
        advantage=advantage,
        loss=context.build(recipe["loss"]),
        data=context.build(recipe["data"]),
        tracker=context.build(recipe["tracker"]),
    )
