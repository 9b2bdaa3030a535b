#!/usr/bin/env bash
# Creates ./.venv with PyTorch and the project (editable, with its test extra). Safe to run again: once set
# up, a later run with the same pyproject.toml and the same knobs installs nothing and needs no network.
#
# Knobs (environment variables):
#   PYTHON       the interpreter that creates .venv (default python3; must be 3.10 or newer)
#   TORCH_SPEC   the torch requirement (default torch==2.13.0)
#   TORCH_INDEX  the index torch is installed from (default: none, i.e. pip's configured index). Which build
#                that gives is the index's choice: on PyPI, Linux x86_64 gets the CUDA build (with about 17
#                nvidia-* wheels, several GB); macOS and Windows get the CPU build (with MPS on Apple silicon).
#                For a CPU-only build on Linux: TORCH_INDEX=https://download.pytorch.org/whl/cpu
#                For one CUDA version:          TORCH_INDEX=https://download.pytorch.org/whl/cu128
# torch is installed only when .venv has none; to switch builds, remove .venv (or pip-install into it).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
torch_spec=${TORCH_SPEC:-torch==2.13.0}
torch_index=${TORCH_INDEX:-}
stamp=.venv/.kv-offload-setup
# .venv's interpreter: bin/ on Linux and macOS, Scripts/ on Windows (Git Bash).
vpy() { if [ -x .venv/Scripts/python.exe ]; then echo .venv/Scripts/python.exe; else echo .venv/bin/python; fi; }

# What the stamp records: everything that decides what gets installed (the interpreter is .venv's own).
key() { { cat pyproject.toml; echo "$torch_spec|$torch_index"; "$(vpy)" --version; } | sha256sum | cut -d' ' -f1; }
if [ -x "$(vpy)" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$(key)" ] \
        && "$(vpy)" -c "import offload_core, torch" 2>/dev/null; then
    echo "setup.sh: .venv is up to date (pyproject.toml unchanged); nothing to install."
    exit 0
fi
if [ ! -x "$(vpy)" ]; then
    if ! "$python" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' 2>/dev/null; then
        echo "setup.sh: needs Python 3.10 or newer; '$python' is $("$python" --version 2>&1 || echo 'not found')." \
             "Set PYTHON=/path/to/python3.10+ and run again." >&2
        exit 1
    fi
    "$python" -m venv .venv || { echo "setup.sh: '$python -m venv' failed; on Debian/Ubuntu install python3-venv." >&2; exit 1; }
fi
pip=("$(vpy)" -m pip install -q --disable-pip-version-check)
if ! "$(vpy)" -c "import torch" 2>/dev/null; then
    where=${torch_index:-"the configured package index"}
    echo "setup.sh: installing $torch_spec from $where into .venv"
    "${pip[@]}" ${torch_index:+--index-url "$torch_index"} "$torch_spec"
fi
"${pip[@]}" -e ".[test]"
"$(vpy)" -c "import torch; print('setup.sh: .venv has torch', torch.__version__, '(CUDA', torch.version.cuda, end=')\n')"
key > "$stamp"
