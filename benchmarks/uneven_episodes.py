"""Episodes whose environment steps take uneven time: the rollout with the turn barrier (every
turn waits for every environment) against without it (`environment.turn_barrier = false`), and
against the slowest episode played alone.

    python benchmarks/uneven_episodes.py                    # 64 episodes, 10% of steps 5x slower
    python benchmarks/uneven_episodes.py --fast 0.02 --slow 0.1 --repeats 3

The multi-turn default recipe's policy and game (recipes/ppo_guess_number.toml), its environment
wrapped so that each step first sleeps: `--slow` seconds for a share `--share` of the steps (the
same steps in every mode: drawn from the episode's index and the turn), `--fast` for the rest.
Prints one JSON line: the median seconds of a batch of episodes each way (and of the last repeat,
the seconds spent generating), the slowest episode (the one that slept longest in the run without
the barrier) played alone, and the ratios to it. Turns are greedy, so that an episode plays the same
turns alone as in the batch (`slowest_alone_slept_s` shows it) at the cost of sampling them.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import attrs
import tomllib

from rlkit_core import Environment
from rlkit_core.recipe.document import parse_recipe
from rlkit_core.recipe.plugins import load_registry
from rlkit_core.runtime.episodes import EpisodeRunner
from rlkit_core.runtime.trainer import Trainer

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "ppo_guess_number.toml"


class Uneven(Environment):
    """`inner`'s game, each step after a sleep: `slow` seconds for a `share` of the steps, else `fast`."""

    def __init__(self, inner: Environment, fast: float, slow: float, share: float):
        self.inner, self.fast, self.slow, self.share = inner, fast, slow, share

    def tools(self):
        return self.inner.tools()

    def reset(self, record, seed):
        opening = self.inner.reset(record, seed)
        return attrs.evolve(opening, state=(opening.state, record["index"]))

    def step(self, state, reply):
        inner, index = state
        time.sleep(self.sleep(index, reply.turn))
        return self.inner.step(inner, reply)

    def sleep(self, index: int, turn: int) -> float:
        return self.slow if random.Random(f"{index}/{turn}").random() < self.share else self.fast


def runner_for(barrier: bool, threads: int, output_dir: str, fast: float, slow: float, share: float) -> tuple[Trainer, EpisodeRunner]:
    document = tomllib.loads(RECIPE.read_text())
    document["run"].update({"threads": threads, "output_dir": output_dir})
    document["environment"]["turn_barrier"] = barrier
    document["tracker"] = {"type": "none"}
    trainer = Trainer(parse_recipe(document, load_registry(environ={"RLKIT_PLUGINS": "none"})))
    environment = Uneven(trainer.components.environment, fast, slow, share)
    return trainer, EpisodeRunner(trainer.engine, attrs.evolve(trainer.components, environment=environment), trainer.recipe)


def timed(runner: EpisodeRunner, records: list[dict], seeds: list[int]) -> tuple[float, list]:
    started = time.perf_counter()
    episodes = runner(records, list(range(len(records))), seeds, greedy=True)
    return time.perf_counter() - started, episodes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--fast", type=float, default=0.05, help="seconds of most steps")
    parser.add_argument("--slow", type=float, default=0.25, help="seconds of the slow steps")
    parser.add_argument("--share", type=float, default=0.1, help="share of the steps that are slow")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output-dir", default="/tmp/rlkit-bench-uneven")
    args = parser.parse_args()
    result: dict = {"episodes": args.episodes, "fast_s": args.fast, "slow_s": args.slow, "share": args.share}
    seconds: dict[str, float] = {}
    for barrier in (True, False):
        trainer, runner = runner_for(barrier, args.threads, args.output_dir, args.fast, args.slow, args.share)
        records = [{**record, "index": index} for index, record in enumerate(trainer.prompts.train[:args.episodes])]
        seeds = list(range(len(records)))
        runs = [timed(runner, records, seeds) for _ in range(args.repeats)]
        seconds["barrier" if barrier else "as_ready"] = statistics.median(s for s, _ in runs)
        seconds[("barrier" if barrier else "as_ready") + "_generating"] = runner.timings["generate"]  # the last repeat's
        if not barrier:
            environment = runner.environment
            assert isinstance(environment, Uneven)
            slept = [sum(environment.sleep(i, turn) for turn in range(1, e.turns + 1)) for i, e in enumerate(runs[0][1])]
            slowest = max(range(len(records)), key=lambda i: slept[i])
            played = [timed(runner, [records[slowest]], [seeds[slowest]]) for _ in range(args.repeats)]
            alone = statistics.median(s for s, _ in played)
            slept_alone = sum(environment.sleep(slowest, turn) for turn in range(1, played[0][1][0].turns + 1))
            result.update({"slowest_episode_slept_s": round(slept[slowest], 3), "slowest_alone_s": round(alone, 3),
                           "slowest_alone_slept_s": round(slept_alone, 3),
                           "turns": round(statistics.mean(e.turns for e in runs[0][1]), 3)})
    result.update({f"{name}_s": round(value, 3) for name, value in seconds.items()})
    result["barrier_vs_slowest_alone"] = round(seconds["barrier"] / result["slowest_alone_s"], 3)
    result["as_ready_vs_slowest_alone"] = round(seconds["as_ready"] / result["slowest_alone_s"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
