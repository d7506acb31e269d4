#!/usr/bin/env bash
# The wheels rlkit needs on the GPU machine beyond what its image holds, for benchmarks/gpu_run.py.
#
#     bash benchmarks/gpu_wheels.sh         # here, with network: into .gpu-wheels/ (ignored by git), then its size
#
# That machine's python3 is 3.12 (x86-64) with torch 2.11 (CUDA 13), transformers 5, accelerate, peft, pluggy,
# attrs, filelock, tqdm, tokenizers and jinja2 (/work/.library/device/KINDS.md, 2026-11), and reaches no registry.
# Brought: cattrs, which rlkit imports and the image lacks, with attrs and typing-extensions at the versions of
# this venv (cattrs 26 asks for attrs >= 25.4 and typing-extensions >= 4.14; the image's are not known), and
# setuptools, the build backend of `pip install --no-build-isolation -e .` there (rlkit asks for >= 69).
# Left out: mlflow, which only the `mlflow` tracker imports: it and what it needs beyond the image measured
# 35.5 MiB in 46 wheels (mlflow 3.18.0, 2026-12-07), half of what a device call carries, each pinned by nothing
# here against the image's own packages; the GPU run's recipes use the `none` tracker instead.
# One version of each name (pip refuses two); --no-deps: the rest of what they need is on the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
DEST="${DEST:-.gpu-wheels}"
version() { "$PYTHON" -c "import importlib.metadata as m; print(m.version('$1'))"; }
WHEELS=("cattrs==$(version cattrs)" "attrs==$(version attrs)" "typing-extensions==$(version typing_extensions)"
        "setuptools==${SETUPTOOLS:-80.9.0}")
rm -rf "$DEST"
mkdir -p "$DEST"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$DEST" "${WHEELS[@]}"
ls -l "$DEST"
du -sh "$DEST"
