#!/bin/bash
# The whole suite. pytest's exit 5 (no tests collected) is a failure here, never a pass.
set -uo pipefail
cd "$(dirname "$0")/.."
# --durations: where the time went (the 40 slowest setups, calls and teardowns).
# Test files run side by side in APPLIANCE_TEST_WORKERS processes (pytest-xdist; 0: one process), each
# file whole in one of them (its module fixtures once), the longest started first (tests/conftest.py):
# the suite mostly waits on its daemons' timeouts and clients, a quarter of 2 cores used with one process.
workers=${APPLIANCE_TEST_WORKERS:-3}
.venv/bin/python -m pytest -ra --durations=40 -n "$workers" --dist loadfile --no-loadscope-reorder "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
    echo "tests/run.sh: pytest collected no tests: failing" >&2
    exit 1
fi
exit "$rc"
