"""How reliably PPO learns: the same recipe over several seeds, reporting the mean and the worst.

    python benchmarks/robustness.py                       # both tasks, 5 seeds each
    python benchmarks/robustness.py --task control --seeds 3 --set ppo.batch_size=64

Two tasks, each run through rlkit's public surface (a recipe, `run_recipe`):
- `summarize`: the default recipe (recipes/ppo_summarize.toml) on its cached warm start; the seed
  changes sampling, prompt order and the held-out choice, not the warm start. Figure: the recipe's
  held-out evaluation after the last iteration (its reward on sampled summaries, and its eval
  metrics: exact summaries, facts copied, ROUGE-1), with the figures before training beside it.
- `control`: a task whose optimum is known. A tiny random GPT-2 (byte-level) writes 8 bytes after a
  random string; the reward is the share of them that are lowercase letters, so 1.0 is the best any
  policy can do. Figure: the mean training score over the last 10% of iterations.

One JSON line per task: per-seed figures, mean, worst, and seconds per run. A seed that collapses
(learns, then falls and stays down) shows as a worst far below the mean.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONTROL_REWARD = '''
def lowercase_share(prompts, responses):
    return [sum(c.islower() for c in r[:8]) / 8 for r in responses]
'''


def summarize_document(seed: int, folder: Path, steps: int) -> dict:
    from rlkit_core.recipe.document import tomllib

    document = tomllib.loads((ROOT / "recipes" / "ppo_summarize.toml").read_text())
    document["run"].update(seed=seed, output_dir=str(folder / "run"), checkpoint_every=0)
    if steps:
        document["run"]["steps"] = steps
    document["tracker"] = {"type": "none"}
    return document


def control_document(seed: int, folder: Path, steps: int) -> dict:
    from rlkit_core.testing import write_tiny_causal_lm

    model = write_tiny_causal_lm(folder / "model")  # the same random model for every seed
    rng = random.Random(seed)
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": "".join(rng.choice("abcdfghij") for _ in range(rng.randint(3, 12)))}) + "\n"
                               for _ in range(512)))
    reward = folder / "control_reward.py"
    reward.write_text(CONTROL_REWARD)
    return {
        "run": {"steps": steps, "seed": seed, "output_dir": str(folder / "run")},
        "ppo": {"batch_size": 32, "minibatch_size": 8, "epochs": 4},
        "optim": {"learning_rate": 1e-3},
        "policy": {"type": "hf", "model": str(model)},
        "generator": {"max_new_tokens": 8},
        "reward": {"type": "python", "function": f"{reward}:lowercase_share"},
        "data": {"type": "jsonl", "path": str(prompts)},
        "tracker": {"type": "none"},
    }


TASKS = {"summarize": (summarize_document, 0), "control": (control_document, 200)}  # 0: the recipe's own


def figures(task: str, history: list[dict]) -> dict[str, float]:
    training = [h for h in history if "score/mean" in h]
    tail = training[-max(1, len(training) // 10):]
    result = {"train_score_last10pct": statistics.fmean(h["score/mean"] for h in tail)}
    evaluations = [h for h in history if "eval/score" in h]
    if evaluations:
        result.update({f"heldout_{k[5:]}": v for k, v in evaluations[-1].items() if k.startswith("eval/")})
        result.update({f"heldout_{k[5:]}_before": v for k, v in evaluations[0].items() if k.startswith("eval/")})
    return result


def run_task(task: str, seeds: list[int], steps: int, overrides: list[str]) -> dict:
    from rlkit_core.recipe.plugins import load_registry
    from rlkit_core.recipe.document import apply_overrides, parse_recipe
    from rlkit_core.runtime.run import run_recipe

    build, _ = TASKS[task]
    registry = load_registry()
    rows = []
    for seed in seeds:
        with tempfile.TemporaryDirectory() as tmp:
            document = apply_overrides(build(seed, Path(tmp), steps), overrides)
            started = time.perf_counter()
            with open("/dev/null", "w") as silent:
                history = run_recipe(parse_recipe(document, registry), quiet=True, out=silent)
            rows.append({"seed": seed, "seconds": round(time.perf_counter() - started, 1), **figures(task, history)})
        print(json.dumps({"task": task, **rows[-1]}), file=sys.stderr, flush=True)
    key = "heldout_score" if "heldout_score" in rows[0] else "train_score_last10pct"
    values = [r[key] for r in rows]
    return {"task": task, "figure": key, "mean": round(statistics.fmean(values), 4), "worst": round(min(values), 4),
            "steps": steps, "overrides": overrides, "runs": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=[*TASKS, "both"], default="both")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=0, help="iterations per run (0: the task's default; the recipe's for summarize)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="recipe override for every run, as in rlkit run --set")
    args = parser.parse_args()
    for task in TASKS if args.task == "both" else [args.task]:
        steps = args.steps or TASKS[task][1]
        print(json.dumps(run_task(task, list(range(args.seeds)), steps, args.overrides)), flush=True)


if __name__ == "__main__":
    main()
