#!/usr/bin/env bash
# PPO throughput on one GPU: a ~0.5B-parameter random-init GPT-2 (width 1280, 24 layers, 20 heads,
# 472M weights in the layers; the byte-level tokenizer's 384-token vocabulary), built offline,
# bfloat16 weights, the `hf` generator, 64 prompts of 48 bytes, 128 sampled tokens, PPO 4 epochs
# of minibatch 16. Prints bench_ppo.py's JSON line: `tokens_per_second_in` (generate, forward,
# train), `train_tflops`, `train_mfu` (training FLOP/s over the nominal dense bf16 peak,
# PEAK_TFLOPS, default 989 for an H100/H200 SXM) and the ratio to a bf16 8192² matmul measured
# in the same process. Then the same model on the ragged shape (prompts of 16..256 bytes,
# responses ending at EOS after 4..128 tokens; packed rows and token budgets sized for a GPU).
#
#     bash benchmarks/gpu_bench.sh            # from the repository root, in the project's venv
#
# A few minutes on one GPU. Not yet run: no GPU was lent when it was written (2026-11-30).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
"$PYTHON" benchmarks/bench_ppo.py --device cuda --dtype bfloat16 --generator hf --steps "${STEPS:-3}" \
    --width 1280 --layers 24 --heads 20 --batch "${BATCH:-64}" --response-len "${RESPONSE_LEN:-128}" \
    --peak-tflops "${PEAK_TFLOPS:-989}"
"$PYTHON" benchmarks/bench_ppo.py --device cuda --dtype bfloat16 --generator hf --steps "${STEPS:-3}" --shape ragged \
    --width 1280 --layers 24 --heads 20 --batch "${BATCH:-64}" --max-tokens-per-microbatch 8192 --max-tokens-per-forward 16384 \
    --peak-tflops "${PEAK_TFLOPS:-989}"
