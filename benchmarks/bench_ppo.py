"""rlkit on the standard benchmark shape (benchmarks/README.md), printed as one JSON line.

    python benchmarks/bench_ppo.py --steps 6
    python benchmarks/bench_ppo.py --steps 3 --batch 128           # a scaling point
    python benchmarks/bench_ppo.py --steps 2 --profile 25          # + the top operators of the last iteration
    python benchmarks/bench_ppo.py --device cuda --dtype bfloat16 --generator vllm   # on a GPU, with vLLM

Shape: random-init GPT-2 (vocab 384, n_embd 256, 4 layers, 4 heads, 256 positions) with the
byte-level ByT5 tokenizer; 64 prompts of 48 random bytes; 32 sampled tokens at temperature 1 with
no early stop; reward = count of the byte "e"; PPO 4 epochs, minibatch 16, lr 1e-4, adaptive KL
(0.05, target 6, horizon 10000), γ 1, λ 0.95, clips 0.2, vf_coef 0.1.

`--shape ragged` is the second standard shape, lengths like real data: prompts of 16..256 random
bytes (uniform), responses that end at EOS after 4..128 tokens, so that about half of a batch padded
to its longest prompt and response is padding. EOS is the model's own: `write_model` gives the
random GPT-2 (here with 512 positions and an output layer of its own) a constant lift of the EOS
logit, so that sampling ends a response after about 30 tokens on average (geometrically); the peer
loads the same folder (`--model-dir`, which compare.py writes once). rlkit runs it with token
budgets (`ppo.max_tokens_per_microbatch`, `ppo.max_tokens_per_forward`) and several rollouts
packed into each row (`ppo.pack_sequences`; `--pack off` measures without). The report's
`padding_share` gives, per phase, the share of computed positions that are padding: `before`, as
if every pass were padded to the batch's longest prompt and response (rlkit before trimming),
and `after`, what this run computed.

Prompts are printable ASCII (one token per byte, like the peer's ids 3..258) because rlkit's
prompt sources carry text; the work per iteration is the same.

Besides the time per iteration (wall clock, and the CPU time of this process: on a machine
shared with other work the CPU time is the steadier figure at one thread) it prints the time of
each phase (generate, score, forward = old, reference and value passes, train, tracking =
everything after the update: metrics, metrics.jsonl),
the peak resident memory, an estimate of the FLOPs one iteration needs (`flops_per_iteration`) and
the FLOP rate achieved, and the floor: those FLOPs at the peak rate of a large matrix multiply
timed in the same process (`floor_seconds`, `ratio_to_floor`), and the same in CPU time
(`cpu_ratio_to_floor`: CPU seconds per iteration over the CPU seconds the matmul needs for those
FLOPs), which other work on the machine disturbs far less.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

PROMPT_BYTES = 48
RAGGED = {"prompt": (16, 256), "response": (4, 128), "positions": 512, "eos_lift": 2.6}  # the ragged shape
PHASES = ("generate", "score", "forward", "train", "tracking")


def count_e(prompts, responses, **columns):
    return [float(r.count("e")) for r in responses]


def model_config(args):
    from transformers import GPT2Config

    ragged = args.shape == "ragged"
    return GPT2Config(vocab_size=args.vocab, n_positions=RAGGED["positions"] if ragged else args.positions, n_embd=args.width,
                      n_layer=args.layers, n_head=args.heads, bos_token_id=1, eos_token_id=1, pad_token_id=0,
                      tie_word_embeddings=not ragged)


def write_model(model_dir: Path, args) -> Path:
    """The shape's random GPT-2 and the byte tokenizer. Ragged: the final norm's bias b and the EOS
    row of the output layer get b·w_EOS = eos_lift, a constant lift of the EOS logit at every
    position (b is small against the other rows: their logits move by about 0.02·|b|)."""
    from transformers import ByT5Tokenizer, GPT2LMHeadModel

    torch.manual_seed(args.seed)
    model = GPT2LMHeadModel(model_config(args))
    if args.shape == "ragged":
        with torch.no_grad():
            direction = torch.randn(args.width)
            bias = 3.0 * direction / direction.norm()
            model.transformer.ln_f.bias.copy_(bias)
            model.lm_head.weight[1] += RAGGED["eos_lift"] * bias / bias.square().sum()
    model.save_pretrained(model_dir)
    ByT5Tokenizer().save_pretrained(model_dir)
    return model_dir


def prompt_texts(shape: str, seed: int, count: int) -> list[str]:
    """The shape's prompts, random printable bytes; the peer reads the same ones on the ragged shape."""
    rng = random.Random(seed)
    low, high = RAGGED["prompt"] if shape == "ragged" else (PROMPT_BYTES, PROMPT_BYTES)
    return ["".join(chr(rng.randint(33, 126)) for _ in range(rng.randint(low, high))) for _ in range(count)]


