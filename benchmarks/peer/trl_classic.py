"""The peer on the standard benchmark shape: TRL 0.11.4's classic PPOTrainer, printed as one JSON line.

Runs in the peer's own environment (`bash benchmarks/peer/setup.sh`), never in rlkit's:

    benchmarks/peer/.venv/bin/python benchmarks/peer/trl_classic.py --steps 4

The work is the one `bench_ppo.py` does for rlkit (the standard shape of benchmarks/README.md): a random-init
GPT-2 (vocab 384, n_embd 256, 4 layers, 4 heads, 256 positions) over the byte-level ByT5
tokenizer, 64 prompts of 48 random byte ids, 32 sampled tokens at temperature 1 with no top-k,
top-p or early stop, reward = number of "e" bytes (id 104) in the response, PPO with 4 epochs of
minibatch 16, lr 1e-4, adaptive KL (0.05, target 6, horizon 10000), γ 1, λ 0.95, clips 0.2,
vf_coef 0.1. TRL's value head sits on the policy's trunk, as rlkit's `shared` head does.

`--shape ragged --model-dir DIR` is the ragged shape: the model folder bench_ppo.py's `write_model`
wrote (compare.py writes it once for both sides), the prompts bench_ppo.py's `prompt_texts` makes
for rlkit (16..256 random printable bytes, the same texts on both sides), responses sampled until
the model's own EOS after 4..128 tokens (TRL cuts each response after its EOS).

The time of an iteration runs from the call that samples to the end of `step` (TRL's whole
update, statistics included), on the wall clock and in this process's CPU time; each figure is the
median over the iterations after the first.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

SCORED_BYTE = 104  # "e" in ByT5's ids (byte value + 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=48)
    parser.add_argument("--response-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shape", default="standard", choices=["standard", "ragged"])
    parser.add_argument("--model-dir", default="", help="load this model folder (the ragged shape's) instead of a fresh random one")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import ByT5Tokenizer, GPT2Config, GPT2LMHeadModel
    from trl import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer

    torch.manual_seed(args.seed)
    tokenizer = ByT5Tokenizer()
    tokenizer.padding_side = "left"
    shape = GPT2Config(vocab_size=384, n_positions=256, n_embd=256, n_layer=4, n_head=4, bos_token_id=1, eos_token_id=1)
    ragged = args.shape == "ragged"
    if ragged and not args.model_dir:
        parser.error("--shape ragged needs --model-dir (compare.py writes it with bench_ppo.write_model)")
    with tempfile.TemporaryDirectory() as folder:
        if not args.model_dir:
            GPT2LMHeadModel(shape).save_pretrained(folder)
        policy = AutoModelForCausalLMWithValueHead.from_pretrained(args.model_dir or folder)
        reference = AutoModelForCausalLMWithValueHead.from_pretrained(args.model_dir or folder)
    config = PPOConfig(
        batch_size=args.batch, mini_batch_size=16, ppo_epochs=4, learning_rate=1e-4,
        init_kl_coef=0.05, adap_kl_ctrl=True, target=6, horizon=10000,
        gamma=1.0, lam=0.95, cliprange=0.2, cliprange_value=0.2, vf_coef=0.1, seed=args.seed, log_with=None,
    )
    trainer = PPOTrainer(config, policy, reference, tokenizer)
    low, high = (4, 128) if ragged else (args.response_len, args.response_len)
    sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=high, min_new_tokens=low, pad_token_id=0)

    if ragged:  # bench_ppo.py is plain Python at import: its prompt maker runs in this environment too
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from bench_ppo import prompt_texts

        texts = prompt_texts("ragged", args.seed, args.batch * args.steps)
    rows = []
    for step in range(args.steps):
        if ragged:  # ByT5's ids are the bytes + 3
            queries = [torch.tensor([byte + 3 for byte in text.encode()]) for text in texts[step * args.batch:(step + 1) * args.batch]]
        else:
            queries = list(torch.randint(3, 259, (args.batch, args.prompt_len)))
        started, cpu_started = time.perf_counter(), time.process_time()
        responses = trainer.generate(queries, return_prompt=False, batch_size=args.batch, **sampling)
        generated = time.perf_counter()
        scores = [(response == SCORED_BYTE).sum().float() for response in responses]
        stats = trainer.step(queries, responses, scores)
        finished = time.perf_counter()
        rows.append({
            "response_tokens": sum(len(response) for response in responses),
            "iteration": finished - started,
            "cpu": time.process_time() - cpu_started,
            "generate": generated - started,
            "forward": stats["time/ppo/forward_pass"],
            "train": stats["time/ppo/optimize_step"],
            "score": float(stats["ppo/mean_scores"]),
        })

    steady = rows[1:] or rows
    per_iteration = statistics.median(row["iteration"] for row in steady)
    print(json.dumps({
        "system": "trl-0.11.4-classic",
        "threads": torch.get_num_threads(),
        "batch": args.batch,
        "response_len": args.response_len,
        "steps": args.steps,
        "seconds_per_iteration": round(per_iteration, 3),
        "shape": args.shape,
        "mean_response_tokens": round(statistics.median(row["response_tokens"] for row in steady) / args.batch, 1),
        "response_tokens_per_second": round(statistics.median(row["response_tokens"] for row in steady) / per_iteration, 1),
        "cpu_seconds_per_iteration": round(statistics.median(row["cpu"] for row in steady), 3),
        "seconds_in": {phase: round(statistics.median(row[phase] for row in steady), 4) for phase in ("generate", "forward", "train")},
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "mean_score_first_last": [round(rows[0]["score"], 3), round(rows[-1]["score"], 3)],
    }))


if __name__ == "__main__":
    main()
