#!/usr/bin/env bash
# Everything we run on a GPU machine, one mode per call; logs and JSON go to $OUT (the device
# tool brings that folder back).
#   bash scripts/gpu_check.sh [tests|bench|v2|internode|profile|ab|tests-bench|all]
#     tests    the GPU tests under DeepEP's torch defaults (cuda device, bf16 dtype), at each rank
#              count of TEST_RANKS (default: one rank per GPU; more ranks than GPUs share them);
#              TESTS: the files (default: every GPU test file), TEST_FILTER: pytest -k, TEST_TAG: a
#              suffix for the log's name.
#     bench    python -m benchmarks at each rank count of BENCH_RANKS (default: one per GPU),
#              beside DeepEP V1 when .bench_deps holds its sources (built on the CPUs first);
#              BENCH_ARGS go to every run (e.g. --sweep, --skip-low-latency).
#     v2       python -m benchmarks --api v2 at each rank count of BENCH_RANKS: ElasticBuffer's calls
#              beside Buffer's, GPU and host time per call and V2's extra host time; BENCH_ARGS too
#              (e.g. --host-profile: where V2's extra host time sits, function by function).
#     internode  the internode GPU tests (NVSHMEM with one GPU per rank), then the internode bench rows
#              alone (--internode-only, nodes of INTERNODE_GPUS_PER_NODE ranks, default half the GPUs).
#     profile  python -m benchmarks --profile: each normal-mode call's kernels and copies, per rank.
#     ab       BASELINE=path (a folder holding an older tritonep/): that package against this
#              checkout at one rank on one GPU, in the same run (python -m benchmarks --ranks 1
#              --baseline); AB_ARGS go to it. E.g. here: mkdir -p .baseline && git archive bb06a2c
#              tritonep | tar -x -C .baseline, carry .baseline, then BASELINE=.baseline.
#     tests-bench  tests, then bench, DeepEP built on the CPUs during the tests.
#     all      tests, bench, profile and the demo, with time limits that fit one 10-minute call.
# Time limits (seconds): TEST_TIMEOUT, BENCH_TIMEOUT, PROFILE_TIMEOUT, AB_TIMEOUT, DEMO_TIMEOUT.
set -uo pipefail
MODE=${1:-all}
OUT=${OUT:-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
# Never enable NVLink multicast on the shared machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TRITONEP_TIMEOUT_S=${TRITONEP_TIMEOUT_S:-20}
# Tests check that no launch setup lets a fixed argument change (runtime/launcher.py).
case "$MODE" in tests|internode) export TRITONEP_CHECK_LAUNCHES=1 ;; esac
# NVSHMEM's heap: the internode tests' heaps and the bench's (DeepEP's problem) fit in it.
export NVSHMEM_SYMMETRIC_SIZE=${NVSHMEM_SYMMETRIC_SIZE:-4G}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
GPUS=$(nvidia-smi -L | wc -l)
status=0

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nvidia-smi topo -m
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git log -1 --oneline 2>/dev/null || true
} > "$OUT/system.txt" 2>&1
cat "$OUT/system.txt"

# run NAME TIMEOUT COMMAND...: the command's output to $OUT/NAME.log (its tail printed); a
# failure or a time-out sets status.
run() {
  local name=$1 limit=$2
  shift 2
  echo "== $name: $*"
  # INT first, so that pytest still prints its summary of what ran.
  timeout -s INT -k 30 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  grep -v Warning "$OUT/$name.log" | tail -n "${TAIL_LINES:-40}"
  [ "$rc" -eq 0 ] || { echo "== $name: exit $rc"; status=1; }
}

# -v names each test as it starts, so a log cut by the time limit says which one was running;
# --durations also prints where the batched cases' time went; the kernels each run compiled are
# listed in $OUT (kept as tests/gpu_kernels.jsonl, later runs compile them ahead: tests/kernel_cache.py).
gpu_tests() {
  # Each test's time beside its name, so that a log cut by the time limit still says where the
  # time went (pytest 8.3 and later).
  local times=()
  python3 -c "import pytest, sys; sys.exit(tuple(map(int, pytest.__version__.split('.')[:2])) < (8, 3))" &&
    times=(-o console_output_style=times)
  for ranks in ${TEST_RANKS:-$GPUS}; do
    TRITONEP_GPU_RANKS=$ranks TRITONEP_TEST_DEFAULT_DTYPE=bfloat16 TRITONEP_TEST_DEFAULT_DEVICE=cuda \
      TRITONEP_TEST_KERNELS_OUT="$OUT/gpu_kernels_$ranks.jsonl" \
      run "gpu_tests_$ranks${TEST_TAG:-}" "${TEST_TIMEOUT:-300}" python3 -m pytest -v ${times[@]+"${times[@]}"} -m gpu -rf -p no:cacheprovider \
      --durations=40 ${TESTS:-tests} ${TEST_FILTER:+-k "$TEST_FILTER"}
  done
}

