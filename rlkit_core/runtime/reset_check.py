# pyright: standard
"""`rlkit check`'s look at the data through the environment: the first record's `reset`, before
any training, so that an environment that cannot start an episode on the recipe's own data (a
record without the column it reads) is found at check time, located, not after a run that trained
nothing. Only the data and the environment are built, never the model."""

from __future__ import annotations

import contextlib

import torch

from rlkit_core.context import BuildContext
from rlkit_core.errors import RecipeError
from rlkit_core.interfaces import declares
from rlkit_core.launch import Launch
from rlkit_core.messages import Reset
from rlkit_core.recipe.document import Recipe
from rlkit_core.runtime.environment_calls import CallPool
from rlkit_core.runtime.episodes import answer_problem

WHERE = "$.environment: reset on the first record of the data"


def first_reset(recipe: Recipe, launch: Launch, offline: bool) -> tuple[list[str], list[str], list[str]]:
    """The plan's `ResetProbe` (`rlkit_core.recipe.plan`): (lines, problems, notes). Every failure
    is a problem, exit 2 as a recipe's: a run could not start one episode on this data. With
    --offline, an environment that calls a service (it declares `probe`) is not reset, and data
    that does not load is a note (it may be on the hub)."""
    choice = recipe["environment"]
    if offline and declares(choice.component.factory, "probe"):
        return [], [], [f"$.environment: the {choice.component.name} environment calls a service: its reset was not run on a record (--offline)"]
    context = BuildContext(recipe=recipe, device=torch.device("cpu"), output_dir=str(recipe.run.output_dir), seed=recipe.run.seed,
                           launch=launch)
    try:
        records = context.build(recipe["data"]).load()
        environment = context.build(choice)
    except RecipeError as exc:
        return [], exc.problems, []
    except Exception as exc:  # data on the hub with --offline, or a part that needs the policy, which the check does not build
        return [], [], [f"$.environment: not reset on a record: building the data or the environment without the model raised "
                        f"{type(exc).__name__}: {exc}"]
    if not records:
        return [], [], ["$.data: loaded no record: the environment's reset was not run on one"]
    timeout = choice.config.step_timeout_s
    try:
        [(status, answer)] = CallPool(1).run([(environment.reset, (records[0], 0))], timeout, "reset")
    except RecipeError as exc:
        return [], exc.problems, []
    if status == "timeout":
        return [], [f"{WHERE} did not return within environment.step_timeout_s = {timeout:g} s: every such episode would end as a "
                    "timeout; find what it waits on, or raise the limit"], []
    if status == "error":
        return [], [f"{WHERE} raised {answer}"], []
    if problem := answer_problem(answer, Reset):
        return [], [f"{WHERE} {problem}"], []
    # what the reset opened (an agent's harness, its process) is released as after any episode; a close that fails changes nothing here
    with contextlib.suppress(RecipeError):
        CallPool(1).run([(environment.close, (answer.state,))], timeout, "close")
    return [f"reset               on the first record of the data: {len(answer.messages)} opening message(s), ok"], [], []
