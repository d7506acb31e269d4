"""The peer on one of robustness.py's tasks: TRL 0.11.4's classic PPOTrainer, one seed, one JSON line.

Runs in the peer's own environment (`bash benchmarks/peer/setup.sh`); robustness.py writes the
task's files (model directory, prompts.jsonl, a reward file) and calls it with `--peer`:

    benchmarks/peer/.venv/bin/python benchmarks/peer/trl_task.py --model M --prompts P.jsonl \\
        --reward R.py:score --steps 30 --seed 0 --settings '{"batch_size": 100, ...}'

The settings are the rlkit recipe's, mapped onto PPOConfig (batch, minibatch, epochs, lr, KL,
γ, λ, clips, vf_coef); everything else is TRL's own default (no gradient clipping, a random
value head with dropout). Each iteration takes the next batch of prompts from a seeded shuffle
of the file, samples at temperature 1 with no top-k or top-p up to `max_new_tokens`, stopping at
EOS, and scores the decoded responses (special tokens skipped) with the same reward function.
Prints the score of every iteration.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import time

import torch


def load_reward(spec: str):
    path, name = spec.rsplit(":", 1)
    module_spec = importlib.util.spec_from_file_location("peer_reward", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return getattr(module, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--reward", required=True, help="FILE.py:function(prompts, responses) -> scores")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--settings", default="{}", help="JSON: batch_size, minibatch_size, epochs, learning_rate, "
                        "kl_beta, kl_adaptive, kl_target, gamma, lam, clip, value_clip, vf_coef, max_new_tokens; max_grad_norm only when given")
    args = parser.parse_args()
    torch.set_num_threads(1)
    s = json.loads(args.settings)

    from transformers import AutoTokenizer
    from trl import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer

    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.padding_side = "left"
    policy = AutoModelForCausalLMWithValueHead.from_pretrained(args.model)
    reference = AutoModelForCausalLMWithValueHead.from_pretrained(args.model)
    batch = s.get("batch_size", 64)
    config = PPOConfig(
        batch_size=batch, mini_batch_size=s.get("minibatch_size", 16), ppo_epochs=s.get("epochs", 4),
        learning_rate=s.get("learning_rate", 1e-5), init_kl_coef=s.get("kl_beta", 0.05),
        adap_kl_ctrl=s.get("kl_adaptive", True), target=s.get("kl_target", 6.0), horizon=10000,
        gamma=s.get("gamma", 1.0), lam=s.get("lam", 0.95), cliprange=s.get("clip", 0.2),
        cliprange_value=s.get("value_clip", 0.2), vf_coef=s.get("vf_coef", 0.1), seed=args.seed, log_with=None,
        max_grad_norm=s.get("max_grad_norm"),  # None, TRL's default: no clipping
    )
    trainer = PPOTrainer(config, policy, reference, tokenizer)
    reward = load_reward(args.reward)
    prompts = [json.loads(line)["prompt"] for line in open(args.prompts) if line.strip()]
    random.Random(args.seed).shuffle(prompts)
    sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=s.get("max_new_tokens", 8),
                    pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    scores_by_iteration, started = [], time.perf_counter()
    for step in range(args.steps):
        chosen = [prompts[(step * batch + i) % len(prompts)] for i in range(batch)]
        queries = [torch.tensor(tokenizer(p, add_special_tokens=False).input_ids) for p in chosen]
        responses = trainer.generate(queries, return_prompt=False, batch_size=batch, **sampling)
        texts = [tokenizer.decode(r, skip_special_tokens=True) for r in responses]
        scores = reward(chosen, texts)
        trainer.step(queries, list(responses), [torch.tensor(float(x)) for x in scores])
        scores_by_iteration.append(sum(scores) / len(scores))
    print(json.dumps({"system": "trl-0.11.4-classic", "seed": args.seed, "seconds": round(time.perf_counter() - started, 1),
                      "scores": [round(x, 4) for x in scores_by_iteration]}))


if __name__ == "__main__":
    main()
