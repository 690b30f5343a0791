#!/usr/bin/env bash
# The test job (what CI runs): install what is missing, lint, then the CPU test suite.
# Arguments go to pytest, e.g. `bash scripts/run_tests.sh tests/test_utils.py -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh test

"$PY" -m ruff check tritonep tests scripts

rc=0
"$PY" -m pytest -q -m "not gpu" "$@" || rc=$?
if [ "$rc" -eq 5 ]; then
    # pytest's 5 means it collected nothing: a broken suite, never a pass.
    echo "run_tests.sh: pytest collected no tests; failing" >&2
    exit 1
fi
exit "$rc"
