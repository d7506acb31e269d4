"""`rlkit check`'s plan: what a recipe will build and how much work it is, without building it."""

from __future__ import annotations

from rlkit_core.errors import RecipeError
from rlkit_core.inventory import inventory_rows
from rlkit_core.recipe import Recipe
from rlkit_core.schema import kl_warnings


def describe_plan(recipe: Recipe) -> str:
    run, ppo = recipe.run, recipe.ppo
    updates_per_iteration = ppo.epochs * (ppo.batch_size // ppo.minibatch_size)
    lines = [f"recipe {recipe.source or '(in memory)'} is valid", "", "components:"]
    for row in inventory_rows(recipe):
        lines.append(f"  [{row['table']}] {row['type']:<14} from {row['plugin']} ({row['distribution']} {row['version']})")
    lines += [
        "",
        "work:",
        f"  iterations          {run.steps}",
        f"  rollouts/iteration  {ppo.batch_size} ({ppo.batch_size // ppo.samples_per_prompt} prompts × {ppo.samples_per_prompt} samples)",
        f"  optimiser steps     {updates_per_iteration} per iteration ({ppo.epochs} epochs × {ppo.batch_size // ppo.minibatch_size} minibatches of {ppo.minibatch_size}), {updates_per_iteration * run.steps} in all",
        f"  KL                  estimator {ppo.kl_estimator}, penalty in the {ppo.kl_penalty}",
        f"  output              {run.output_dir}",
    ]
    size = model_size(recipe)
    if size:
        lines += ["", "model:", *[f"  {line}" for line in size]]
    problems, notes = component_checks(recipe)
    if problems:
        raise RecipeError(problems, recipe.source)
    warnings = kl_warnings(recipe.ppo)
    if warnings:
        lines += ["", "warnings:", *[f"  {line}" for line in warnings]]
    if notes:
        lines += ["", "not checked:", *[f"  {line}" for line in dict.fromkeys(notes)]]
    return "\n".join(lines)


def component_checks(recipe: Recipe) -> tuple[list[str], list[str]]:
    """(problems, notes) from every component whose factory has a `check(config, recipe)`: what
    would fail at run time across tables (a critic that cannot read the policy's ids, a reward
    model's tokenizer that does not load), found before any weights are loaded."""
    problems, notes = [], []
    for choice in recipe.components.values():
        check = getattr(choice.component.factory, "check", None)
        if check:
            found, said = check(choice.config, recipe)
            problems += found
            notes += said
    return problems, notes


def model_size(recipe: Recipe) -> list[str]:
    """Parameter count and a memory estimate from the policy's config file, when it names a local model."""
    describe = getattr(recipe["policy"].component.factory, "describe", None)
    return describe(recipe["policy"].config) if describe else []
