"""Turning a checked recipe into live components, in the order their factories need them."""

import attrs

from rlkit_core.context import BuildContext
from rlkit_core.interfaces import AdvantageEstimator, Generator, KLController, Loss, Policy, PromptSource, RewardSource, Tracker, ValueHead
from rlkit_core.records import Recipe


@attrs.frozen
class Components:
    """The live components of a run, one field per recipe table (`rlkit_core.interfaces.KIND_TABLE`,
    in its order; a test holds the two together), typed with its kind's interface; `value_head` is
    None when the advantage estimator needs no critic."""

    policy: Policy
    value_head: ValueHead | None
    generator: Generator
    reward: RewardSource
    kl: KLController
    advantage: AdvantageEstimator
    loss: Loss
    data: PromptSource
    tracker: Tracker


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
