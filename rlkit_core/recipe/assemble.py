"""Turning a checked recipe into live components, in the order their factories need them."""

import attrs

from rlkit_core.context import BuildContext
from rlkit_core.interfaces import (
    AdvantageEstimator,
    BatchSource,
    Environment,
    Generator,
    KLController,
    Loss,
    Policy,
    PromptSource,
    RewardSource,
    Tracker,
    ValueHead,
)
from rlkit_core.records import Recipe


@attrs.frozen
class Components:
    """The live components of a run, one field per recipe table (`rlkit_core.interfaces.KIND_TABLE`,
    in its order; a test holds the two together), typed with its kind's interface. An optional
    kind's field is None with `type = "none"`: `value_head` when the advantage estimator needs no
    critic, `environment` in a single-turn recipe, `reward` when the environment's rewards alone train,
    `batch_source` when the core's own source gives the batches."""

    policy: Policy
    value_head: ValueHead | None
    generator: Generator
    reward: RewardSource | None
    kl: KLController
    advantage: AdvantageEstimator
    loss: Loss
    environment: Environment | None
    data: PromptSource
    tracker: Tracker
    batch_source: BatchSource | None


def build_components(recipe: Recipe, context: BuildContext, with_critic: bool = True) -> Components:
    """The recipe's components; without the value head where `with_critic` is false (a process that
    only samples: a producer's worker)."""
    policy = context.build(recipe["policy"])
    context.policy = policy
    advantage = context.build(recipe["advantage"])
    critic = recipe.components.get("value_head") if with_critic else None  # none with `value_head.type = "none"`
    optional = {table: context.build(recipe[table]) if table in recipe.components else None for table in ("reward", "environment", "batch_source")}
    return Components(
        policy=policy,
        value_head=context.build(critic) if critic is not None else None,
        generator=context.build(recipe["generator"]),
        reward=optional["reward"],
        kl=context.build(recipe["kl"]),
        advantage=advantage,
        loss=context.build(recipe["loss"]),
        environment=optional["environment"],
        data=context.build(recipe["data"]),
        tracker=context.build(recipe["tracker"]),
        batch_source=optional["batch_source"],
    )
