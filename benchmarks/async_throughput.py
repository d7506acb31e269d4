"""Iterations per second of each `[scheduler]` type, and what they learn, on the multi-turn
default recipe whose environment answers each turn after a delay, as a remote environment or a
tool does.

    python benchmarks/async_throughput.py                          # 0.1 s a turn, 3 seeds, 60 iterations
    python benchmarks/async_throughput.py --delay 0 --seeds 1 --steps 20   # no latency: what running ahead costs

Prints one JSON line per run (scheduler, seed, wall-clock seconds per iteration after the first, the trainer's
median wait for its batch, the mean staleness, the held-out win rate and turns at the end), then
a summary per scheduler: the median seconds per iteration, the throughput against `sync`, and the
held-out figures' range over the seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from pathlib import Path

import tomllib
from rlkit_plugins.guess_number import GuessNumber, GuessNumberConfig

from rlkit_core import Step, hookimpl
from rlkit_core.recipe.document import parse_recipe
from rlkit_core.recipe.plugins import load_registry
from rlkit_core.runtime.evaluation import Evaluator
from rlkit_core.runtime.trainer import Trainer

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "ppo_guess_number.toml"
SCHEDULERS = {"sync": {"type": "sync"}, "one-step-off": {"type": "one-step-off"},
              "bounded-2": {"type": "bounded", "max_staleness": 2}}


def slow_environment(delay: float) -> types.ModuleType:
    """A plugin module with `slow-guess-number`: guess-number, each step answered after `delay` s."""

    class SlowGuessNumber(GuessNumber):
        def step(self, state, reply) -> Step:
            time.sleep(delay)
            return super().step(state, reply)

    module = types.ModuleType("slow_guess_number")

    @hookimpl
    def register_environments(register):
        register("slow-guess-number", SlowGuessNumber, GuessNumberConfig)

    module.register_environments = register_environments  # type: ignore[attr-defined]
    return module


def one_run(name: str, seed: int, args) -> dict:
    document = tomllib.loads(RECIPE.read_text())
    document["run"].update({"steps": args.steps, "seed": seed, "threads": args.threads, "output_dir": f"/tmp/rlkit-bench-async/{name}-{seed}"})
    document["environment"]["type"] = "slow-guess-number"
    document["scheduler"] = SCHEDULERS[name]
    document["loss"]["tis_cap"] = 2.0  # the decoupled objective's behaviour weight, the same for every scheduler
    document["tracker"] = {"type": "none"}
    registry = load_registry(environ={"RLKIT_PLUGINS": "none"}, extra_plugins=[("slow-guess-number", slow_environment(args.delay), "bench", "0")])
    trainer = Trainer(parse_recipe(document, registry))
    try:
        rows = [trainer.step()]
        started = time.perf_counter()  # the wall clock from the end of the first iteration: what a run waits for
        rows += [trainer.step() for _ in range(args.steps - 1)]
        wall = (time.perf_counter() - started) / (args.steps - 1)
        held_out = Evaluator(trainer.recipe, trainer.engine, trainer.components, trainer.context, trainer.prompts)()
    finally:
        trainer.close()
    waits = [row.get("time/trainer_waiting", row["time/generate"] + row.get("time/environment", 0.0)) for row in rows[1:]]
    return {"scheduler": name, "seed": seed, "seconds_per_iteration": round(wall, 4),
            "trainer_waiting": round(statistics.median(waits), 4),
            "staleness": round(statistics.mean(row.get("async/staleness", 0.0) for row in rows), 3),
            "won": round(held_out["eval/won"], 4), "turns": round(held_out["eval/turns"], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delay", type=float, default=0.1, help="seconds each environment step waits")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--schedulers", default=",".join(SCHEDULERS))
    args = parser.parse_args()
    runs = []
    for seed in range(args.seeds):
        for name in args.schedulers.split(","):
            runs.append(one_run(name, seed, args))
            print(json.dumps(runs[-1]), flush=True)
    base = statistics.median(r["seconds_per_iteration"] for r in runs if r["scheduler"] == "sync") if any(
        r["scheduler"] == "sync" for r in runs) else None
    for name in dict.fromkeys(r["scheduler"] for r in runs):
        mine = [r for r in runs if r["scheduler"] == name]
        median = statistics.median(r["seconds_per_iteration"] for r in mine)
        print(json.dumps({"summary": name, "delay": args.delay, "seconds_per_iteration": round(median, 4),
                          "throughput_vs_sync": round(base / median, 3) if base else None,
                          "won": [min(r["won"] for r in mine), max(r["won"] for r in mine)],
                          "turns": [min(r["turns"] for r in mine), max(r["turns"] for r in mine)]}), file=sys.stdout, flush=True)


if __name__ == "__main__":
    main()