def build_inputs(folder: Path, args) -> tuple[Path, Path]:
    model_dir = Path(args.model_dir) if args.model_dir else write_model(folder / "model", args)
    prompts = folder / "prompts.jsonl"
    with prompts.open("w") as out:
        for text in prompt_texts(args.shape, args.seed, args.batch * args.steps):
            out.write(json.dumps({"prompt": text}) + "\n")
    return model_dir, prompts


def padding_shares(batch, counted: dict) -> dict[str, dict[str, float]]:
    """Per phase, the share of computed positions that are padding: `before`, every pass padded to
    the batch's longest prompt and response (generation: every row of the batch at every step until
    the longest response ends, as transformers' `generate` computes); `after`, what this iteration
    computed (`counted`: (computed, real) positions per phase, from the trainer, and from the `hf`
    generator, which counts the positions its decoding loop runs; None for a generator that does not)."""
    real = float(batch.prompt_mask.sum() + batch.response_mask.sum())
    padded = batch.prompt_mask.numel() + batch.response_mask.numel()
    shares = {phase: {"before": 1 - real / padded, "after": None} for phase in ("generate", "forward", "train")}
    for phase, (computed, kept) in counted.items():
        shares[phase]["after"] = 1 - float(kept) / computed if computed else 0.0
    return {phase: {k: None if v is None else round(v, 3) for k, v in share.items()} for phase, share in shares.items()}


def positions_generated(generator) -> dict[str, tuple]:
    """The generator's (computed, real) positions so far, where it counts them (`hf` does)."""
    return {"generate": generator.positions} if hasattr(generator, "positions") else {}


def iteration_flops(config, batch: int, prompt: int, response: int, epochs: int) -> dict[str, float]:
    """FLOPs one PPO iteration needs on a GPT-2-style model, by phase (multiply-add = 2 FLOPs).

    Counted: the matrix multiplies of the layers (12·d² weights per layer: QKV, output, 4d MLP),
    attention scores and mixing (4·d per attended key, causal: position t attends t + 1 keys), and
    the LM head (2·d·V) only where a distribution is needed: the last prompt position and every
    response position but the last. Elementwise work, norms and the optimiser are left out, so the
    floor is a lower bound. Training = forward + backward = 3 × forward.
    """
    d, layers, vocab = config.n_embd, config.n_layer, config.vocab_size
    # a model folder's own counts (`flop_config`): its layers' matrix weights, its attention's query width
    body = 2 * getattr(config, "layer_weights", 12 * d * d) * layers  # per token
    attend = 4 * getattr(config, "attention_width", d) * layers  # per (token, attended key)
    head = 2 * d * vocab  # per position whose logits are used
    length = prompt + response

    def keys(first: int, last: int) -> int:  # attended keys summed over positions first..last-1
        return sum(t + 1 for t in range(first, last))

    sequence = batch * (body * length + attend * keys(0, length) + head * response)
    generation = batch * (body * (length - 1) + attend * keys(0, length - 1) + head * response)
    return {
        "generate": generation,
        "forward": 2 * sequence,  # old log-probs + values (one pass), reference log-probs
        "train": 3 * epochs * sequence,
    }


