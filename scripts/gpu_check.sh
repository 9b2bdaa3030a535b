#!/usr/bin/env bash
# GPU checks in one go, then one summary table; exit status 1 if any check failed (a test, a tier or benchmark
# row that is not bit-exact against the gpu tier, a step that crashed), 0 otherwise.
#
#   1. the `gpu` tests under the CUDA stream sanitizer (TORCH_CUDA_SANITIZER=1 reports unsynchronized access
#      between streams), then without it;
#   2. the demo round trip through every tier (32 layers x 2 x 32 MiB);
#   3. the benchmark at full size (`bench --size full`: Qwen-Image 2.1 and FLUX.2 [klein] 9B KV at their real
#      widths, 1024x1024, one reference), every row checked bit for bit against the gpu row;
#   4. `bench --batch --size full` for both pipelines: a batch of 4 from one prompt against a batch of 1 in gpu,
#      ram_async and file_async, identical rows kept once and not (bytes kept, moved per step, latency), each
#      batch-4 row checked bit for bit against the one without dedup (~1.5 min per pipeline, estimated);
#   5. `bench --pose --size full`: Wan Animate 2's pose-branch cache at Wan 14B's width (5120, 40 blocks,
#      480x832, bf16) for a short clip (POSE_FRAMES, default 17: 5 latent frames, 76 MiB a block, 3.0 GiB),
#      in gpu, RAM, files and RAM under a budget that spills, every block taken checked bit for bit
#      (estimated ~1 min: 6 rows of 3 passes; the file rows move ~12 GiB each, ~6 s at 2 GB/s);
#   6. the streaming benchmark (`python -m offload_core stream`), where this version of the engine has it.
#
# Time on one H100-class GPU, about 12 minutes. Estimated from DESIGN section 6 (A100, Qwen-Image 2.1, 1024^2,
# 40 steps): 18.33 s with the cache on the GPU is ~0.46 s a step; an H100 does ~2x, so ~0.23 s a cached step
# and ~0.46 s for the extracting one. The transfers do not speed up: per step, ram_sync adds ~0.16 s, warm
# file_sync ~0.9 s, cold file_sync ~2.8 s and cold file_async ~2.4 s (the seed's 24.86 / 55.20 / 128.41 /
# 103.71 s over 40 steps, less compute). At --steps 4 one round of the 9 rows is ~33 s (the cold file rows
# ~19 s of it); 1 warm-up + 2 timed rounds ~100 s per pipeline, plus ~20 s to build each model: ~4 min for
# both. The tests take ~1.5 min under the sanitizer (it hooks every kernel launch) and ~40 s without, the
# demo seconds, the pose cache at most POSE_TIMEOUT (240 s), the streaming benchmark at most STREAM_TIMEOUT
# (150 s; 3 rounds of ~50 one-GiB passes, estimated ~25 s on a 7 GB/s NVMe drive). Each step has a time limit,
# so a hang shows as a failed row instead of a stuck script. Override with BENCH_STEPS / BENCH_RUNS.
#
# Uses the current python if it has CUDA torch, else sets up ./.venv with TORCH_SPEC. Extra arguments go to
# both benchmark runs (e.g. --modes gpu,ram_async). Results and logs: $GPU_CHECK_OUT (default gpu-check/).
set -uo pipefail  # not -e: every step runs, the summary decides the exit status
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    TORCH_SPEC=${TORCH_SPEC:-torch} bash scripts/setup.sh || exit 1
    py=.venv/bin/python
fi
"$py" -m pip install -q -e ".[test]" >/dev/null 2>&1 || echo "note: could not install the test extra; using what is installed"
out=${GPU_CHECK_OUT:-gpu-check}
rm -rf "$out" && mkdir -p "$out" || exit 1
steps=${BENCH_STEPS:-4}
runs=${BENCH_RUNS:-2}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true

# step NAME SECONDS COMMAND...: runs COMMAND with a time limit, its output shown and kept in $out/NAME.log,
# its exit status in $out/NAME.rc (124: over the limit).
step() {
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*"
    timeout --signal=INT --kill-after=30 "$limit" "$@" 2>&1 | tee "$out/$name.log"
    echo "${PIPESTATUS[0]}" > "$out/$name.rc"
}

suites=(tests/core tests/nodes)
with_diffusers=0
if "$py" -c "import diffusers, transformers" 2>/dev/null; then
    suites+=(tests/diffusers)
    with_diffusers=1
else
    echo "note: diffusers/transformers missing: skipping the diffusers GPU tests and the benchmark"
fi
step sanitizer 300 env TORCH_CUDA_SANITIZER=1 "$py" -m pytest -q -m gpu --junitxml="$out/sanitizer.xml" "${suites[@]}"
step tests 180 "$py" -m pytest -q -m gpu --junitxml="$out/tests.xml" "${suites[@]}"
step demo 120 "$py" -m offload_core demo --device cuda --layers 32 --mib 32
if [ "$with_diffusers" = 1 ]; then
    for pipeline in qwen21 flux2; do
        step "bench-$pipeline" 420 "$py" -m offload_core bench --size full --pipeline "$pipeline" --device cuda \
            --steps "$steps" --runs "$runs" --json "$out/bench-$pipeline.json" "$@"
    done
    for pipeline in qwen21 flux2; do  # identical batch rows kept once: batch 4 against 1, dedup on and off
        step "batch-$pipeline" 420 "$py" -m offload_core bench --batch --size full --pipeline "$pipeline" \
            --device cuda --steps "$steps" --runs 1 --json "$out/batch-$pipeline.json"
    done
fi
step pose "${POSE_TIMEOUT:-240}" "$py" -m offload_core bench --pose --size full --frames "${POSE_FRAMES:-17}" \
    --device cuda --runs "$runs" --json "$out/pose.json"
step stream "${STREAM_TIMEOUT:-150}" "$py" -m offload_core stream --device cuda --rounds 3
echo
"$py" scripts/gpu_summary.py "$out"
