#!/usr/bin/env bash
# The project's main command: sets up ./.venv, then prints the speed/memory table of every mode.
# Arguments go to `python -m offload_core bench` (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m offload_core bench "$@"
