#!/usr/bin/env bash
# The project's main command: sets up ./.venv, then prints the speed/memory table of every mode.
# Arguments go to `python -m offload_core bench` (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
py=.venv/bin/python
[ -x .venv/Scripts/python.exe ] && py=.venv/Scripts/python.exe  # Windows (Git Bash)
exec "$py" -m offload_core bench "$@"
