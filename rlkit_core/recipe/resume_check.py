"""A resumed run must train with the recipe its checkpoint was trained with, or say so.

"The same results as a run that was never interrupted" holds only if nothing that shapes the
optimisation changed between the two halves. The rule is an allow-list: the settings below cannot
change what is trained (where results go, how often things are logged or saved, what happens on a
fault that did not occur), and `run.steps` extends (or shortens) a run when the learning-rate
schedule does not spread over the run's length. Every other change, including `run.threads` and
`run.device` (another reduction order changes the numbers), is refused unless the user passes
`--allow-changes`; the run then records the changes.
"""

from __future__ import annotations

from typing import Any

from rlkit_core.errors import RecipeError, RlkitError
from rlkit_core.launch import ONE_PROCESS, Launch
from rlkit_core.recipe.document import Recipe, parse_recipe
from rlkit_core.recipe.inventory import flatten
from rlkit_core.recipe.registry import Registry
from rlkit_core.recipe.schema import CORE_TABLES
from rlkit_core.records import ComponentChoice

# settings that cannot change what a run trains; a table name covers all its keys
HARMLESS = ("run.name", "run.output_dir", "run.checkpoint_every", "run.keep_checkpoints", "run.sample_every",
            "run.report_samples", "run.on_bad_reward", "run.max_skips_in_a_row", "eval.every", "eval.metrics", "eval.greedy",
            "tracker", "health")
# schedules whose learning rate at a step does not depend on the run's total number of steps
LENGTH_FREE_SCHEDULES = ("constant", "constant_with_warmup", "inverse_sqrt")
_MISSING = object()


def recipe_changes(recorded: dict, recipe: Recipe, launch: Launch = ONE_PROCESS) -> list[tuple[str, Any, Any]]:
    """(setting, the checkpoint's value, this recipe's value) for every change that can change
    what is trained. A setting written out on one side and left to its default on the other is
    no change when the default is the written value. `launch`: the one `recipe` was checked for."""
    before, now = flatten(recorded), flatten(recipe.document)
    try:
        parsed = parse_recipe(recorded, recipe.registry, launch=launch) if isinstance(recipe.registry, Registry) else None
    except RecipeError:  # a component the checkpoint names is no longer installed: compare as written
        parsed = None
    changes = []
    for key in dict.fromkeys([*before, *now]):
        if _harmless(key, recipe):
            continue
        old = before[key] if key in before else _resolved(parsed, key)
        new = now[key] if key in now else _resolved(recipe, key)
        if old != new:
            changes.append((key, "(not set)" if old is _MISSING else old, "(not set)" if new is _MISSING else new))
    return changes


def _harmless(key: str, recipe: Recipe) -> bool:
    if key == "run.steps":
        return recipe.optim.schedule in LENGTH_FREE_SCHEDULES
    return any(key == allowed or key.startswith(allowed + ".") for allowed in HARMLESS)


def _resolved(recipe: Recipe | None, key: str):
    """The value `recipe` runs with for a dotted setting (its default when the document leaves it out)."""
    if recipe is None:
        return _MISSING
    table, _, rest = key.partition(".")
    if table in CORE_TABLES:
        value = getattr(recipe, table)
    elif table in recipe.components:
        choice = recipe.components[table]
        if rest == "type":
            return choice.component.name
        value = choice.config
    else:
        return _MISSING
    for part in rest.split("."):
        if isinstance(value, ComponentChoice):  # a nested table: its type, or one of its settings
            value = value.component.name if part == "type" else getattr(value.config, part, _MISSING)
        else:
            value = getattr(value, part, _MISSING)
        if value is _MISSING:
            return _MISSING
    return value.component.name if isinstance(value, ComponentChoice) else value  # a type alone (`surrogate = "gspo"`)


def describe(changes: list[tuple[str, Any, Any]]) -> list[str]:
    return [f"$.{key}: {old!r} in the checkpoint's recipe, {new!r} now" for key, old, new in changes]


def check_resumed_recipe(recorded: dict, recipe: Recipe, checkpoint_path, allow_changes: bool, launch: Launch = ONE_PROCESS) -> list[str]:
    """The changes (as lines) when `allow_changes`; otherwise the located refusal if there are any."""
    lines = describe(recipe_changes(recorded, recipe, launch))
    if lines and not allow_changes:
        steps = ""
        if any(line.startswith("$.run.steps:") for line in lines):
            steps = (f" (run.steps counts because optim.schedule = {recipe.optim.schedule!r} spreads over the run's length: "
                     "the learning rate of every step to come changes with it)")
        listing = "\n".join(f"  {line}" for line in lines)
        raise RlkitError(f"--resume {checkpoint_path}: {len(lines)} setting(s) that shape the training differ from the "
                         f"checkpoint's recipe{steps}:\n{listing}\nresume with the recipe the checkpoint was trained with "
                         "(its meta.json holds it), or add --allow-changes to continue with these changes, recorded in "
                         "the tracker and metrics.jsonl")
    return lines
