"""How reliably PPO learns: the same recipe over several seeds, reporting the mean, median and worst.

    python benchmarks/robustness.py                       # every task, 5 seeds each
    python benchmarks/robustness.py --task control --seeds 3 --set ppo.batch_size=64
    python benchmarks/robustness.py --task warm-target --peer   # TRL 0.11.4 classic on the same files and seeds

Each task runs through rlkit's public surface (a recipe, `run_recipe`):
- `summarize`: the default recipe (recipes/ppo_summarize.toml) on its cached warm start; the seed
  changes sampling, prompt order and the held-out choice, not the warm start. Figure: the recipe's
  held-out evaluation after the last iteration (its reward on sampled summaries, and its eval
  metrics: exact summaries, facts copied, ROUGE-1), with the figures before training beside it.
- `control`: a task whose optimum is known. A tiny random GPT-2 (byte-level) writes 8 bytes after a
  random string; the reward is the share of them that are lowercase letters, so 1.0 is the best any
  policy can do; no KL penalty, so that 1.0 is also the objective's optimum. 60 iterations.
- `warm-lowercase`, `warm-target`, `warm-long`: the same tiny GPT-2 fine-tuned for a moment on
  responses right at about half their bytes (8 lowercase letters; the fixed string "pqrstuvw";
  the 16-byte "pqrstuvwxyzklmno"; the wrong bytes of the last two drawn from their own string),
  then PPO with the settings of TRL's classic example (batch 100, minibatch 25, 4 epochs, lr 3e-4,
  no KL, GAE λ 0.95, value clip 0.2, vf_coef 1.2). Optimum 1.0. 30 iterations.
Figure of the last four: the mean training score over the last max(5, 10%) iterations.

One JSON line per task: per-seed figures, mean, median, worst, and seconds per run. A seed that
collapses (learns, then falls and stays down) shows as a worst far below the median. `--history`
keeps every iteration's metrics (gradient norm before clipping, share of steps clipped, explained
variance, approx KL, clip fractions, entropy, advantage scale before whitening).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
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
        # no KL penalty: with the default β 0.05 the best the objective allows is a lowercase share of
        # 0.475 (π* ∝ π_ref·exp(r/β) per token; the random model puts 0.069 of its mass on lowercase bytes)
        "kl": {"type": "fixed", "beta": 0.0},
        "policy": {"type": "hf", "model": str(model)},
        "generator": {"max_new_tokens": 8},
        "reward": {"type": "python", "function": f"{reward}:lowercase_share"},
        "data": {"type": "jsonl", "path": str(prompts)},
        "tracker": {"type": "none"},
    }


# Warm-started tasks: a tiny byte-level GPT-2 fine-tuned briefly on responses that are right about
# half the time (the same warm start for every seed), then PPO with the peer's own settings.
LETTERS = "abcdfghij"  # the prompts' letters
TARGET = "pqrstuvw"  # warm-target's one right response, none of the prompts' letters
LONG_TARGET = "pqrstuvwxyzklmno"  # warm-long's, 16 bytes
WARM_REWARDS = {
    # every one of the 8 response bytes a lowercase letter; the warm start writes half of them so
    "warm-lowercase": """
def score(prompts, responses):
    return [sum(c.islower() for c in r[:8]) / 8 for r in responses]
""",
    # the response is TARGET, byte for byte; the warm start gets about half of its bytes right
    "warm-target": """
def score(prompts, responses):
    return [sum(a == b for a, b in zip("pqrstuvw", r[:8])) / 8 for r in responses]
""",
    # 16 bytes: the response is LONG_TARGET, byte for byte
    "warm-long": """
def score(prompts, responses):
    return [sum(a == b for a, b in zip("pqrstuvwxyzklmno", r[:16])) / 16 for r in responses]
