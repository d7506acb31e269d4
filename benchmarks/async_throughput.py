"""Iterations per second of each `[scheduler]` type, and what they learn, where the rollout waits
on something slow:

- `--task guess-number`: the multi-turn default recipe, its environment answering each turn after
  `--delay` seconds, as a remote environment or a tool does;
- `--task summarize`: the default recipe with its reward served over HTTP by
  examples/reward_server.py, which this script starts, answering each request after `--delay`
  seconds, as a reward model or judge across the network does.

    python benchmarks/async_throughput.py                          # guess-number, 0.1 s a turn, 3 seeds, 60 iterations
    python benchmarks/async_throughput.py --task summarize --delay 0.5
    python benchmarks/async_throughput.py --delay 0 --seeds 1 --steps 20   # no latency: what running ahead costs
    python benchmarks/async_throughput.py --task summarize --delay 1 --workers processes   # workers in processes of their own
    python benchmarks/async_throughput.py --delay 0.3 --schedulers one-step-off --partial-rollouts   # newer weights between turns

Prints one JSON line per run (scheduler, seed, wall-clock seconds per iteration after the first,
the trainer's median wait for its batch, the mean staleness (of the batches, and of their sampled tokens), the held-out figures at the end), then
a summary per scheduler: the median seconds per iteration, the throughput against `sync`, and the
held-out figures' range over the seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import attrs
import tomllib
from rlkit_plugins.guess_number import GuessNumber, GuessNumberConfig

from rlkit_core import Step, hookimpl
from rlkit_core.config import setting
from rlkit_core.recipe.document import parse_recipe
from rlkit_core.recipe.plugins import load_registry
from rlkit_core.runtime.evaluation import Evaluator
from rlkit_core.runtime.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {"guess-number": ROOT / "recipes" / "ppo_guess_number.toml", "summarize": ROOT / "recipes" / "ppo_summarize_http_reward.toml"}
HELD_OUT = {"guess-number": ("eval/won", "eval/turns"), "summarize": ("eval/score", "eval/fact-copied")}
# the names the figures in benchmarks/README.md carry, and the bound each is
SCHEDULERS = {"sync": {"max_staleness": 0}, "one-step-off": {"max_staleness": 1}, "bounded-2": {"max_staleness": 2}}


@attrs.frozen
class SlowGuessNumberConfig(GuessNumberConfig):
    delay: float = setting(0.1, help="seconds each step waits before it answers")


class SlowGuessNumber(GuessNumber):
    """guess-number, each step answered after `delay` s (defined here, not in a function, so that
    workers in processes of their own can import it)."""

    def step(self, state, reply) -> Step:
        time.sleep(self.config.delay)  # pyright: ignore[reportAttributeAccessIssue]  (the config is a SlowGuessNumberConfig)
        return super().step(state, reply)


def slow_environment() -> types.ModuleType:
    """A plugin module with `slow-guess-number`."""
    module = types.ModuleType("slow_guess_number")

    @hookimpl
    def register_environments(register):
        register("slow-guess-number", SlowGuessNumber, SlowGuessNumberConfig)

    module.register_environments = register_environments  # type: ignore[attr-defined]
    return module


def reward_server(delay: float) -> tuple[subprocess.Popen, str]:
    """examples/reward_server.py on a free port, answering after `delay` s; and its /score URL."""
    server = subprocess.Popen([sys.executable, str(ROOT / "examples" / "reward_server.py"), "--port", "0", "--delay", str(delay)],
                              stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    address = server.stdout.readline().split()[3]  # "serving rewards on http://127.0.0.1:PORT (...)"
    return server, f"{address}/score"


def one_run(name: str, seed: int, args, url: str | None) -> dict:
    document = tomllib.loads(RECIPES[args.task].read_text())
    document["run"].update({"steps": args.steps, "seed": seed, "threads": args.threads, "output_dir": f"/tmp/rlkit-bench-async/{name}-{seed}"})
    extra = []
    if args.task == "guess-number":
        document["environment"].update(type="slow-guess-number", delay=args.delay)
        extra = [("slow-guess-number", slow_environment(), "bench", "0")]
    else:
        document["reward"]["url"] = url
        document["eval"]["every"] = 0  # held out once, at the end
    ahead = {"workers": args.workers, "partial_rollouts": args.partial_rollouts} if SCHEDULERS[name]["max_staleness"] else {}
    document["scheduler"] = dict(SCHEDULERS[name], **ahead)
    # the decoupled objective's behaviour weight, the same for every scheduler (`sync`'s is 1 to within 1e-5): per
    # sequence, since per token it let the summarize recipe's KL run away at staleness 1 (docs/async.md)
    document["loss"].update(tis_cap=2.0, is_level="sequence")
    document["tracker"] = {"type": "none"}
    if args.generator == "vllm-server":  # each generator (the trainer's, each worker's) on a vllm serve process of its own
        document["run"]["device"] = "cpu"
        document["generator"].update(type="vllm", engine="server", gpu_memory_fraction=0.02)
    registry = load_registry(environ={"RLKIT_PLUGINS": "none"}, extra_plugins=extra)
    trainer = Trainer(parse_recipe(document, registry))
    try:
        rows = [trainer.step()]
        started = time.perf_counter()  # the wall clock from the end of the first iteration: what a run waits for
        rows += [trainer.step() for _ in range(args.steps - 1)]
        wall = (time.perf_counter() - started) / (args.steps - 1)
        held_out = Evaluator(trainer.recipe, trainer.engine, trainer.components, trainer.context, trainer.prompts)()
    finally:
        trainer.close()
    waits = [row.get("time/trainer_waiting", row["time/generate"] + row.get("time/environment", 0.0) + row["time/score"])
             for row in rows[1:]]
    return {"scheduler": name, "seed": seed, "seconds_per_iteration": round(wall, 4),
            "trainer_waiting": round(statistics.median(waits), 4),
            "staleness": round(statistics.mean(row.get("async/staleness", 0.0) for row in rows), 3),
            "token_staleness": round(statistics.mean(row.get("async/token_staleness", row.get("async/staleness", 0.0)) for row in rows), 3),
            **{key: round(held_out[key], 4) for key in HELD_OUT[args.task]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=sorted(RECIPES), default="guess-number")
    parser.add_argument("--delay", type=float, default=0.1, help="seconds each environment step (guess-number) or reward request (summarize) waits")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--schedulers", default=",".join(SCHEDULERS))
    parser.add_argument("--generator", choices=["recipe", "vllm-server"], default="recipe",
                        help="vllm-server: the vllm generator on vllm serve processes (needs vLLM; on a CPU, its CPU build)")
    parser.add_argument("--workers", choices=["threads", "processes"], default="threads",
                        help="where the workers that make batches ahead run ([scheduler] workers)")
    parser.add_argument("--partial-rollouts", action="store_true",
                        help="guess-number: workers load the weights pushed mid-batch between turns ([scheduler] partial_rollouts)")
    args = parser.parse_args()
    server, url = reward_server(args.delay) if args.task == "summarize" else (None, None)
    runs = []
    try:
        for seed in range(args.seeds):
            for name in args.schedulers.split(","):
                runs.append(one_run(name, seed, args, url))
                print(json.dumps(runs[-1]), flush=True)
    finally:
        if server is not None:
            server.terminate()
    base = statistics.median(r["seconds_per_iteration"] for r in runs if r["scheduler"] == "sync") if any(
        r["scheduler"] == "sync" for r in runs) else None
    for name in dict.fromkeys(r["scheduler"] for r in runs):
        mine = [r for r in runs if r["scheduler"] == name]
        median = statistics.median(r["seconds_per_iteration"] for r in mine)
        print(json.dumps({"summary": name, "task": args.task, "generator": args.generator, "workers": args.workers,
                          "delay": args.delay, "seconds_per_iteration": round(median, 4),
                          "throughput_vs_sync": round(base / median, 3) if base else None,
                          **{key: [min(r[key] for r in mine), max(r[key] for r in mine)] for key in HELD_OUT[args.task]}}),
              file=sys.stdout, flush=True)


if __name__ == "__main__":
    main()
