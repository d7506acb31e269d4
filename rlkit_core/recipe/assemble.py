"""Turning a checked recipe into live components, in the order their factories need them."""

from __future__ import annotations

import attrs

from rlkit_core.context import BuildContext
from rlkit_core.recipe.document import Recipe


@attrs.frozen
class Components:
    policy: object
    value_head: object | None  # None when the advantage estimator needs no critic
    generator: object
    reward: object
    kl: object
    advantage: object
    loss: object
    data: object
    tracker: object


def build_components(recipe: Recipe, context: BuildContext) -> Components:
    policy = context.build(recipe["policy"])
    context.policy = policy
    advantage = context.build(recipe["advantage"])
    return Components(
        policy=policy,
        value_head=context.build(recipe["value_head"]) if advantage.needs_values else None,
        generator=context.build(recipe["generator"]),
        reward=context.build(recipe["reward"]),
        kl=context.build(recipe["kl"]),
        advantage=advantage,
        loss=context.build(recipe["loss"]),
        data=context.build(recipe["data"]),
        tracker=context.build(recipe["tracker"]),
    )
