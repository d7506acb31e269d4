"""What playing through the agent endpoint costs, and what it trains: the multi-turn default recipe
(recipes/ppo_guess_number.toml) with its in-process `guess-number` environment, and with the same
game played by an OpenAI-client agent (examples/agents/guess_number.py) through the endpoint.

    python benchmarks/agent_endpoint.py                               # 40 iterations, seed 0, in-process and agent
    python benchmarks/agent_endpoint.py --steps 120 --seeds 0,1,2     # the recipe's whole run, 3 seeds
    python benchmarks/agent_endpoint.py --variants agent,paid-at-end --steps 20 --eval-every 10
    python benchmarks/agent_endpoint.py --variants agent,paid-at-end --no-turn-barrier   # episodes that never wait

The variants:
- `in-process`: the recipe as shipped. The environment pays each wrong guess (-turn_cost) at its turn.
- `agent`: `[environment] type = "agent"`, `harness = "examples/agents/guess_number.py:play"`. The
  agent pays the game's rewards summed, once, at its end; a game the model cut off pays nothing.
- `paid-at-end`: the in-process environment paying what the agent pays, when the agent pays it. It
  samples the agent's ids in every iteration (checked: `same_as_agent`), so against `agent` it
  isolates what the endpoint costs, and against `in-process` what the reward's timing changes.

Each run is a fresh process (`--one`), one at a time; the variants' order rotates from seed to seed,
so that a change of load falls on each alike. One JSON line per run: the median over the iterations
after the first of the wall-clock seconds per iteration, of the process's CPU seconds per
iteration (every thread: the agent's, the endpoint's), and of the phases (`time/environment`,
generate, forward, train); the held-out evaluation before the first iteration, every `--eval-every`
(default the recipe's `eval.every`) and after the last: `won` (the share of the held-out games won,
counted alike for every variant: a game is won when its return is above 0), `eval/won` as rlkit
reports it (for the agent, over the games its harness ended: a game cut off reports no figures),
`eval/score` and `eval/turns`. Then, per seed, each variant's ratio to `in-process`, and the medians
over the seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "ppo_guess_number.toml"
AGENT = ROOT / "examples" / "agents" / "guess_number.py"
VARIANTS = ("in-process", "agent", "paid-at-end")
PHASES = ("time/environment", "time/generate", "time/forward", "time/train")


def paid_at_end_plugin() -> types.ModuleType:
    """A plugin module with `guess-number-paid-at-end`: guess-number, its rewards summed and paid at
    the game's end, as the agent pays them (nothing before; a game cut off is never paid)."""
    from rlkit_plugins.guess_number import GuessNumber, GuessNumberConfig

    from rlkit_core import hookimpl

    class PaidAtEnd(GuessNumber):
        def reset(self, record, seed):
            reset = super().reset(record, seed)
            return attrs.evolve(reset, state=[reset.state, 0.0])  # the game, and what it has earned so far

        def step(self, state, reply):
            game, earned = state
            step = super().step(game, reply)
            state[1] = earned = earned + step.reward
            over = step.done or game.turns >= self.config.max_turns
            return attrs.evolve(step, reward=earned if over else None)

    module = types.ModuleType("guess_number_paid_at_end")

    @hookimpl
    def register_environments(register):
        register("guess-number-paid-at-end", PaidAtEnd, GuessNumberConfig)

    module.register_environments = register_environments  # type: ignore[attr-defined]
    return module


def document_for(variant: str, seed: int, steps: int, threads: int, eval_every: int | None, output_dir: str, barrier: bool = True) -> dict:
    import tomllib

    document = tomllib.loads(RECIPE.read_text())
    document["run"].update(steps=steps, seed=seed, threads=threads, output_dir=output_dir, checkpoint_every=0)
    document["tracker"] = {"type": "none"}
    if eval_every is not None:
        document["eval"]["every"] = eval_every
    environment = document["environment"]
    if variant == "agent":
        document["environment"] = {"type": "agent", "harness": f"{AGENT}:play", "max_turns": environment["max_turns"],
                                   "max_episode_tokens": environment["max_episode_tokens"]}
    elif variant == "paid-at-end":
        environment["type"] = "guess-number-paid-at-end"
    document["environment"]["turn_barrier"] = barrier
    return document


