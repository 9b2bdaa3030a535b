#!/usr/bin/env bash
# GPU checks in one go (< 5 minutes on one GPU): the `gpu` tests under the CUDA stream sanitizer, then a short
# timing of every tier and the benchmark's table on the device.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    TORCH_SPEC=${TORCH_SPEC:-torch} bash scripts/setup.sh
    py=.venv/bin/python
fi
"$py" -m pip install -q -e ".[test]" >/dev/null 2>&1 || true
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
TORCH_CUDA_SANITIZER=1 "$py" -m pytest -q -m gpu tests/
"$py" -m pytest -q -m gpu tests/
"$py" -m offload_core demo --device cuda --layers 32 --mib 32
"$py" -m offload_core bench --device cuda --runs 3 "$@"
