#!/usr/bin/env bash
# GPU checks in one go (< 5 minutes on one GPU): the `gpu` tests under the CUDA stream sanitizer (which reports
# unsynchronized access between streams), then without it, a short timing of every tier, and the benchmark's
# table on the device. Uses the current python if it has CUDA torch, else sets up ./.venv with TORCH_SPEC.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    TORCH_SPEC=${TORCH_SPEC:-torch} bash scripts/setup.sh
    py=.venv/bin/python
fi
"$py" -m pip install -q -e ".[test]" >/dev/null 2>&1 || echo "note: could not install the test extra; using what is installed"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
suites=(tests/core tests/nodes)
if "$py" -c "import diffusers, transformers" 2>/dev/null; then
    suites+=(tests/diffusers)
    with_diffusers=1
else
    echo "note: diffusers/transformers missing: skipping the diffusers GPU tests and the benchmark"
    with_diffusers=0
fi
TORCH_CUDA_SANITIZER=1 "$py" -m pytest -q -m gpu "${suites[@]}"
"$py" -m pytest -q -m gpu "${suites[@]}"
"$py" -m offload_core demo --device cuda --layers 32 --mib 32
if [ "$with_diffusers" = 1 ]; then
    "$py" -m offload_core bench --device cuda --runs 3 "$@"
fi
