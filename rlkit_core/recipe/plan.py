"""`rlkit check`'s plan: what a recipe will build and how much work it is, without building it."""

from __future__ import annotations

from collections.abc import Callable

from rlkit_core.errors import RecipeError
from rlkit_core.interfaces import declares
from rlkit_core.launch import ONE_PROCESS, Launch
from rlkit_core.memory import Workload, estimate
from rlkit_core.memory import describe as describe_memory
from rlkit_core.recipe.document import Recipe
from rlkit_core.recipe.inventory import component_choices, inventory_rows
from rlkit_core.recipe.schema import kl_warnings, output_dir_problems
from rlkit_core.settings import ModelSettings

# A record of the data through the environment's `reset`: (lines for the episodes section, problems, notes). The runtime gives
# it (`rlkit_core.runtime.reset_check.first_reset`; for an agent recipe, `rlkit_core.runtime.agent_check.agent_episodes`, whole
# episodes): it builds live components and holds the environment's contract, which this layer does not.
ResetProbe = Callable[[Recipe], tuple[list[str], list[str], list[str]]]


def describe_plan(recipe: Recipe, prompt_tokens: int = 128, probe: bool = False, launch: Launch = ONE_PROCESS,
                  reset_probe: ResetProbe | None = None) -> str:
    """The plan of a recipe checked for `launch` (the one `parse_recipe` was given); `reset_probe`, for a recipe with an
    `[environment]` and no other problem: its episodes can start on the data."""
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
        f"  optimiser steps     {updates_per_iteration} per iteration ({ppo.epochs} epochs × {ppo.batch_size // ppo.minibatch_size} minibatches of "
        f"{ppo.minibatch_size}), {updates_per_iteration * run.steps} in all",
        f"  KL                  estimator {ppo.kl_estimator}, penalty in the {ppo.kl_penalty}",
        f"  scheduler           {_scheduler_line(recipe)}",
        *_per_process(recipe, launch),
        f"  output              {run.output_dir}",
    ]
    size = model_size(recipe)
    if size:
        lines += ["", "model:", *[f"  {line}" for line in size]]
    memory = memory_estimate(recipe, prompt_tokens, launch)
    if memory:
        lines += ["", f"memory (prompts of {prompt_tokens} tokens; rlkit check --prompt-tokens N):", *[f"  {line}" for line in memory]]
    if "environment" in recipe.components:
        lines += ["", "episodes:", *[f"  {line}" for line in episode_plan(recipe)]]
    episodes_end = len(lines)
    lines += ["", "code this recipe runs (besides rlkit's own):", *[f"  {line}" for line in code_it_runs(recipe)]]
    problems, notes = preflight(recipe)
    found, said = service_probes(recipe, probe)
    problems, notes = problems + found, notes + said
    if reset_probe is not None and "environment" in recipe.components and not problems:  # builds the data: not on a known-bad recipe
        opened, found, said = reset_probe(recipe)
        lines[episodes_end:episodes_end] = [f"  {line}" for line in opened]
        problems, notes = problems + found, notes + said
    if problems:
        raise RecipeError(problems, recipe.source)
    warnings = kl_warnings(recipe.ppo) + remote_code_warnings(recipe)
    if warnings:
        lines += ["", "warnings:", *[f"  {line}" for line in warnings]]
    if notes:
        lines += ["", "not checked:", *[f"  {line}" for line in dict.fromkeys(notes)]]
    return "\n".join(lines)


def preflight(recipe: Recipe) -> tuple[list[str], list[str]]:
    """(problems, notes) that `rlkit check` reports and `rlkit run` refuses to start with, found
    before anything is built or written: the output folder, then every component's own check."""
    problems, notes = component_checks(recipe)
    problems = [str(p) for p in output_dir_problems(recipe.run)] + problems
    return list(dict.fromkeys(problems)), notes  # two components may check one model (a critic checks the policy's tokenizer)


