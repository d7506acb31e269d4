"""A per-process memory estimate for `rlkit check`, from the model's shape and the recipe's sizes.

Peak = weights + gradients + optimiser state + the largest of the three stages' working memory:
generation (KV cache and one step's logits), the no-grad forward passes (policy and
reference logits) and the update (activations of one micro-batch). Under DDP every process holds
all of it; nothing is sharded. The activation terms follow Korthikanti et al. 2022 ("Reducing
Activation Recomputation in Large Transformer Models"): per layer and token about 34·h bytes at
16 bits plus 5·heads·tokens bytes of attention scores; with gradient checkpointing a layer keeps
only its input. benchmarks/README.md compares the estimate with measured peaks.
"""

from __future__ import annotations

import attrs

MiB = 2**20


@attrs.frozen
class ModelShape:
    parameters: int  # every weight the policy holds (the base, with LoRA)
    trainable: int  # what the optimiser updates (the adapters, with LoRA)
    layers: int
    hidden: int
    heads: int
    vocab: int
    weight_bytes: int  # bytes per weight in policy.dtype
    reference_copy: bool  # a frozen copy of the weights for the reference (no LoRA)


@attrs.frozen
class Workload:
    micro_batch: int  # rollouts per micro-batch in one process
    forward_batch: int  # rollouts per no-grad forward pass
    generate_batch: int  # prompts per generate call
    prompt_tokens: int
    response_tokens: int
    checkpointing: bool
    mixed_precision: str  # "no", "bf16" or "fp16"
    shards: int = 1  # processes FSDP splits the policy over (1: not sharded)
    micro_tokens: int = 0  # ppo.max_tokens_per_microbatch: positions per micro-batch instead of micro_batch rows (0: off)
    forward_tokens: int = 0  # ppo.max_tokens_per_forward, likewise for forward_batch


def estimate(shape: ModelShape, work: Workload) -> dict[str, int]:
    """Bytes per process, by part; "peak" is the sum of the resident parts and the largest stage."""
    s = shape
    tokens = work.prompt_tokens + work.response_tokens
    act = 2 if work.mixed_precision != "no" else s.weight_bytes  # bytes per activation value
    policy = s.parameters * s.weight_bytes
    n = work.shards
    weights = policy // n + (policy if s.reference_copy else 0)
    gradients = s.trainable * s.weight_bytes // n
    optimiser = 2 * s.trainable * s.weight_bytes // n  # AdamW's two moments, in the weights' dtype
    gathered = policy - policy // n  # the rest of the policy, gathered for generation and the no-grad passes
    block = policy // s.layers if n > 1 else 0  # about one block gathered at a time in the update

    def per_layer(rows: float) -> int:  # saved for backward by one layer, Korthikanti et al. scaled to `act` bytes
        return int(rows * tokens * s.hidden * (34 + 5 * s.heads * tokens // s.hidden) * act // 2)

    # With a token budget a piece holds at most budget positions; at the longest length that is
    # budget / tokens rows, the most memory (attention grows with the square of the length).
    m = work.micro_tokens / tokens if work.micro_tokens else work.micro_batch
    stored = int(m * tokens * s.hidden * act * s.layers) + per_layer(m) if work.checkpointing else per_layer(m) * s.layers
    # the logits of every position and the float32 scaled copy and log-softmax of the response
    # positions, each with its gradient at the start of the backward pass
    head = int(2 * m * tokens * s.vocab * act + 4 * m * work.response_tokens * s.vocab * 4)
    f = work.forward_tokens / tokens if work.forward_tokens else work.forward_batch
    forward = int(2 * f * tokens * s.vocab * act + 2 * f * work.response_tokens * s.vocab * 4)  # policy and reference
    g = work.generate_batch
    # the KV cache, and one step's float32 scores with the few copies sampling makes of them
    # (probabilities, noise, log-softmax): the `hf` loop keeps no step's scores past that step
    generate = 2 * s.layers * g * tokens * s.hidden * act + 4 * g * s.vocab * 4
    stages = {"update": stored + head + block, "forward": forward + gathered, "generate": generate + gathered}
    return {"weights": weights, "gradients": gradients, "optimiser": optimiser, **stages,
            "peak": weights + gradients + optimiser + max(stages.values())}


def describe(parts: dict[str, int], shards: int = 1) -> list[str]:
    """The estimate as plan lines, in MiB."""
    largest = max(("update", "forward", "generate"), key=lambda stage: parts[stage])
    lines = [
        f"about {parts['peak'] / MiB:,.0f} MiB per process at the peak ({largest} stage), before framework overhead:",
        f"  weights {parts['weights'] / MiB:,.0f}, gradients {parts['gradients'] / MiB:,.0f}, "
        f"optimiser state {parts['optimiser'] / MiB:,.0f} MiB",
        f"  working memory: update {parts['update'] / MiB:,.0f} (one micro-batch), "
        f"forward {parts['forward'] / MiB:,.0f}, generate {parts['generate'] / MiB:,.0f} MiB",
    ]
    if shards > 1:
        lines.append(f"  FSDP over {shards} processes: this process's shards of the policy, its gradients and optimiser "
                     "state (a reference copy is whole); forward and generate hold the whole policy gathered, update one block")
    return lines
