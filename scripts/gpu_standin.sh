#!/usr/bin/env bash
# scripts/gpu_check.sh against a CPU-only stand-in of a bare GPU host: a python with torch, transformers,
# safetensors, psutil and xxhash but no diffusers and no pytest, and no network (a network namespace of its own,
# `unshare -n`: Linux, as root or with user namespaces), the wheel folder the only source of what it lacks.
#
#   bash scripts/gpu_standin.sh
#
# Builds the stand-in's python in .gpu-standin/ and the wheel folder (scripts/gpu_wheels.sh) for its Python
# version: both need a package index, once. Then runs the whole check on the CPU, at the tiny size, with every
# step's limit times 4 (a CPU is slower than the GPU the limits are set for). Results: gpu-check-standin/.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
host=.gpu-standin
if ! "$host/bin/python" -c "import torch, transformers, safetensors, psutil, xxhash" 2>/dev/null; then
    rm -rf "$host"
    "$python" -m venv "$host"
    "$host/bin/python" -m pip install -q --disable-pip-version-check "${TORCH_SPEC:-torch==2.13.0}" transformers \
        safetensors psutil xxhash
fi
for absent in diffusers pytest; do
    if "$host/bin/python" -c "import $absent" 2>/dev/null; then
        echo "gpu_standin.sh: the stand-in has $absent; it must lack it (remove $host and run again)" >&2; exit 1
    fi
done
version=$("$host/bin/python" -c "import sys; print(f'{sys.version_info.major}.{sys.version_info.minor}')")
bash scripts/gpu_wheels.sh --python "$version" --out gpu-wheels
unshare -n env PYTHON="$host/bin/python" GPU_CHECK_DEVICE=cpu GPU_CHECK_SIZE=tiny GPU_CHECK_MARK="not gpu" \
    GPU_CHECK_K=test_round_trip_is_bit_identical_in_put_order GPU_CHECK_STREAM_ARGS="--rounds 1 --cache-mib 128" \
    GPU_CHECK_LIMIT_SCALE=4 GPU_CHECK_BUDGET=2400 GPU_CHECK_OUT=gpu-check-standin BENCH_STEPS=2 \
    bash scripts/gpu_check.sh "$@"
