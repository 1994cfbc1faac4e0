#!/bin/bash
# The whole suite. pytest's exit 5 (no tests collected) is a failure here, never a pass.
set -uo pipefail
cd "$(dirname "$0")/.."
# --durations: where the time went (the 40 slowest setups, calls and teardowns)
.venv/bin/python -m pytest -ra --durations=40 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
    echo "tests/run.sh: pytest collected no tests: failing" >&2
    exit 1
fi
exit "$rc"
