#!/usr/bin/env bash
# The test job (what CI runs, via .ci/run): lint (ruff, and no import cycle in tritonep/), then the
# CPU test suite in two runs:
#   main         pytest -m "not gpu and not interpreter"   in .venv (current numpy)
#   interpreter  pytest -m "interpreter and not gpu"       in .venv-interpreter (numpy<2.4)
# and both again with torch's default dtype set to bfloat16, as DeepEP's users do.
# (scripts/setup_env.sh says why there are two environments and how they are chosen.)
#
# Arguments go to every run's pytest, after its -m (so do not pass -m), e.g.
#   bash scripts/run_tests.sh -x                  stop each run at its first failure
#   bash scripts/run_tests.sh -k low_latency      the matching tests of both runs
#   bash scripts/run_tests.sh tests/test_utils.py one file; a run it has no tests for says so
# Without arguments every run must run something: pytest collecting nothing is a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh test   # sets PY, PY_INTERPRETER and PY_AS_IS

# Our venvs always have ruff. An interpreter used as it is (PYTHON=..., the GPU machines) may
# not, and nothing is installed into it: lint is then skipped, saying so (CI always lints).
if [ "$PY_AS_IS" = 1 ] && ! "$PY" -m ruff --version >/dev/null 2>&1; then
    echo "run_tests.sh: no ruff in $PY: lint SKIPPED (pip install ruff==0.17.6 there to lint)" >&2
else
    "$PY" -m ruff check tritonep tests scripts benchmarks examples
fi
# The package's modules must not import each other in a loop (plain Python: no ruff needed).
"$PY" scripts/check_import_cycles.py tritonep

status=0       # becomes 1 when any run fails
runs_empty=0   # runs that selected no tests
runs=0

# run_pytest NAME PYTHON MARKERS: one pytest run over the suite, with this script's arguments.
# Environment variables written before the call (VAR=x run_pytest ...) reach that run only.
run_pytest() {
    local name=$1 python=$2 markers=$3 rc=0 shown=
    shift 3
    [ $# -eq 0 ] || printf -v shown ' %q' "$@"   # the arguments as they would be typed
    echo "== run_tests.sh: $name run: $python -m pytest -q -m \"$markers\"$shown"
    "$python" -m pytest -q -m "$markers" "$@" || rc=$?
    runs=$((runs + 1))
    if [ "$rc" -eq 5 ]; then
        # pytest's 5: it selected no tests. Without arguments that is a broken suite, never a pass;
        # with arguments (a file, -k) a run may fairly have nothing to do, checked at the end.
        runs_empty=$((runs_empty + 1))
        if [ "$n_args" -eq 0 ]; then
            echo "run_tests.sh: $name run: pytest collected no tests; failing" >&2
            status=1
        else
            echo "run_tests.sh: $name run: none of the selected tests belong to this run" >&2
        fi
    elif [ "$rc" -ne 0 ]; then
        echo "run_tests.sh: $name run: FAILED (pytest exit status $rc)" >&2
        status=1
    fi
}

n_args=$#
run_pytest main "$PY" "not gpu and not interpreter" "$@"
# -rs: where these tests skip (numpy >= 2.4 in an interpreter used as it is), say why.
run_pytest interpreter "$PY_INTERPRETER" "interpreter and not gpu" -rs "$@"
# Both once more with the default dtype DeepEP's users set (torch.set_default_dtype(bf16)):
# nothing in tritonep may depend on it (tests/torch_defaults.py).
TRITONEP_TEST_DEFAULT_DTYPE=bfloat16 run_pytest "main (bf16 default dtype)" "$PY" "not gpu and not interpreter" "$@"
TRITONEP_TEST_DEFAULT_DTYPE=bfloat16 run_pytest "interpreter (bf16 default dtype)" "$PY_INTERPRETER" \
    "interpreter and not gpu" -rs "$@"

if [ "$runs_empty" -eq "$runs" ]; then
    echo "run_tests.sh: no run selected any test; failing" >&2
    status=1
fi
[ "$status" -eq 0 ] && echo "run_tests.sh: passed ($((runs - runs_empty)) of $runs pytest runs had tests to run)"
exit "$status"