def code_it_runs(recipe: Recipe) -> list[str]:
    """The third-party code a run imports: every installed plugin that loaded (RLKIT_PLUGINS
    chooses them), and the files the recipe names for components that import them (a factory's
    `imports(config, where)`, e.g. the `python` reward's function), nested tables included.
    `rlkit check` imports none of the files."""
    from rlkit_core.recipe.plugins import BUILTIN_DISTRIBUTION
    from rlkit_core.recipe.registry import Registry

    registry = recipe.registry
    plugins = sorted({(c.plugin, c.distribution, c.version) for c in registry.all()
                      if c.distribution != BUILTIN_DISTRIBUTION}) if isinstance(registry, Registry) else []
    lines = [f"plugin {name} ({dist} {version})" for name, dist, version in plugins] or ["no third-party plugins loaded"]
    for choice in component_choices(recipe):
        lines += [f"[{choice.table}] imports {what}" for what in choice.component.factory.imports(choice.config, f"$.{choice.table}")]
    return lines


def remote_code_warnings(recipe: Recipe) -> list[str]:
    """A component allowed to run the Python code shipped with its model (transformers' trust_remote_code,
    `ModelSettings.trust_remote_code`)."""
    return [f"$.{choice.table}.trust_remote_code = true: {choice.config.model or 'the model'!r} "
            "may run Python code that ships with the model, in rlkit check as in rlkit run; keep it only for a model you trust"
            for choice in component_choices(recipe)
            if isinstance(choice.config, ModelSettings) and choice.config.trust_remote_code is True]


def component_checks(recipe: Recipe) -> tuple[list[str], list[str]]:
    """(problems, notes) from every component's `check(config, recipe, where)` (`ComponentBase.check`), nested
    ones included (`where` is the table's place, `$.reward.parts[1]`): what would
    fail at run time across tables (a critic that cannot read the policy's ids, a reward model's
    tokenizer that does not load), found before any weights are loaded."""
    problems, notes = [], []
    for choice in component_choices(recipe):
        found, said = choice.component.factory.check(choice.config, recipe, f"$.{choice.table}")
        problems += found
        notes += said
    return problems, notes


def service_probes(recipe: Recipe, probe: bool) -> tuple[list[str], list[str]]:
    """(problems, notes) from every component whose class declares a `probe(config, where)`: a cheap
    request to a service it will call (a reward server). Only `rlkit check` probes, and not with
    --offline; `rlkit run` does not, since the service may come up after the run starts."""
    problems, notes = [], []
    for choice in component_choices(recipe):
        factory = choice.component.factory
        if declares(factory, "probe") and probe:
            problems += factory.probe(choice.config, f"$.{choice.table}")
        elif declares(factory, "probe"):
            notes.append(f"$.{choice.table}: the {choice.component.name} service was not probed (--offline)")
    return problems, notes


ENGINES = {False: "DDP: every process holds the whole model and optimiser state",
           True: "FSDP2: weights, gradients and optimiser state sharded over the processes"}


def _per_process(recipe: Recipe, launch: Launch) -> list[str]:
    """How the global batch splits over processes and micro-batches (the recipe's sizes are global)."""
    ppo, processes = recipe.ppo, launch.processes
    per_process = ppo.minibatch_size // processes
    return [
        f"  processes           {processes}, each with {ppo.batch_size // processes} rollouts per iteration "
        f"({ppo.batch_size // ppo.samples_per_prompt // processes} prompts)",
        f"  micro-batches       {ppo.gradient_accumulation_steps} of {per_process // ppo.gradient_accumulation_steps} rollouts "
        f"per process and optimiser step; forward passes in chunks of {ppo.forward_batch_size or ppo.minibatch_size}",
        f"  precision           mixed_precision = {recipe.run.mixed_precision!r}",
        f"  engine              {ENGINES[launch.sharded] if processes > 1 else 'one process'}",
    ]


