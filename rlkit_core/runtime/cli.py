# pyright: standard
"""The `rlkit` command: run, check, check-checkpoint, export, plugins.

Exit codes: 0 success; 2 bad input (recipe, arguments, a damaged or earlier-layout checkpoint, an output folder
another run holds), printed without a traceback; 1 failure at run time; 3 stopped by a health check
in health.stop_on; 128 + N stopped by signal N (130 Ctrl-C, 143 SIGTERM). RLKIT_DEBUG=1 prints the
traceback of rlkit's own errors too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
import warnings

import attrs

from rlkit_core.errors import RecipeDeprecation, RlkitError
from rlkit_core.launch import Launch


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlkit", description="PPO fine-tuning of language models, every part a plugin.")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="train a recipe")
    run.add_argument("recipe", help="path to a TOML recipe")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a recipe value, e.g. --set kl.target=4 (repeatable)")
    run.add_argument("--quiet", action="store_true", help="no progress display")
    run.add_argument("--overwrite", action="store_true", help="start over in an output_dir that holds an earlier run")
    run.add_argument("--resume", metavar="PATH|auto", help="continue from a checkpoint folder, or 'auto' for the latest usable one in run.output_dir")
    run.add_argument("--allow-changes", action="store_true",
                     help="with --resume: continue although the recipe trains differently from the checkpoint's (the changes are recorded)")

    check = commands.add_parser("check", help="validate a recipe, resolve its plugins and print the plan; trains nothing")
    check.add_argument("recipe")
    check.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    check.add_argument("--offline", action="store_true",
                       help="no network: hub models and tokenizers not in the local cache are reported as unchecked, "
                            "and reward services are not probed")
    check.add_argument("--num-processes", type=int, metavar="N",
                       help="check for a launch of N processes (default: this launch's WORLD_SIZE, else 1)")
    check.add_argument("--accelerate-config", metavar="FILE",
                       help="check for `accelerate launch --config_file FILE` (e.g. configs/accelerate/fsdp.yaml): its engine "
                            "and, without --num-processes, its num_processes")
    check.add_argument("--prompt-tokens", type=int, default=128, metavar="N", help="prompt length the memory estimate assumes")
    check.add_argument("--agent-episodes", type=int, default=2, metavar="N",
                       help="for a recipe whose environment is 'agent' (or another HarnessEnvironment): play N episodes (the data's first "
                            "N records) with the policy, which is built for them, the harness and the endpoint, and report each; 0: none, "
                            "nothing built")

    verify = commands.add_parser("check-checkpoint",
                                 help="verify a checkpoint's files against its manifest, and that its layout is one this rlkit resumes; trains nothing")
    verify.add_argument("path", help="a checkpoint folder (<output_dir>/checkpoints/iter_NNNNNN), or a run's output_dir: "
                                     "every checkpoint in it, and the one --resume auto would take")

    export = commands.add_parser("export", help="write a checkpoint's policy as a plain transformers model directory")
    export.add_argument("checkpoint", help="a checkpoint folder (<output_dir>/checkpoints/iter_NNNNNN)")
    export.add_argument("out", help="a new folder for the model")
    export.add_argument("--merge-lora", action="store_true", help="fold LoRA adapters into the base weights")

    plugins = commands.add_parser("plugins", help="list every registered component with its plugin, version and settings")
    plugins.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def _print_fields(fields: list[dict]) -> None:
    for f in fields:
        default = "required" if f["required"] else f"default {f['default']!r}"
        print(f"      {f['name']:<24} {f['type']:<10} {default:<24} {f['help']}")


def _cmd_plugins(args) -> int:
    """Exit 1 when an installed plugin is broken: its components are missing from the listing."""
    from rlkit_core.recipe.inventory import core_table_rows, registry_rows
    from rlkit_core.recipe.plugins import load_registry

    registry = load_registry()
    core, rows = core_table_rows(), registry_rows(registry)
    if args.json:
        print(json.dumps({"core": core, "components": rows, "broken": registry.broken, "filtered": registry.filtered},
                         indent=2, default=str))
        return 1 if registry.broken else 0
    for line in _plugin_health(registry):
        print(line)
    print("core tables")
    for table in core:
        print(f"  [{table['table']}]")
        _print_fields(table["fields"])
    kind = None
    for row in rows:
        if row["kind"] != kind:
            kind = row["kind"]
            print(f"\n{kind}")
        needs = f"  needs: pip install {', '.join(row['needs'])}" if row.get("needs") else ""
        print(f"  {row['name']:<16} {row['plugin']} ({row['distribution']} {row['version']}){needs}")
        _print_fields(row["fields"])
    if registry.broken:  # again at the end, where a long listing leaves the reader
        print(f"\nrlkit plugins: {len(registry.broken)} broken plugin(s): {', '.join(registry.broken)}; see the top of the listing",
              file=sys.stderr)
        return 1
    return 0


def _plugin_health(registry) -> list[str]:
    """Lines for the top of `rlkit plugins`: broken plugins with their errors and how to leave
    them out, and installed plugins that RLKIT_PLUGINS filters out."""
    from rlkit_core.recipe.plugins import BUILTIN_DISTRIBUTION

    lines = []
    if registry.broken:
        working = sorted({c.plugin for c in registry.all() if c.distribution != BUILTIN_DISTRIBUTION})
        lines.append(f"BROKEN PLUGINS: {len(registry.broken)} installed plugin(s) failed to load; their components are missing below")
        lines += [f"  {name}: {why}" for name, why in registry.broken.items()]
        lines.append(f"  fix or uninstall it, or leave it out: RLKIT_PLUGINS={','.join(working) or 'none'} "
                     "(a comma-separated list of the plugins to load; 'none': built-ins only)")
    if registry.filtered:
        lines.append(f"installed but filtered out by RLKIT_PLUGINS={os.environ.get('RLKIT_PLUGINS', '')!r} (not imported): "
                     + ", ".join(f"{name} ({dist})" for name, dist in registry.filtered.items()))
    return lines + [""] if lines else []


def check_launch(accelerate_config: str | None, num_processes: int | None) -> Launch:
    """The launch `rlkit check` checks for: `accelerate launch --config_file accelerate_config`
    when given, else this one (its environment); `num_processes` overrides the processes of either."""
    launch = Launch.from_accelerate_config(accelerate_config) if accelerate_config else Launch.from_environment()
    return attrs.evolve(launch, processes=num_processes) if num_processes else launch


def _cmd_check(args) -> int:
    if args.offline:
        os.environ["HF_HUB_OFFLINE"] = "1"  # read by huggingface_hub when it is first imported, below
    from rlkit_core.recipe.document import load_recipe
    from rlkit_core.recipe.plan import describe_plan
    from rlkit_core.recipe.plugins import load_registry
    from rlkit_core.runtime.agent_check import agent_episodes, is_agent_recipe
    from rlkit_core.runtime.reset_check import first_reset

    if args.agent_episodes < 0:
        raise RlkitError(f"--agent-episodes {args.agent_episodes}: give a number of episodes, 0 or more")
    launch = check_launch(args.accelerate_config, args.num_processes)
    recipe = load_recipe(args.recipe, load_registry(), args.overrides, launch)

    def reset_probe(checked):
        if args.agent_episodes and is_agent_recipe(checked):  # the episodes start with the reset
            return agent_episodes(checked, args.agent_episodes)
        return first_reset(checked, launch, args.offline)

    print(describe_plan(recipe, args.prompt_tokens, probe=not args.offline, launch=launch, reset_probe=reset_probe))
    return 0


def _cmd_run(args) -> int:
    from rlkit_core.errors import RecipeError
    from rlkit_core.recipe.document import load_recipe
    from rlkit_core.recipe.plan import preflight
    from rlkit_core.recipe.plugins import load_registry
    from rlkit_core.runtime.run import run_recipe

    if args.allow_changes and not args.resume:
        raise RlkitError("--allow-changes: only with --resume (it accepts a recipe that differs from the checkpoint's)")
    launch = Launch.from_environment()
    recipe = load_recipe(args.recipe, load_registry(), args.overrides, launch)
    problems, _ = preflight(recipe)  # what `rlkit check` would refuse, before anything is built or written
    if problems:
        raise RecipeError(problems, recipe.source)
    run_recipe(recipe, quiet=args.quiet, resume=args.resume, overwrite=args.overwrite, allow_changes=args.allow_changes,
               launch=launch)  # several processes end inside it
    return 0


def _cmd_check_checkpoint(args) -> int:
    """Exit 0 when the checkpoint (or, for an output_dir, the one `--resume auto` would take) is
    usable; 2 when it is damaged, in a layout this rlkit does not resume, or there is none."""
    from pathlib import Path

    from rlkit_core.runtime import checkpoint

    path = Path(args.path)
    if (path / "meta.json").is_file():
        checkpoint.choose(str(path), path.parent.parent)  # the error `--resume PATH` would end with
        print(f"{path}: usable: iteration {checkpoint.read_meta(path)['iteration']}, every file matches its manifest")
        return 0
    found = checkpoint.complete_checkpoints(path)
    if not found:
        raise RlkitError(f"{path}: neither a checkpoint (no meta.json) nor an output_dir with checkpoints; give an "
                         f"{checkpoint.PREFIX}* folder under <output_dir>/checkpoints, or the output_dir")
    for folder in found:
        why = checkpoint.damage(folder)
        layout = None if why else checkpoint.layout_problem(folder)
        print(f"{folder}: {'damaged: ' + why if why else 'not resumable: ' + layout if layout else 'usable'}")
    print(f"--resume auto would resume from {checkpoint.resolve('auto', path)}")
    return 0


def _cmd_export(args) -> int:
    from rlkit_core.recipe.plugins import load_registry
    from rlkit_core.runtime.export import export_checkpoint

    target = export_checkpoint(args.checkpoint, args.out, load_registry(), merge_lora=args.merge_lora, launch=Launch.from_environment())
    print(f"wrote {target}; load it with transformers' AutoModelForCausalLM.from_pretrained({str(target)!r})")
    return 0


COMMANDS = {"run": _cmd_run, "check": _cmd_check, "check-checkpoint": _cmd_check_checkpoint, "plugins": _cmd_plugins,
            "export": _cmd_export}


def _quiet_libraries() -> None:
    """transformers' progress bars and advice drown the run's own output; users can still set
    TRANSFORMERS_VERBOSITY themselves."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def _plain_deprecations(command: str) -> None:
    """A recipe's deprecated setting as one line naming the fix, not Python's warning with its source line."""
    show = warnings.showwarning

    def shown(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, RecipeDeprecation):
            print(f"rlkit {command}: warning: {message}", file=sys.stderr)
        else:
            show(message, category, filename, lineno, file, line)

    warnings.showwarning = shown


def main(argv: list[str] | None = None) -> int:
    _quiet_libraries()
    args = _parser().parse_args(argv)
    _plain_deprecations(args.command)
    try:
        return COMMANDS[args.command](args)
    except RlkitError as exc:
        if os.environ.get("RLKIT_DEBUG"):
            traceback.print_exception(exc)
        print(f"rlkit {args.command}: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("rlkit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
