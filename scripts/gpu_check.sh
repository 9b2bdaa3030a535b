#!/usr/bin/env bash
# GPU checks in one go, then one summary table; exit status 1 if any check failed (a test, a tier or benchmark
# row that is not bit-exact against the gpu tier, a step that crashed), 0 otherwise.
#
#   0. the environment: the host's CUDA torch, what it lacks from the wheel folder (below);
#   1. the `gpu` tests under the CUDA stream sanitizer (TORCH_CUDA_SANITIZER=1 reports unsynchronized access
#      between streams), and last, if the budget still reaches it, without it;
#   2. the demo round trip through every tier (32 layers x 2 x 32 MiB);
#   3. the benchmark at full size (`bench --size full`: Qwen-Image 2.1 and FLUX.2 [klein] 9B KV at their real
#      widths, 1024x1024, one reference), every row checked bit for bit against the gpu row;
#   4. `bench --batch --size full` for both pipelines: a batch of 4 from one prompt against a batch of 1 in gpu,
#      ram_async and file_async, identical rows kept once and not (bytes kept, moved per step, latency), each
#      batch-4 row checked bit for bit against the one without dedup;
#   5. `bench --pose --size full`: Wan Animate 2's pose-branch cache at Wan 14B's width (5120, 40 blocks,
#      480x832, bf16) for a short clip (POSE_FRAMES, default 17: 5 latent frames, 76 MiB a block, 3.0 GiB),
#      in gpu, RAM, files and RAM under a budget that spills, every block taken checked bit for bit;
#   6. the AR video cache at Wan 2.1 1.3B layer shapes (`python -m offload_core arvideo`, 81 frames, every mode);
#   7. the streaming benchmark (`python -m offload_core stream`), where this version of the engine has it.
#
# Within 10 minutes on one H100/H200-class GPU: the whole check has a budget (GPU_CHECK_BUDGET, 570 s) and
# each step a time limit of its own, cut to what is left of the budget; a step the budget no longer reaches is
# not started and fails in the summary ("not run: the time budget ran out"), so a hang or a slow step shows as
# a failed row, never as a stuck script. The limits are estimates (no GPU was at hand when they were set): from
# DESIGN section 6 (A100, Qwen-Image 2.1, 1024^2: ~0.46 s a cached step; an H100 ~2x faster), one round of the
# 9 bench rows at --steps 4 is ~33 s, plus ~20 s to build each model at full size; BENCH_RUNS=1 timed round
# after the warm-up. Override with BENCH_STEPS / BENCH_RUNS / GPU_CHECK_BUDGET.
#
# Installs nothing from a network. It uses the python that has CUDA torch (PYTHON, else the first of python3,
# python, python3.13 ... python3.10 on PATH that has it); what that python lacks of the check's needs
# (diffusers, pytest) comes from a wheel folder made beforehand by `scripts/gpu_wheels.sh` on a machine with a
# package index (GPU_CHECK_WHEELS, default gpu-wheels/), installed by `scripts/gpu_env.py` into an environment
# of the check's own that sees the host's packages; the host's python is not changed.
#
# A CPU-only stand-in of such a host (to check all of the above without a GPU): GPU_CHECK_DEVICE=cpu runs every
# step on the CPU (the tests without the sanitizer, the demo at 4 MiB a layer); GPU_CHECK_SIZE=tiny runs the
# benchmarks at the tiny size; GPU_CHECK_LIMIT_SCALE multiplies every step's limit; GPU_CHECK_MARK and
# GPU_CHECK_K select the tests (pytest's -m, default "gpu", and -k); GPU_CHECK_STREAM_ARGS are the streaming
# benchmark's options (default --rounds 3 --sweep-mib 64: its pattern sweep moves 38 patterns x 3 passes of
# the sweep file a round, 29 GiB at the 256 MiB default, which would not fit in the step's limit on most disks). Extra arguments go to both benchmark runs (e.g. --modes
# gpu,ram_async). Results and logs: $GPU_CHECK_OUT (default gpu-check/).
set -uo pipefail  # not -e: every step runs, the summary decides the exit status
cd "$(dirname "$0")/.."
device=${GPU_CHECK_DEVICE:-cuda}
size=${GPU_CHECK_SIZE:-full}
budget=${GPU_CHECK_BUDGET:-570}
scale=${GPU_CHECK_LIMIT_SCALE:-1}  # every step's limit times this (the CPU stand-in is slower)
wheels=${GPU_CHECK_WHEELS:-gpu-wheels}
out=${GPU_CHECK_OUT:-gpu-check}
steps=${BENCH_STEPS:-4}
runs=${BENCH_RUNS:-1}
select=(-m "${GPU_CHECK_MARK:-gpu}")
[ -n "${GPU_CHECK_K:-}" ] && select+=(-k "$GPU_CHECK_K")
deadline=$((SECONDS + budget))
rm -rf "$out" && mkdir -p "$out" || exit 1

has_torch() {  # has_torch PYTHON: torch with a CUDA device (or any torch, for the CPU stand-in)
    local want="torch.cuda.is_available()"
    [ "$device" = cpu ] && want="True"
    "$1" -c "import torch, sys; sys.exit(0 if $want else 1)" 2>/dev/null
}
host_py=${PYTHON:-}
if [ -z "$host_py" ]; then
    for candidate in python3 python python3.13 python3.12 python3.11 python3.10; do
        if command -v "$candidate" >/dev/null && has_torch "$candidate"; then host_py=$candidate; break; fi
    done