def _scheduler_line(recipe: Recipe) -> str:
    scheduler = recipe.scheduler
    if (source := recipe.components.get("batch_source")) is not None:
        stale = source.component.factory.max_staleness
        return (f"batch_source {source.component.name!r} gives every batch"
                + (f", at most {stale} version(s) behind when trained (as its class declares)" if stale
                   else ", sampled by the weights that train on it (as its class declares)"))
    if not scheduler.runs_ahead:
        return "max_staleness = 0 (sync): each batch sampled after the update before it"
    where = "by worker processes of their own" if scheduler.workers == "processes" else "from a copy of the weights"
    between = "; weights pushed mid-batch are loaded between turns" if scheduler.partial_rollouts else ""
    return (f"max_staleness = {scheduler.staleness_bound}: batches sampled ahead {where}, at most {scheduler.staleness_bound} "
            f"version(s) behind when trained{between}; a wait over {scheduler.wait_timeout_s:g} s ends the run")


def episode_plan(recipe: Recipe) -> list[str]:
    """An episode's bounds, and the audit of how the policy's chat template renders turns (which
    decides whether an episode stays one training sample), when the policy names a local tokenizer."""
    from rlkit_core.chat_format import audit, episode_format
    from rlkit_core.hf import LOAD_ERRORS, is_local

    settings = recipe["environment"].config
    budget = settings.max_episode_tokens or f"{recipe['generator'].config.max_new_tokens} × {settings.max_turns}"
    lines = [f"turns               at most {settings.max_turns}, tokens after the first prompt at most {budget}",
             f"timeouts            {settings.step_timeout_s or 'none'} s a step, {settings.episode_timeout_s or 'none'} s an episode"]
    policy = recipe["policy"].config
    name = (policy.tokenizer or policy.model) if isinstance(policy, ModelSettings) else ""  # "": the policy builds its own
    if not name or not is_local(name):
        return [*lines, "chat format         audited when the policy is built (it names no local tokenizer); "
                        "the run prints the audit"]
    from transformers import AutoTokenizer, GenerationConfig

    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except LOAD_ERRORS:  # the policy's check locates why
        return [*lines, f"chat format         not audited: the tokenizer {name!r} does not load"]
    try:
        generation = GenerationConfig.from_pretrained(name).eos_token_id
    except OSError:  # no generation config: the tokenizer's end token alone
        generation = None
    ends = tuple(dict.fromkeys(e for e in [tokenizer.eos_token_id, *(generation if isinstance(generation, list) else [generation])]
                               if e is not None))
    try:
        chat, how = episode_format(settings, tokenizer, ends, recipe.registry)
        report = audit(tokenizer, ends, chat.name, chat.tool_calls, how, settings.thinking_in_history, chat)
    except RecipeError as exc:
        raise RecipeError(exc.problems, recipe.source) from None
    return [*lines, *report.lines()]


def model_size(recipe: Recipe) -> list[str]:
    """Parameter count from the policy's config file, when it names a local model."""
    return recipe["policy"].component.factory.describe(recipe["policy"].config)


def memory_estimate(recipe: Recipe, prompt_tokens: int, launch: Launch = ONE_PROCESS) -> list[str]:
    """Per-process memory, when the policy plugin can say its model's shape (see rlkit_core.memory)."""
    parts = memory_parts(recipe, prompt_tokens, launch)
    return [] if parts is None else describe_memory(*parts)


def memory_parts(recipe: Recipe, prompt_tokens: int, launch: Launch = ONE_PROCESS) -> tuple[dict[str, int], int] | None:
    """(bytes per process by part, shards) that `rlkit check` prints; None when the policy cannot say its shape.
    The benchmarks compare its "peak" with measured peaks."""
    shape = recipe["policy"].component.factory.shape(recipe["policy"].config)
    if shape is None:
        return None
    ppo, processes = recipe.ppo, launch.processes
    generator = recipe["generator"].config
    work = Workload(
        micro_batch=ppo.minibatch_size // processes // ppo.gradient_accumulation_steps,
        forward_batch=ppo.forward_batch_size or ppo.minibatch_size,
        generate_batch=generator.batch_size or ppo.batch_size // processes,
        prompt_tokens=prompt_tokens,
        response_tokens=generator.max_new_tokens,
        checkpointing=recipe["policy"].config.gradient_checkpointing,
        mixed_precision=recipe.run.mixed_precision,
        shards=processes if launch.sharded else 1,
        micro_tokens=ppo.max_tokens_per_microbatch,
        forward_tokens=ppo.max_tokens_per_forward,
    )
    return estimate(shape, work), work.shards
