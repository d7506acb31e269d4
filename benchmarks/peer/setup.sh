#!/usr/bin/env bash
# Create the peer's virtual environment, apart from rlkit's (its pins conflict with rlkit's):
#
#     bash benchmarks/peer/setup.sh            # -> benchmarks/peer/.venv (about 2 minutes)
#
# PEER_VENV chooses another folder; compare.py reads the same variable.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${PEER_VENV:-$here/.venv}"
python3 -m venv "$venv"
"$venv/bin/pip" install -q -r "$here/requirements.txt"
"$venv/bin/python" -c "import torch, transformers, trl; print('peer venv ready:', '$venv', '| torch', torch.__version__, '| transformers', transformers.__version__, '| trl', trl.__version__)"