""",
}
PEER_SETTINGS = {  # TRL classic's own example settings, as the issue measured them
    "ppo": {"batch_size": 100, "minibatch_size": 25, "epochs": 4},
    "optim": {"learning_rate": 3e-4},
    "kl": {"type": "fixed", "beta": 0.0},
    "advantage": {"type": "gae", "gamma": 1.0, "lam": 0.95},
    "loss": {"type": "ppo-clip", "clip": 0.2, "value_clip": 0.2, "vf_coef": 1.2},
}
WARM_START_STEPS = 300  # supervised steps of the warm start (a few seconds)


def warm_response(task: str, prompt: str, rng: random.Random) -> str:
    """A supervised response that is right at about half of its 8 bytes."""
    if task == "warm-lowercase":
        return "".join(rng.choice(LETTERS) if rng.random() < 0.5 else rng.choice("ABCDEFGH0123") for _ in range(8))
    if task == "warm-long":
        return "".join(c if rng.random() < 0.5 else rng.choice(LONG_TARGET) for c in LONG_TARGET)
    return "".join(c if rng.random() < 0.5 else rng.choice(TARGET) for c in TARGET)


def warm_prompts(rng: random.Random, n: int) -> list[str]:
    return ["".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 12))) for _ in range(n)]


WARM_STARTS: dict[str, Path] = {}  # task -> its warm start, built once a process


def write_warm_start(task: str, path: Path) -> Path:
    """The tiny GPT-2 of `write_tiny_causal_lm`, fine-tuned on `warm_response`s (prompt, response,
    EOS; loss on the response only), seed 0 whatever the run's seed."""
    if task in WARM_STARTS:
        shutil.copytree(WARM_STARTS[task], path)
        return path
    import torch
    from transformers import AutoTokenizer, GPT2LMHeadModel

    from rlkit_core.testing import write_tiny_causal_lm

    write_tiny_causal_lm(path)
    model, tokenizer = GPT2LMHeadModel.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    rng, optimizer = random.Random(0), torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for _ in range(WARM_START_STEPS):
        rows, labels = [], []
        for prompt in warm_prompts(rng, 32):
            prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
            response_ids = tokenizer(warm_response(task, prompt, rng), add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
            rows.append(prompt_ids + response_ids)
            labels.append([-100] * len(prompt_ids) + response_ids)
        width = max(map(len, rows))
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        target = torch.tensor([r + [-100] * (width - len(r)) for r in labels])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        loss = model(input_ids=ids, attention_mask=mask, labels=target).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(path)
    WARM_STARTS[task] = Path(tempfile.mkdtemp(prefix=f"rlkit-{task}-"))
    shutil.copytree(path, WARM_STARTS[task], dirs_exist_ok=True)
    return path


def warm_files(task: str, seed: int, folder: Path) -> tuple[Path, Path, Path]:
    """(model, prompts.jsonl, reward file) of a warm-started task; the prompts depend on the seed."""
    model = write_warm_start(task, folder / "model")
    rng = random.Random(seed)
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in warm_prompts(rng, 512)))
    reward = folder / "reward.py"
    reward.write_text(WARM_REWARDS[task])
    return model, prompts, reward


def warm_document(task: str):
    def document(seed: int, folder: Path, steps: int) -> dict:
        model, prompts, reward = warm_files(task, seed, folder)
        return {
            "run": {"steps": steps, "seed": seed, "output_dir": str(folder / "run")},
            **PEER_SETTINGS,
            "policy": {"type": "hf", "model": str(model)},
            "generator": {"max_new_tokens": 16 if task == "warm-long" else 8},
            "reward": {"type": "python", "function": f"{reward}:score"},
            "data": {"type": "jsonl", "path": str(prompts)},
            "tracker": {"type": "none"},
        }
    return document


TASKS = {"summarize": (summarize_document, 0), "control": (control_document, 60),  # 0: the recipe's own
         "warm-lowercase": (warm_document("warm-lowercase"), 30), "warm-target": (warm_document("warm-target"), 30),
         "warm-long": (warm_document("warm-long"), 30)}


