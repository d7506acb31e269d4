"""What multi-turn episodes cost: the multi-turn default recipe's seconds per iteration by phase,
and the generation of a batch of episodes against one turn that samples as many tokens from the
same prompts.

    python benchmarks/episodes.py --steps 6              # the recipe as shipped, 2 threads
    python benchmarks/episodes.py --steps 4 --threads 1
    python benchmarks/episodes.py --whole-prefill        # every turn prefills its whole stream (no kept KV cache)
    python benchmarks/episodes.py --model DIR --device cuda --dtype bfloat16 --max-turns 4 --max-new-tokens 32 --steps 1

`--model` plays the games with an `hf` policy from that folder instead of the warm-started toy (a random
model says no number, so every game runs its `--max-turns`; benchmarks/gpu_run.py uses it so on a GPU).

Prints one JSON line. `phases`: medians over the iterations after the first (generate, environment
= the environment's own calls, forward = old, reference and value passes, train, iteration).
`turns_vs_one`: for the same prompts, the seconds of the episodes' generation (every turn a call of
the generator on each episode's whole stream so far) and of one call that samples, for each prompt,
as many tokens as its episode sampled in all (`min_new_tokens` = `max_new_tokens`), with the
positions the model computed for the episodes (prompts and steps, padding included), the share of
later turns' prompt tokens taken from kept KV caches, the episodes' sampled and rendered tokens,
and the per-episode token budget that bounds both.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path

import attrs
import tomllib
import torch
from rlkit_plugins.hf_generator import HFGenerator

from rlkit_core import Generator
from rlkit_core.recipe.document import parse_recipe
from rlkit_core.recipe.plugins import load_registry
from rlkit_core.runtime.rollout import generate, rollout
from rlkit_core.runtime.trainer import Trainer

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "ppo_guess_number.toml"
PHASES = ("time/generate", "time/environment", "time/forward", "time/train", "time/iteration")


def turns_against_one(trainer: Trainer, repeats: int) -> dict:
    """Episodes' generation against one long turn of as many sampled tokens, `repeats` times each (medians)."""
    records = trainer.stream.batch(0)
    episode_seconds, one_seconds, sampled, rendered = [], [], 0, 0
    generator = trainer.components.generator
    for _ in range(repeats):
        computed = generator.positions[0]
        batch, metrics = rollout(trainer.engine, trainer.components, trainer.recipe, records, trainer.recipe.ppo.samples_per_prompt,
                                 trainer.prompts.max_tokens)
        episode_seconds.append(metrics["time/generate"])
        computed = generator.positions[0] - computed
        sampled = int(batch.loss_mask.sum())
        rendered = int(batch.response_mask.sum()) - sampled
    longest = int(batch.loss_mask.sum(dim=1).max())
    config = generator.config
    generator.config = attrs.evolve(config, max_new_tokens=longest, min_new_tokens=longest)
    try:
        for _ in range(repeats):
            started, one_computed = time.perf_counter(), generator.positions[0]
            generate(trainer.engine, trainer.components, [(batch.prompt_ids, batch.prompt_mask)], greedy=False)
            one_seconds.append(time.perf_counter() - started)
            one_computed = generator.positions[0] - one_computed
    finally:
        generator.config = config
    episodes, one = statistics.median(episode_seconds), statistics.median(one_seconds)
    return {"episodes_seconds": round(episodes, 4), "one_turn_seconds": round(one, 4), "ratio": round(episodes / one, 3),
            "positions_computed": computed, "one_turn_positions": one_computed, "kept_prefix": round(metrics.get("generate/kept_prefix", 0.0), 3),
            "sampled_tokens": sampled, "rendered_tokens": rendered, "one_turn_tokens": longest * len(batch),
            "episode_token_budget": trainer.recipe["environment"].config.max_episode_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output-dir", default="/tmp/rlkit-bench-episodes")
    parser.add_argument("--whole-prefill", action="store_true", help="keep no KV cache between an episode's turns")
    parser.add_argument("--model", default="", help="an hf policy's model folder instead of the recipe's warm start")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the --model policy's weights")
    parser.add_argument("--batch", type=int, default=0, help="episodes an iteration (0: the recipe's)")
    parser.add_argument("--max-turns", type=int, default=0, help="turns an episode (0: the recipe's)")
    parser.add_argument("--max-new-tokens", type=int, default=0, help="sampled tokens a turn (0: the recipe's)")
    parser.add_argument("--episode-tokens", type=int, default=0, help="environment.max_episode_tokens (0: the recipe's)")
    args = parser.parse_args()
    if args.whole_prefill:
        HFGenerator.continuing_streams = Generator.continuing_streams  # pyright: ignore[reportAttributeAccessIssue]
    document = tomllib.loads(RECIPE.read_text())
    document["run"].update({"threads": args.threads, "output_dir": args.output_dir, "device": args.device})
    document["tracker"] = {"type": "none"}
    if args.model:
        document["policy"] = {"type": "hf", "model": args.model, "dtype": args.dtype}
    overrides = {("ppo", "batch_size"): args.batch, ("environment", "max_turns"): args.max_turns,
                 ("generator", "max_new_tokens"): args.max_new_tokens, ("environment", "max_episode_tokens"): args.episode_tokens}
    for (table, key), value in overrides.items():
        if value:
            document[table][key] = value
    trainer = Trainer(parse_recipe(document, load_registry(environ={"RLKIT_PLUGINS": "none"})))
    rows = [trainer.step() for _ in range(args.steps)]
    phases = {name.removeprefix("time/"): round(statistics.median(r[name] for r in rows[1:] or rows), 4) for name in PHASES}
    torch.manual_seed(0)
    print(json.dumps({"recipe": str(RECIPE.name), "threads": args.threads, "kept_streams": not args.whole_prefill, "iterations": args.steps, "phases": phases,
                      "turns": round(statistics.mean(r["env/turns"] for r in rows), 3),
                      "turns_vs_one": turns_against_one(trainer, args.repeats),
                      "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}))


if __name__ == "__main__":
    main()
