#!/usr/bin/env bash
# Creates ./.venv with PyTorch and the project (editable, with its test extra). Safe to run again.
# TORCH_SPEC overrides the torch requirement (default: the CPU build 2.13.0; e.g. TORCH_SPEC=torch for CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/python -m pip install -q --disable-pip-version-check "${TORCH_SPEC:-torch==2.13.0}"
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