def figures(task: str, history: list[dict]) -> dict[str, float]:
    training = [h for h in history if "score/mean" in h]
    tail = training[-max(5, len(training) // 10):]
    result = {"train_score_tail": statistics.fmean(h["score/mean"] for h in tail)}
    evaluations = [h for h in history if "eval/score" in h]
    if evaluations:
        result.update({f"heldout_{k[5:]}": v for k, v in evaluations[-1].items() if k.startswith("eval/")})
        result.update({f"heldout_{k[5:]}_before": v for k, v in evaluations[0].items() if k.startswith("eval/")})
    return result


def summary(task: str, system: str, key: str, rows: list[dict], steps: int, overrides: list[str]) -> dict:
    values = [r[key] for r in rows]
    return {"task": task, "system": system, "figure": key, "mean": round(statistics.fmean(values), 4),
            "median": round(statistics.median(values), 4), "worst": round(min(values), 4),
            "steps": steps, "overrides": overrides, "runs": rows}


def run_task(task: str, seeds: list[int], steps: int, overrides: list[str], history_dir: Path | None = None) -> dict:
    from rlkit_core.recipe.document import apply_overrides, parse_recipe
    from rlkit_core.recipe.plugins import load_registry
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
        if history_dir:  # every iteration's metrics, for the diagnostics
            history_dir.mkdir(parents=True, exist_ok=True)
            (history_dir / f"{task}_seed{seed}.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history))
        print(json.dumps({"task": task, **rows[-1]}), file=sys.stderr, flush=True)
    key = "heldout_score" if "heldout_score" in rows[0] else "train_score_tail"
    return summary(task, "rlkit", key, rows, steps, overrides)


def peer_settings(document: dict) -> dict:
    """The recipe's PPO settings as trl_task.py takes them; rlkit's defaults where the recipe is silent."""
    from rlkit_core.recipe.document import parse_recipe
    from rlkit_core.recipe.plugins import load_registry

    recipe = parse_recipe(document, load_registry())
    ppo, optim, kl, advantage, loss = recipe.ppo, recipe.optim, recipe["kl"], recipe["advantage"].config, recipe["loss"].config
    return {"batch_size": ppo.batch_size, "minibatch_size": ppo.minibatch_size, "epochs": ppo.epochs,
            "learning_rate": optim.learning_rate, "kl_beta": kl.config.beta, "kl_adaptive": kl.component.name == "adaptive",
            "kl_target": getattr(kl.config, "target", 6.0), "gamma": advantage.gamma, "lam": advantage.lam,
            "clip": loss.clip, "value_clip": loss.value_clip, "vf_coef": loss.vf_coef,
            "max_new_tokens": recipe["generator"].config.max_new_tokens}


def run_peer(task: str, seeds: list[int], steps: int, overrides: list[str], python: str) -> dict:
    """The same task files and seeds through TRL 0.11.4's classic PPOTrainer (benchmarks/peer/trl_task.py)."""
    from rlkit_core.recipe.document import apply_overrides

    build, _ = TASKS[task]
    rows = []
    for seed in seeds:
        with tempfile.TemporaryDirectory() as tmp:
            document = apply_overrides(build(seed, Path(tmp), steps), overrides)
            model, prompts, reward = document["policy"]["model"], document["data"]["path"], document["reward"]["function"]
            command = [python, str(ROOT / "benchmarks" / "peer" / "trl_task.py"), "--model", model, "--prompts", prompts,
                       "--reward", reward, "--steps", str(steps), "--seed", str(seed), "--settings", json.dumps(peer_settings(document))]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            scores = json.loads(out.strip().splitlines()[-1])["scores"]
        tail = scores[-max(5, len(scores) // 10):]
        rows.append({"seed": seed, "train_score_tail": statistics.fmean(tail), "scores": scores})
        print(json.dumps({"task": task, "system": "peer", **rows[-1]}), file=sys.stderr, flush=True)
    return summary(task, "trl-0.11.4-classic", "train_score_tail", rows, steps, overrides)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=[*TASKS, "all"], default="all")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=0, help="iterations per run (0: the task's default; the recipe's for summarize)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="recipe override for every run, as in rlkit run --set")
    parser.add_argument("--peer", action="store_true", help="run TRL 0.11.4 classic on the same tasks and seeds instead (not summarize)")
    parser.add_argument("--peer-python", default=str(ROOT / "benchmarks" / "peer" / ".venv" / "bin" / "python"))
    parser.add_argument("--history", type=Path, help="write every run's per-iteration metrics here, one jsonl per task and seed")
    args = parser.parse_args()
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    for task in TASKS if args.task == "all" else [args.task]:
        steps = args.steps or TASKS[task][1]
        if args.peer:
            print(json.dumps(run_peer(task, seeds, steps, args.overrides, args.peer_python)), flush=True)
        else:
            print(json.dumps(run_task(task, seeds, steps, args.overrides, args.history)), flush=True)


if __name__ == "__main__":
    main()