# DeepEP V1 for the side-by-side rows (--vs-deepep), when .bench_deps holds its sources (see
# ../shared/deepep/README.md: mkdir -p .bench_deps && cp ../shared/deepep/* .bench_deps/, and
# carry .bench_deps). It builds on the CPUs in the background (during the GPU tests in mode all);
# the benchmark waits for it, so nothing builds while it times the host.
start_deepep_build() {
  [ -f .bench_deps/build_on_device.sh ] || return 0
  [ -z "${build:-}" ] || return 0
  (timeout 400 bash .bench_deps/build_on_device.sh .bench_deps/deepep-v1-*-src.tar.gz > "$OUT/deepep_build.log" 2>&1;
   echo "exit $?" >> "$OUT/deepep_build.log") &
  build=$!
}
wait_deepep_build() {   # true when DeepEP was built
  [ -n "${build:-}" ] || { echo "== DeepEP: no .bench_deps, the benchmark runs without it"; return 1; }
  wait "$build"
  tail -n 2 "$OUT/deepep_build.log"
  grep -q "^exit 0$" "$OUT/deepep_build.log"
}

bench() {
  local deepep=()
  start_deepep_build
  if wait_deepep_build; then
    export PYTHONPATH="/tmp/deepep:$PYTHONPATH"
    deepep=(--vs-deepep)
  fi
  for ranks in ${BENCH_RANKS:-$GPUS}; do
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of options
    run "bench_$ranks" "${BENCH_TIMEOUT:-300}" python3 -m benchmarks --gpu --ranks "$ranks" \
      ${deepep[@]+"${deepep[@]}"} ${BENCH_ARGS:-} --out "$OUT/bench_$ranks"
    top_level "bench_$ranks"
  done
}

# top_level NAME: NAME/bench.json and .png also as NAME.json and NAME.png in $OUT, where the
# device tool always brings them back (files in folders below $OUT can be left out).
top_level() {
  local ext
  for ext in json png; do
    [ -f "$OUT/$1/bench.$ext" ] && cp "$OUT/$1/bench.$ext" "$OUT/$1.$ext"
  done
  return 0
}

bench_v2() {
  for ranks in ${BENCH_RANKS:-$GPUS}; do
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of options
    run "bench_v2_$ranks" "${BENCH_TIMEOUT:-300}" python3 -m benchmarks --gpu --ranks "$ranks" --api v2 \
      ${BENCH_ARGS:-} --out "$OUT/bench_v2_$ranks"
    top_level "bench_v2_$ranks"
  done
}

internode() {
  TESTS="tests/test_internode_transport.py tests/test_internode.py tests/test_internode_low_latency.py" \
    TEST_TAG=_internode gpu_tests
  run bench_internode "${BENCH_TIMEOUT:-300}" python3 -m benchmarks --gpu --ranks "$GPUS" --internode-only \
    --gpus-per-node "${INTERNODE_GPUS_PER_NODE:-$((GPUS / 2))}" --out "$OUT/bench_internode"
}

profile() {
  run profile "${PROFILE_TIMEOUT:-150}" python3 -m benchmarks --profile --out "$OUT/profile"
}

ab() {
  [ -n "${BASELINE:-}" ] || { echo "ab: set BASELINE to a folder holding the older tritonep/"; exit 2; }
  # shellcheck disable=SC2086  # AB_ARGS is a list of options
  run ab "${AB_TIMEOUT:-500}" python3 -m benchmarks --ranks 1 --baseline "$BASELINE" ${AB_ARGS:-} --out "$OUT/ab"
}

case "$MODE" in
  tests) gpu_tests ;;
  bench) bench ;;
  v2) bench_v2 ;;
  internode) internode ;;
  profile) profile ;;
  ab) ab ;;
  tests-bench)
    start_deepep_build
    gpu_tests
    bench
    ;;
  all)
    : "${TEST_TIMEOUT:=200}" "${BENCH_TIMEOUT:=220}" "${PROFILE_TIMEOUT:=60}" "${DEMO_TIMEOUT:=60}"
    start_deepep_build
    gpu_tests
    bench
    profile
    run demo "${DEMO_TIMEOUT:-120}" bash scripts/run_demo.sh
    ;;
  *) echo "gpu_check.sh: unknown mode '$MODE' (tests, bench, v2, internode, profile, ab, tests-bench, all)"; exit 2 ;;
esac
exit $status