def one_run(variant: str, seed: int, steps: int, threads: int, eval_every: int | None, barrier: bool = True) -> dict:
    """Train `steps` iterations of `variant` in this process, evaluating as `rlkit run` does; its figures."""
    from rlkit_core.recipe.document import parse_recipe
    from rlkit_core.recipe.plugins import load_registry
    from rlkit_core.runtime import evaluation
    from rlkit_core.runtime.trainer import Trainer

    extra = [("guess-number-paid-at-end", paid_at_end_plugin(), "bench", "0")] if variant == "paid-at-end" else []
    document = document_for(variant, seed, steps, threads, eval_every, f"/tmp/rlkit-bench-agent/{variant}-{seed}", barrier)
    started = time.perf_counter()
    trainer = Trainer(parse_recipe(document, load_registry(environ={"RLKIT_PLUGINS": "none"}, extra_plugins=extra)))
    evaluator = evaluation.Evaluator(trainer.recipe, trainer.engine, trainer.components, trainer.context, trainer.prompts)
    won: list[int] = []  # games won among the held-out batches of one evaluation
    rollout = evaluation.rollout

    def counted(*args, **kwargs):  # a won game is one whose return is above 0 (1 - 0.1 · 4 at worst; a loss is -0.5, a cut-off ≤ 0)
        batch, stage = rollout(*args, **kwargs)
        won.append(int((batch.scores > 0).sum()))
        return batch, stage

    evaluation.rollout = counted  # type: ignore[assignment]

    def evaluate(iteration: int) -> dict:
        won.clear()
        figures = evaluator()
        return {"iteration": iteration, "won": round(sum(won) / len(evaluator.records), 4), "eval/won": round(figures["eval/won"], 4),
                "eval/score": round(figures["eval/score"], 4), "eval/turns": round(figures["eval/turns"], 3),
                "eval/status_cut_off": round(figures["eval/status_cut_off"], 4)}

    evaluations, rows, walls, cpus = [evaluate(0)], [], [], []
    try:
        for iteration in range(1, steps + 1):
            cpu, wall = time.process_time(), time.perf_counter()
            rows.append(trainer.step())
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
            if evaluator.due(iteration):
                evaluations.append(evaluate(iteration))
    finally:
        trainer.close()
    after = slice(1, None) if steps > 1 else slice(None)  # the first iteration starts the endpoint and warms the caches

    def median(values) -> float:
        return round(statistics.median(values[after]), 4)

    return {"variant": variant, "seed": seed, "iterations": steps, "seconds_per_iteration": median(walls), "cpu_seconds_per_iteration": median(cpus),
            **{name.removeprefix("time/"): median([row[name] for row in rows]) for name in PHASES},
            "turns": round(statistics.fmean(row["env/turns"] for row in rows), 3),
            "requests_per_iteration": round(statistics.fmean(row.get("env/agent_requests", 0.0) for row in rows) * trainer.recipe.ppo.batch_size, 1),
            "cut_off": round(statistics.fmean(row["env/status_cut_off"] for row in rows), 4),
            "evaluations": evaluations, "run_seconds": round(time.perf_counter() - started, 1),
            # what was sampled, iteration by iteration: equal for runs that sampled the same ids
            "trace": [[row["score/mean"], row["env/tokens"]] for row in rows]}


def run_child(variant: str, seed: int, args) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--one", variant, "--seeds", str(seed), "--steps", str(args.steps),
               "--threads", str(args.threads)] + (["--eval-every", str(args.eval_every)] if args.eval_every is not None else []) + \
        ([] if args.turn_barrier else ["--no-turn-barrier"])
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    if done.returncode != 0:
        raise SystemExit(f"the {variant} run of seed {seed} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="iterations per run (the recipe's whole run is 120)")
    parser.add_argument("--seeds", default="0", help="comma-separated run seeds")
    parser.add_argument("--variants", default="in-process,agent", help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (and OMP_NUM_THREADS) of each run")
    parser.add_argument("--eval-every", type=int, default=None, help="held-out evaluation every this many iterations (default: the recipe's)")
    parser.add_argument("--no-turn-barrier", dest="turn_barrier", action="store_false",
                        help="every variant with environment.turn_barrier = false (episodes that never wait on each other)")
    parser.add_argument("--one", choices=VARIANTS, help=argparse.SUPPRESS)  # run one variant in this process (the parent's child)
    args = parser.parse_args()
    seeds = [int(seed) for seed in args.seeds.split(",")]
    if args.one:
        print(json.dumps(one_run(args.one, seeds[0], args.steps, args.threads, args.eval_every, args.turn_barrier)), flush=True)
        return
    variants = args.variants.split(",")
    if unknown := set(variants) - set(VARIANTS):
        parser.error(f"unknown variants {sorted(unknown)}: use {', '.join(VARIANTS)}")
    runs: dict[tuple[str, int], dict] = {}
    for index, seed in enumerate(seeds):
        for variant in variants[index % len(variants):] + variants[:index % len(variants)]:
            load = os.getloadavg()[0]
            run = runs[variant, seed] = run_child(variant, seed, args)
            print(json.dumps({**{k: v for k, v in run.items() if k != "trace"}, "load_before": round(load, 2)}), flush=True)
        base = runs.get(("in-process", seed))
        line: dict = {"seed": seed}
        for variant in variants:
            run = runs[variant, seed]
            if base is not None and variant != "in-process":
                line[f"{variant}/in-process"] = {"wall": round(run["seconds_per_iteration"] / base["seconds_per_iteration"], 3),
                                                 "cpu": round(run["cpu_seconds_per_iteration"] / base["cpu_seconds_per_iteration"], 3)}
        if ("agent", seed) in runs and ("paid-at-end", seed) in runs:
            line["same_as_agent"] = runs["agent", seed]["trace"] == runs["paid-at-end", seed]["trace"]
        print(json.dumps(line), flush=True)
    summary: dict = {"summary": "median over seeds", "iterations": args.steps, "seeds": seeds}
    for variant in variants:
        mine = [runs[variant, seed] for seed in seeds]
        summary[variant] = {key: round(statistics.median(run[key] for run in mine), 4)
                            for key in ("seconds_per_iteration", "cpu_seconds_per_iteration", "environment")}
        if variant != "in-process" and "in-process" in variants:
            for key in ("seconds_per_iteration", "cpu_seconds_per_iteration"):
                ratios = [runs[variant, seed][key] / runs["in-process", seed][key] for seed in seeds]
                summary[variant][f"{key}_ratio"] = round(statistics.median(ratios), 3)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
