"""The `rlkit` command: run, check, export, plugins.

Exit codes: 0 success; 2 bad input (recipe, arguments), printed without a traceback; 1 failure
at run time; 128 + N stopped by signal N (130 Ctrl-C, 143 SIGTERM). RLKIT_DEBUG=1 prints the
traceback of rlkit's own errors too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

from rlkit_core.errors import RlkitError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlkit", description="PPO fine-tuning of language models, every part a plugin.")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="train a recipe")
    run.add_argument("recipe", help="path to a TOML recipe")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a recipe value, e.g. --set kl.target=4 (repeatable)")
    run.add_argument("--quiet", action="store_true", help="no progress display")
    run.add_argument("--overwrite", action="store_true", help="start over in an output_dir that holds an earlier run")
    run.add_argument("--resume", metavar="PATH|auto", help="continue from a checkpoint folder, or 'auto' for the latest in run.output_dir")

    check = commands.add_parser("check", help="validate a recipe, resolve its plugins and print the plan; trains nothing")
    check.add_argument("recipe")
    check.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    check.add_argument("--offline", action="store_true",
                       help="download nothing: hub models and tokenizers not in the local cache are reported as unchecked")
    check.add_argument("--num-processes", type=int, metavar="N",
                       help="check for a launch of N processes (default: this launch's WORLD_SIZE, else 1)")
    check.add_argument("--prompt-tokens", type=int, default=128, metavar="N", help="prompt length the memory estimate assumes")

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
    from rlkit_core.inventory import core_table_rows, registry_rows
    from rlkit_core.plugins import load_registry

    registry = load_registry()
    core, rows = core_table_rows(), registry_rows(registry)
    if args.json:
        print(json.dumps({"core": core, "components": rows, "broken": registry.broken}, indent=2, default=str))
        return 0
    print("core tables")
    for table in core:
        print(f"  [{table['table']}]")
        _print_fields(table["fields"])
    kind = None
    for row in rows:
        if row["kind"] != kind:
            kind = row["kind"]
            print(f"\n{kind}")
        print(f"  {row['name']:<16} {row['plugin']} ({row['distribution']} {row['version']})")
        _print_fields(row["fields"])
    for name, why in registry.broken.items():
        print(f"\nbroken plugin {name!r}: {why}", file=sys.stderr)
    return 0


def _cmd_check(args) -> int:
    if args.offline:
        os.environ["HF_HUB_OFFLINE"] = "1"  # read by huggingface_hub when it is first imported, below
    from rlkit_core.plan import describe_plan
    from rlkit_core.plugins import load_registry
    from rlkit_core.recipe import load_recipe

    if args.num_processes:
        os.environ["WORLD_SIZE"] = str(args.num_processes)  # what accelerate launch would set
    recipe = load_recipe(args.recipe, load_registry(), args.overrides)
    print(describe_plan(recipe, args.prompt_tokens))
    return 0


def _cmd_run(args) -> int:
    from rlkit_core.plugins import load_registry
    from rlkit_core.recipe import load_recipe
    from rlkit_core.run import run_recipe
    recipe = load_recipe(args.recipe, load_registry(), args.overrides)
    run_recipe(recipe, quiet=args.quiet, resume=args.resume, overwrite=args.overwrite)  # several processes end inside it
    return 0


def _cmd_export(args) -> int:
    from rlkit_core.export import export_checkpoint
    from rlkit_core.plugins import load_registry

    target = export_checkpoint(args.checkpoint, args.out, load_registry(), merge_lora=args.merge_lora)
    print(f"wrote {target}; load it with transformers' AutoModelForCausalLM.from_pretrained({str(target)!r})")
    return 0


COMMANDS = {"run": _cmd_run, "check": _cmd_check, "plugins": _cmd_plugins, "export": _cmd_export}


def _quiet_libraries() -> None:
    """transformers' progress bars and advice drown the run's own output; users can still set
    TRANSFORMERS_VERBOSITY themselves."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def main(argv: list[str] | None = None) -> int:
    _quiet_libraries()
    args = _parser().parse_args(argv)
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
