"""`rlkit check`'s memory estimate against the measured peak, on a GPT-2-small-sized random model
(12 layers, width 768, vocabulary 50257, 124M parameters; built offline) with and without LoRA and gradient
checkpointing. Each case runs one PPO iteration (two optimiser steps, so that the second backward
pass meets the AdamW state) in a fresh process and reports the growth of its
peak resident memory from just before the trainer is built; on a GPU, read torch.cuda's peak
instead. Prints one JSON line per case.

    python benchmarks/memory.py
    python benchmarks/memory.py --fsdp    # full fine-tuning under FSDP over 2 processes: one line per process

Under FSDP the run goes through tests/fsdp_on_cpu.py (accelerate selects FSDP on GPUs only; that
launcher selects accelerate's own FSDP state on CPUs), and each process reports its own peak.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

FSDP_ON_CPU = Path(__file__).parents[1] / "tests" / "fsdp_on_cpu.py"

CASES = [(0, False), (0, True), (8, False), (8, True)]  # (lora_r, gradient_checkpointing)
PROMPT_TOKENS = RESPONSE_TOKENS = 32
BATCH = 8


def resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def document(folder: Path, lora_r: int, checkpointing: bool) -> dict:
    return {
        "run": {"steps": 1, "seed": 0, "output_dir": str(folder / "run"), "threads": 2},
        "ppo": {"batch_size": BATCH, "minibatch_size": BATCH, "epochs": 2},  # the 2nd backward meets AdamW state
        "policy": {"type": "hf", "model": str(folder / "model"), "lora_r": lora_r, "gradient_checkpointing": checkpointing},
        "generator": {"max_new_tokens": RESPONSE_TOKENS, "min_new_tokens": RESPONSE_TOKENS},
        "reward": {"type": "python", "function": f"{folder / 'reward.py'}:count_e"},
        "data": {"type": "jsonl", "path": str(folder / "prompts.jsonl")},
        "tracker": {"type": "none"},
    }


def one_case(folder: Path, lora_r: int, checkpointing: bool) -> dict:
    from rlkit_core.memory import Workload, estimate
    from rlkit_core.recipe.document import parse_recipe
    from rlkit_core.recipe.plan import memory_estimate  # noqa: F401  (imports before the baseline)
    from rlkit_core.recipe.plugins import load_registry
    from rlkit_core.runtime.trainer import Trainer

    recipe = parse_recipe(document(folder, lora_r, checkpointing), load_registry(environ={"RLKIT_PLUGINS": "none"}))
    shape = recipe["policy"].component.factory.shape(recipe["policy"].config)
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    sharded = os.environ.get("ACCELERATE_USE_FSDP") == "true"
    local = BATCH // processes  # each process's rollouts
    work = Workload(micro_batch=local, forward_batch=local, generate_batch=local, prompt_tokens=PROMPT_TOKENS,
                    response_tokens=RESPONSE_TOKENS, checkpointing=checkpointing, mixed_precision="no",
                    shards=processes if sharded else 1)
    parts = estimate(shape, work)
    before = resident_bytes()
    trainer = Trainer(recipe)
    built = resident_bytes() - before
    trainer.step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    mib = 2**20
    return {"lora_r": lora_r, "gradient_checkpointing": checkpointing, "processes": processes, "fsdp": sharded,
            "process": trainer.engine.processes.index,
            # before the first step only the weights are resident (AdamW allocates its state at the first step)
            "estimate_weights_mib": round(parts["weights"] / mib), "measured_after_build_mib": round(built / mib),
            "estimate_peak_mib": round(parts["peak"] / mib), "measured_peak_mib": round(peak / mib),
            "estimate_update_mib": round(parts["update"] / mib)}


def prepare(folder: Path) -> None:
    """GPT-2 small's shape (124M parameters) with a word-level tokenizer over GPT-2's 50257 ids
    (`w2` ... `w50256`), built offline; every id the model samples decodes."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = GPT2Config(bos_token_id=1, eos_token_id=1, pad_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(folder / "model")
    words = Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, config.vocab_size)}}, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>").save_pretrained(folder / "model")
    prompt = " ".join(f"w{i}" for i in range(2, 2 + PROMPT_TOKENS))  # one token per word
    (folder / "prompts.jsonl").write_text("".join(json.dumps({"prompt": prompt}) + "\n" for _ in range(BATCH)))
    (folder / "reward.py").write_text("def count_e(prompts, responses):\n    return [r.count('w5') for r in responses]\n")


def main() -> None:
    if len(sys.argv) == 4:
        result = one_case(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1")
        print(json.dumps(result), flush=True)
        if result["processes"] > 1:
            os._exit(0)  # as `rlkit run` does: tearing down gloo at exit can abort a process
        return
    fsdp = sys.argv[1:] == ["--fsdp"]
    with tempfile.TemporaryDirectory() as folder:
        prepare(Path(folder))
        for lora_r, checkpointing in [(0, False), (0, True)] if fsdp else CASES:
            case = [folder, str(lora_r), "1" if checkpointing else "0"]
            if fsdp:
                sys.path.insert(0, str(FSDP_ON_CPU.parent))
                from fsdp_on_cpu import launch_environment

                command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(FSDP_ON_CPU), __file__, *case]
                done = subprocess.run(command, capture_output=True, text=True, check=True, env={**os.environ, **launch_environment()})
            else:
                done = subprocess.run([sys.executable, __file__, *case], capture_output=True, text=True, check=True)
            for line in done.stdout.strip().splitlines():
                if line.startswith("{"):
                    print(line, flush=True)


if __name__ == "__main__":
    main()