def flop_config(args) -> SimpleNamespace:
    """What `iteration_flops` reads, for the shape's GPT-2 or for any causal LM in `--model-dir` (from its
    config alone, on the meta device): width, layers, vocabulary, one layer's matrix weights, attention width."""
    if not args.model_dir:
        config = model_config(args)
        return SimpleNamespace(n_embd=config.n_embd, n_layer=config.n_layer, vocab_size=config.vocab_size)
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(args.model_dir).get_text_config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    embeddings = {id(p) for module in (model.get_input_embeddings(), model.get_output_embeddings()) if module is not None
                  for p in module.parameters()}
    matrices = sum(p.numel() for p in model.parameters() if p.dim() == 2 and id(p) not in embeddings)
    heads, head_dim = config.num_attention_heads, getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return SimpleNamespace(n_embd=config.hidden_size, n_layer=config.num_hidden_layers, vocab_size=config.vocab_size,
                           layer_weights=matrices // config.num_hidden_layers, attention_width=heads * head_dim)


def matmul_peak(device: torch.device, dtype: torch.dtype, repeats: int = 3) -> tuple[float, float]:
    """(FLOP per wall second, FLOP per CPU second of this process) of the fastest of `repeats`
    square matrix multiplies: the floor's rates. 2048² is near a CPU's best; a GPU needs 8192²."""
    size = 8192 if device.type == "cuda" else 2048
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    wall = cpu = float("inf")
    for _ in range(repeats + 1):  # the first warms up
        if device.type == "cuda":
            torch.cuda.synchronize()
        started, cpu_started = time.perf_counter(), time.process_time()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall, cpu = min(wall, time.perf_counter() - started), min(cpu, time.process_time() - cpu_started)
    return 2 * size**3 / wall, 2 * size**3 / cpu


def profile_table(trainer, rows: int) -> str:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        trainer.step()
    return profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--shape", default="standard", choices=["standard", "ragged"])
    parser.add_argument("--model-dir", default="", help="load this model folder (write_model) instead of writing one")
    parser.add_argument("--max-tokens-per-microbatch", type=int, default=-1, help="ppo.max_tokens_per_microbatch (-1: the shape's: 0 standard, 4096 ragged)")
    parser.add_argument("--max-tokens-per-forward", type=int, default=-1,
                        help="ppo.max_tokens_per_forward (-1: the shape's: 0 standard, 16384 ragged: the whole batch of 64 in one piece)")
    parser.add_argument("--pack", default="shape", choices=["shape", "on", "off"], help="ppo.pack_sequences (shape: on for ragged, off for standard)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--minibatch", type=int, default=16, help="ppo.minibatch_size")
    parser.add_argument("--response-len", type=int, default=32, help="standard shape: every response's length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--generator", default="hf", choices=["hf", "vllm"], help="vllm needs vLLM (its CUDA build and a GPU, or its CPU build)")
    parser.add_argument("--vllm-engine", default="in-process", choices=["in-process", "server"],
                        help="generator.engine: vLLM in this process, or a vllm serve process rlkit starts")
    parser.add_argument("--vllm-memory-fraction", type=float, default=0.3, help="generator.gpu_memory_fraction (on vLLM's CPU build: of the machine's memory)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="policy weights dtype")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--width", type=int, default=256, help="n_embd of the random GPT-2")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=384, help="at least 384 (the byte tokenizer's size)")
    parser.add_argument("--positions", type=int, default=256)
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="the device's nominal peak, for train_mfu (0: leave out)")
    parser.add_argument("--profile", type=int, default=0, metavar="ROWS", help="profile one more iteration; print its top operators to stderr")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from rlkit_core.recipe.document import parse_recipe
    from rlkit_core.recipe.plan import memory_parts, model_size
    from rlkit_core.recipe.plugins import load_registry
    from rlkit_core.runtime.forward import PositionCount
    from rlkit_core.runtime.metrics_log import MetricsLog
    from rlkit_core.runtime.trainer import Trainer
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    peaks = [matmul_peak(device, dtype)]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, prompts = build_inputs(Path(tmp), args)
        ragged = args.shape == "ragged"
        micro_budget = args.max_tokens_per_microbatch if args.max_tokens_per_microbatch >= 0 else (4096 if ragged else 0)
        forward_budget = args.max_tokens_per_forward if args.max_tokens_per_forward >= 0 else (16384 if ragged else 0)
        response_len = RAGGED["response"][1] if ragged else args.response_len
        min_len = RAGGED["response"][0] if ragged else args.response_len
        document = {
            "run": {"steps": args.steps, "seed": args.seed, "output_dir": str(Path(tmp) / "run"), "device": args.device,
                    "threads": args.threads},
            "ppo": {"batch_size": args.batch, "minibatch_size": args.minibatch, "epochs": 4, "max_tokens_per_microbatch": micro_budget,
                    "max_tokens_per_forward": forward_budget, "pack_sequences": args.pack == "on" or (args.pack == "shape" and ragged)},
            "optim": {"learning_rate": 1e-4, "max_grad_norm": 0.0},
            "policy": {"type": "hf", "model": str(model_dir), "dtype": args.dtype, "gradient_checkpointing": args.gradient_checkpointing},
            "generator": {"type": args.generator, "max_new_tokens": response_len, "min_new_tokens": min_len, "temperature": 1.0},
            "reward": {"type": "python", "function": f"{__file__}:count_e"},
            "kl": {"type": "adaptive", "beta": 0.05, "target": 6.0, "horizon": 10000.0},
            "advantage": {"type": "gae", "gamma": 1.0, "lam": 0.95},
            "loss": {"type": "ppo-clip", "clip": 0.2, "value_clip": 0.2, "vf_coef": 0.1},
            "data": {"type": "jsonl", "path": str(prompts)},
            "tracker": {"type": "none"},
        }
        if args.generator == "vllm":
            document["generator"].update(gpu_memory_fraction=args.vllm_memory_fraction, engine=args.vllm_engine)
        recipe = parse_recipe(document, load_registry(environ={"RLKIT_PLUGINS": "none"}))
        counter = PositionCount()
        trainer = Trainer(recipe, observe=counter)
        generator, metrics_log = trainer.components.generator, MetricsLog(Path(recipe.run.output_dir) / "metrics.jsonl")
        history = []
        for _ in range(args.steps):
            started, cpu_started = time.perf_counter(), time.process_time()
            counted_before = dict(counter.positions) | positions_generated(generator)
            iteration = trainer.iterate()
            metrics, batch = iteration.metrics, iteration.batch
            counted = {phase: tuple(now - then for now, then in zip(positions[phase], counted_before[phase]))
                       for positions in (counter.positions, positions_generated(generator)) for phase in positions}
            lengths = list(zip(*(t.sum(dim=1).tolist() for t in (batch.prompt_mask, batch.response_mask))))
            stepped = time.perf_counter()
            metrics_log.append(trainer.state.iteration, metrics)
            # tracking: the step's bookkeeping after the update, and writing metrics.jsonl
            metrics["time/tracking"] = (stepped - started - metrics["time/iteration"]) + (time.perf_counter() - stepped)
            metrics["time/cpu"] = time.process_time() - cpu_started
            metrics["padding"] = padding_shares(batch, counted)
            metrics["lengths"] = lengths
            history.append(metrics)
        if args.profile:
            print(profile_table(trainer, args.profile), file=sys.stderr)
        estimate = model_size(recipe)
        longest_prompt = max(p for h in history for p, _ in h["lengths"])
        parts = memory_parts(recipe, int(longest_prompt))
    peaks.append(matmul_peak(device, dtype))

    steady = history[1:] or history
    per_iteration = statistics.median(h["time/iteration"] + h["time/tracking"] for h in steady)
    phases = {phase: statistics.median(h[f"time/{phase}"] for h in steady) for phase in PHASES}
    # the work of the real tokens only: each rollout's own prompt and response, in the median iteration
    config = flop_config(args)
    per_step = [{phase: sum(iteration_flops(config, 1, p, r, 4)[phase] for p, r in h["lengths"]) for phase in ("generate", "forward", "train")}
                for h in steady]
    flops = sorted(per_step, key=lambda f: sum(f.values()))[len(per_step) // 2]
    response_tokens = statistics.median(h["response/length"] * args.batch for h in steady)
    prompt_tokens = statistics.median(sum(p for p, _ in h["lengths"]) for h in steady)
    total_flops, peak, cpu_peak = sum(flops.values()), max(p[0] for p in peaks), max(p[1] for p in peaks)
    floor = total_flops / peak
    cpu_per_iteration = statistics.median(h["time/cpu"] for h in steady)
    cuda = device.type == "cuda"
    tokens = {"generate": response_tokens, "forward": 2 * (prompt_tokens + response_tokens), "train": 4 * (prompt_tokens + response_tokens)}
    report = {
        "system": "rlkit",
        "device": args.device,
        "generator": args.generator + (f" ({args.vllm_engine})" if args.generator == "vllm" else ""),
        "dtype": args.dtype,
        "gradient_checkpointing": args.gradient_checkpointing,
        "threads": torch.get_num_threads(),
        "shape": args.shape,
        "batch": args.batch,
        "response_len": args.response_len,
        "steps": args.steps,
        "max_tokens_per_microbatch": micro_budget,
        "max_tokens_per_forward": forward_budget,
        "pack_sequences": recipe.ppo.pack_sequences,
        "mean_prompt_tokens": round(prompt_tokens / args.batch, 1),
        "mean_response_tokens": round(response_tokens / args.batch, 1),
        "seconds_per_iteration": round(per_iteration, 3),
        "response_tokens_per_second": round(response_tokens / per_iteration, 1),
        "cpu_seconds_per_iteration": round(cpu_per_iteration, 3),
        "seconds_in": {phase: round(seconds, 4) for phase, seconds in phases.items()},
        "tokens_per_second_in": {phase: round(tokens[phase] / phases[phase], 1) for phase in tokens},
        "flops_per_iteration": {phase: f"{value:.3e}" for phase, value in flops.items()} | {"total": f"{total_flops:.3e}"},
        "achieved_tflops": round(total_flops / per_iteration / 1e12, 4),
        "train_tflops": round(flops["train"] / phases["train"] / 1e12, 4),
        "matmul_peak_tflops": round(peak / 1e12, 4),
        "floor_seconds": round(floor, 3),
        "ratio_to_floor": round(per_iteration / floor, 2),
        "cpu_ratio_to_floor": None if cuda else round(cpu_per_iteration / (total_flops / cpu_peak), 2),
        "padding_share": {phase: {when: None if steady[0]["padding"][phase][when] is None
                                  else statistics.median(h["padding"][phase][when] for h in steady) for when in ("before", "after")}
                          for phase in ("generate", "forward", "train")},
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "mean_score_first_last": [round(history[0]["score/mean"], 3), round(history[-1]["score/mean"], 3)],
        "check_logprob_gap": round(statistics.median(h["check/logprob_gap"] for h in steady), 5),
        "weight_sync_seconds": round(statistics.median(h.get("time/weight_sync", 0.0) for h in steady), 4),
        "memory_estimate": estimate,
        # `rlkit check`'s estimate of this process's peak, for the longest prompt seen, against torch's count on a GPU
        "estimate_peak_mib": None if parts is None else round(parts[0]["peak"] / 2**20),
        "peak_gpu_memory_mib": round(torch.cuda.max_memory_allocated() / 2**20) if cuda else None,
        "train_vs_matmul": round(flops["train"] / phases["train"] / peak, 4),
    }
    if args.peak_tflops:
        report["train_mfu"] = round(flops["train"] / phases["train"] / (args.peak_tflops * 1e12), 4)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
