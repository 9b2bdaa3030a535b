#!/usr/bin/env bash
# The project's test command: sets up ./.venv, then runs the Python tests and the web formatting tests.
# GPU, ComfyUI and browser tests are skipped (with their reason) where their host is absent.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
status=0
.venv/bin/python -m pytest "$@" || status=$?
if ls tests/web/*.test.mjs >/dev/null 2>&1; then
    node --test tests/web/ || status=$?
fi
exit $status
