"""rlkit on the standard benchmark shape (../shared/bench/README.md), printed as one JSON line.

    python benchmarks/bench_ppo.py --steps 6
    python benchmarks/bench_ppo.py --device cuda --dtype bfloat16 --generator vllm   # on a GPU, with vLLM

Shape: random-init GPT-2 (vocab 384, n_embd 256, 4 layers, 4 heads, 256 positions) with the
byte-level ByT5 tokenizer; 64 prompts of 48 random bytes; 32 sampled tokens at temperature 1 with
no early stop; reward = count of the byte "e"; PPO 4 epochs, minibatch 16, lr 1e-4, adaptive KL
(0.05, target 6, horizon 10000), γ 1, λ 0.95, clips 0.2, vf_coef 0.1.

Prompts are printable ASCII (one token per byte, like the peer's ids 3..258) because rlkit's
prompt sources carry text; the work per iteration is the same.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from pathlib import Path

import torch

PROMPT_BYTES = 48
RESPONSE_TOKENS = 32


def count_e(prompts, responses, **columns):
    return [float(r.count("e")) for r in responses]


def build_inputs(folder: Path, batch: int, steps: int, seed: int) -> tuple[Path, Path]:
    from transformers import ByT5Tokenizer, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=384, n_positions=256, n_embd=256, n_layer=4, n_head=4, bos_token_id=1, eos_token_id=1, pad_token_id=0)
    model_dir = folder / "model"
    GPT2LMHeadModel(config).save_pretrained(model_dir)
    ByT5Tokenizer().save_pretrained(model_dir)
    rng = random.Random(seed)
    prompts = folder / "prompts.jsonl"
    with prompts.open("w") as out:
        for _ in range(batch * steps):
            out.write(json.dumps({"prompt": "".join(chr(rng.randint(33, 126)) for _ in range(PROMPT_BYTES))}) + "\n")
    return model_dir, prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--generator", default="hf", choices=["hf", "vllm"], help="vllm needs vLLM and a CUDA GPU")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="policy weights dtype")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    args = parser.parse_args()

    from rlkit_core.plan import model_size
    from rlkit_core.plugins import load_registry
    from rlkit_core.recipe import parse_recipe
    from rlkit_core.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        model_dir, prompts = build_inputs(Path(tmp), args.batch, args.steps, args.seed)
        document = {
            "run": {"steps": args.steps, "seed": args.seed, "output_dir": str(Path(tmp) / "run"), "device": args.device},
            "ppo": {"batch_size": args.batch, "minibatch_size": 16, "epochs": 4},
            "optim": {"learning_rate": 1e-4, "max_grad_norm": 0.0},
            "policy": {"type": "hf", "model": str(model_dir), "dtype": args.dtype, "gradient_checkpointing": args.gradient_checkpointing},
            "generator": {"type": args.generator, "max_new_tokens": RESPONSE_TOKENS, "min_new_tokens": RESPONSE_TOKENS, "temperature": 1.0},
            "reward": {"type": "python", "function": f"{__file__}:count_e"},
            "kl": {"type": "adaptive", "beta": 0.05, "target": 6.0, "horizon": 10000.0},
            "advantage": {"type": "gae", "gamma": 1.0, "lam": 0.95},
            "loss": {"type": "ppo-clip", "clip": 0.2, "value_clip": 0.2, "vf_coef": 0.1},
            "data": {"type": "jsonl", "path": str(prompts)},
            "tracker": {"type": "none"},
        }
        recipe = parse_recipe(document, load_registry(environ={"RLKIT_PLUGINS": "none"}))
        trainer = Trainer(recipe)
        history = [trainer.step() for _ in range(args.steps)]
        estimate = model_size(recipe)

    steady = history[1:] or history
    per_iteration = statistics.median(h["time/iteration"] for h in steady)
    cuda = torch.device(args.device).type == "cuda"
    print(json.dumps({
        "system": "rlkit",
        "device": args.device,
        "generator": args.generator,
        "dtype": args.dtype,
        "gradient_checkpointing": args.gradient_checkpointing,
        "threads": torch.get_num_threads(),
        "seconds_per_iteration": round(per_iteration, 3),
        "response_tokens_per_second": round(args.batch * RESPONSE_TOKENS / per_iteration, 1),
        "seconds_in": {stage: round(statistics.median(h[f"time/{stage}"] for h in steady), 3) for stage in ("generate", "score", "forward", "train")},
        "mean_score_first_last": [round(history[0]["score/mean"], 3), round(history[-1]["score/mean"], 3)],
        "check_logprob_gap": round(statistics.median(h["check/logprob_gap"] for h in steady), 5),
        "weight_sync_seconds": round(statistics.median(h.get("time/weight_sync", 0.0) for h in steady), 4),
        "memory_estimate": estimate,
        "peak_gpu_memory_mib": round(torch.cuda.max_memory_allocated() / 2**20) if cuda else None,
    }))


if __name__ == "__main__":
    main()