fi
if [ -z "$host_py" ] || ! has_torch "$host_py"; then
    echo "gpu_check.sh: no python with CUDA torch found (${host_py:-python3, python, python3.13 ... python3.10});" \
         "set PYTHON=/path/to/python" >&2
    exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true

# step NAME SECONDS COMMAND...: runs COMMAND with a time limit (cut to what is left of the budget), its output
# shown and kept in $out/NAME.log, its exit status in $out/NAME.rc (124: over the limit); a step the budget no
# longer reaches leaves $out/NAME.budget instead.
step() {
    local name=$1 limit=$(($2 * scale)) left=$((deadline - SECONDS - 10))
    shift 2
    [ "$limit" -gt "$left" ] && limit=$left
    if [ "$limit" -lt 5 ]; then
        echo "== $name: not run, the time budget ($budget s) ran out" | tee "$out/$name.budget"
        return
    fi
    echo "== $name (at most $limit s): $*"
    timeout --signal=INT --kill-after=20 "$limit" "$@" 2>&1 | tee "$out/$name.log"
    echo "${PIPESTATUS[0]}" > "$out/$name.rc"
}

step env 120 "$host_py" scripts/gpu_env.py --wheels "$wheels" --env "$out/env" --device "$device"
py=$(sed -n 's/^python: //p' "$out/env.log" | tail -1)
if [ -z "$py" ] || [ "$(cat "$out/env.rc")" != 0 ]; then
    echo
    "$host_py" scripts/gpu_summary.py "$out"
    exit 1
fi
suites=(tests/core tests/nodes)
with_diffusers=0
if "$py" -c "import diffusers, transformers" 2>/dev/null; then
    suites+=(tests/diffusers)
    with_diffusers=1
else
    echo "note: transformers missing on the host: skipping the diffusers tests and the benchmark"
fi
# In order of what matters most; each limit is a cap, the budget decides what is reached.
sanitizer=(env TORCH_CUDA_SANITIZER=1)
[ "$device" = cpu ] && sanitizer=(env -u TORCH_CUDA_SANITIZER)  # the sanitizer needs CUDA: plain on the stand-in
demo_mib=32
[ "$device" = cpu ] && demo_mib=4
step sanitizer 150 "${sanitizer[@]}" "$py" -m pytest -q "${select[@]}" --junitxml="$out/sanitizer.xml" \
    "${suites[@]}"
step demo 30 "$py" -m offload_core demo --device "$device" --layers 32 --mib "$demo_mib"
if [ "$with_diffusers" = 1 ]; then
    for pipeline in qwen21 flux2; do
        step "bench-$pipeline" 90 "$py" -m offload_core bench --size "$size" --pipeline "$pipeline" \
            --device "$device" --steps "$steps" --runs "$runs" --json "$out/bench-$pipeline.json" "$@"
    done
    # The prefix reuse key at real size: reading 9B of weights and the model's code, against what a hit saves.
    step reuse-key 60 "$py" -m offload_core bench --size "$size" --pipeline flux2 --device "$device" \
        --steps "$steps" --runs 1 --modes ram_async,rerun --json "$out/reuse-key.json"
    for pipeline in qwen21 flux2; do  # identical batch rows kept once: batch 4 against 1, dedup on and off
        step "batch-$pipeline" 50 "$py" -m offload_core bench --batch --size "$size" --pipeline "$pipeline" \
            --device "$device" --steps "$steps" --runs 1 --json "$out/batch-$pipeline.json"
    done
fi
step pose "${POSE_TIMEOUT:-60}" "$py" -m offload_core bench --pose --size "$size" --frames "${POSE_FRAMES:-17}" \
    --device "$device" --runs "$runs" --json "$out/pose.json"
# The AR video cache (Causal-WAN) on the engine alone: Wan 2.1 1.3B layer shapes, 81 frames at 480x832 (5.6 GiB
# bf16), blocks of 3 latent frames, 4 + 1 forwards a block, every mode; the tiny size: a 9-frame 96x160 video.
ar_size=(--frames "${ARVIDEO_FRAMES:-81}")
[ "$size" = tiny ] && ar_size=(--frames 9 --height 96 --width 160)
step arvideo "${ARVIDEO_TIMEOUT:-120}" "$py" -m offload_core arvideo --model 1.3b "${ar_size[@]}" --device "$device" \
    --json "$out/arvideo.json"
read -r -a stream_args <<< "${GPU_CHECK_STREAM_ARGS:---rounds 3 --sweep-mib 64}"
step stream "${STREAM_TIMEOUT:-45}" "$py" -m offload_core stream --device "$device" "${stream_args[@]}"
step tests 45 "$py" -m pytest -q "${select[@]}" --junitxml="$out/tests.xml" "${suites[@]}"
# ComfyUI's multi-GPU sampling (MultiGPU CFG Split): one thread per GPU, a copy of the model on each
gpus=$("$py" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "${gpus:-0}" -ge 2 ]; then
    step multigpu 60 "$py" -m pytest -q tests/nodes/test_multigpu.py tests/nodes/test_multigpu_families.py -k two_cuda --junitxml="$out/multigpu.xml"
else
    echo "== multigpu: skipped, this host has ${gpus:-0} GPU(s) and the case needs 2" | tee "$out/multigpu.skipped"
fi
echo
"$py" scripts/gpu_summary.py "$out"
