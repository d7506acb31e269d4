"""Turning a checked recipe into live components, in the order their factories need them."""

from __future__ import annotations

import attrs

from rlkit_core.context import BuildContext
from rlkit_core.errors import RecipeError
from rlkit_core.interfaces import KINDS
from rlkit_core.recipe import Recipe


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


def _build(recipe: Recipe, table: str, context: BuildContext):
    choice = recipe[table]
    instance = choice.component.factory(choice.config, context)
    kind = choice.component.kind
    if not isinstance(instance, KINDS[kind]):
        raise RecipeError([f"$.{table}.type: {choice.component.name!r} from plugin {choice.component.plugin!r} built a "
                           f"{type(instance).__name__}, which is not a {KINDS[kind].__name__}; the plugin is broken"])
    return instance


def build_components(recipe: Recipe, context: BuildContext) -> Components:
    policy = _build(recipe, "policy", context)
    context.policy = policy
    advantage = _build(recipe, "advantage", context)
    return Components(
        policy=policy,
        value_head=_build(recipe, "value_head", context) if advantage.needs_values else None,
        generator=_build(recipe, "generator", context),
        reward=_build(recipe, "reward", context),
        kl=_build(recipe, "kl", context),
        advantage=advantage,
        loss=_build(recipe, "loss", context),
        data=_build(recipe, "data", context),
        tracker=_build(recipe, "tracker", context),
    )
