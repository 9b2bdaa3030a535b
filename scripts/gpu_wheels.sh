#!/usr/bin/env bash
# Makes the wheel folder from which scripts/gpu_check.sh installs what a GPU host lacks, on a host that reaches
# no package index. Run it on a machine that reaches one; then copy the folder into the checkout on the host
# (default gpu-wheels/, which gpu_check.sh looks for; or GPU_CHECK_WHEELS=DIR there).
#
#   bash scripts/gpu_wheels.sh [--python X.Y] [--arch x86_64|aarch64] [--out DIR]
#
# It holds diffusers and pytest, at the versions pyproject.toml's test extra names, with everything they need,
# and pip itself (the host needs none): binary wheels for one CPython version (default 3.12) on Linux. Not torch,
# transformers or the NVIDIA libraries: the host brings those (the check uses the python that has CUDA torch).
# At most 64 MiB; it fails, saying so, if a resolution comes out larger.
set -euo pipefail
cd "$(dirname "$0")/.."
pyver=3.12 arch=x86_64 out=gpu-wheels
while [ $# -gt 0 ]; do
    case $1 in
        --python) pyver=$2; shift 2 ;;
        --arch) arch=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        *) echo "gpu_wheels.sh: unknown option '$1'; the options are --python X.Y, --arch x86_64|aarch64, --out DIR" >&2
           exit 2 ;;
    esac
done
if ! [[ $pyver =~ ^3\.[0-9]+$ ]]; then
    echo "gpu_wheels.sh: --python must be a CPython version like 3.12; got '$pyver'" >&2; exit 2
fi
if [ "$arch" != x86_64 ] && [ "$arch" != aarch64 ]; then
    echo "gpu_wheels.sh: --arch must be x86_64 or aarch64; got '$arch'" >&2; exit 2
fi
py=${PYTHON:-python3}
[ -x .venv/bin/python ] && py=.venv/bin/python
# The requirements as the test extra writes them (gpu_env.py reads the same lines on the host).
mapfile -t needs < <("$py" -c "import sys; sys.path.insert(0, 'scripts'); import gpu_env as g
print(g.test_extra_spec('diffusers')); print(g.test_extra_spec('pytest'))")
abi=cp${pyver/./}
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1 linux; do
    platforms+=(--platform "${tag}_${arch}")
done
tmp=$(mktemp -d "${out%/}.tmp.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
"$py" -m pip download -q --disable-pip-version-check --only-binary=:all: --python-version "$pyver" \
    --implementation cp --abi "$abi" --abi abi3 --abi none "${platforms[@]}" -d "$tmp" "${needs[@]}" pip
size=$(du -sm "$tmp" | cut -f1)
if [ "$size" -gt 64 ]; then
    echo "gpu_wheels.sh: the folder came out at $size MiB, over the 64 MiB it may take; nothing written" >&2
    exit 1
fi
rm -rf "$out" && mv "$tmp" "$out"
trap - EXIT
echo "gpu_wheels.sh: $out: $(ls "$out" | wc -l) wheels, $size MiB, for CPython $pyver on Linux $arch (${needs[*]}, pip)"
