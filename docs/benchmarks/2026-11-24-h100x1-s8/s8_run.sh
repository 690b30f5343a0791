#!/usr/bin/env bash
# Session 8 device run: the fresh dispatch's receive half launched before the read-back.
# PART=a: fresh A/B (this tree vs .baseline = HEAD before the change) then GPU tests at 1 rank;
# PART=b: GPU tests at 2 and 4 ranks sharing the GPU.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITONEP_TIMEOUT_S=20
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
OUT=${OUT:-out}; mkdir -p "$OUT"
date -u; nvidia-smi -L
K="sized or invalid or fresh_then_cached or variants or combine_piece or race or graph"
if [ "${PART:-a}" = a ]; then
  ROUNDS=2 BASELINE=.baseline timeout 330 bash scripts/gpu_check.sh fresh
  echo "== GPU tests, 1 rank"
  TRITONEP_TEST_DEFAULT_DTYPE=bfloat16 TRITONEP_TEST_DEFAULT_DEVICE=cuda timeout 200 python3 -m pytest -q -m gpu \
    tests/test_nvlink.py -p no:cacheprovider -rf --durations=5 2>&1 | tee "$OUT/tests_1rank.log" | tail -12
elif [ "${PART}" = c ]; then
  # A/B in one run: the receive half before the read-back (1) or after it (0), same bench code.
  timeout 100 python3 -m tritonep.bench --gpu --ranks 1 --tokens 4096 --hidden 7168 --skip-low-latency --iters 5 \
    --out "$OUT/warmup" > /dev/null 2>&1; rm -rf "$OUT/warmup"
  for round in 1 2; do
    for rbs in 1 0; do
      echo "== round $round, TRITONEP_RECEIVE_BEFORE_SYNC=$rbs"
      TRITONEP_RECEIVE_BEFORE_SYNC=$rbs timeout 120 python3 -m tritonep.bench --gpu --ranks 1 --tokens 4096 \
        --hidden 7168 --skip-low-latency --out "$OUT/bench_${round}_rbs$rbs" 2>&1 | grep -v Warn \
        > "$OUT/bench_${round}_rbs$rbs.log"
      grep -E "^tritonep: (layout |dispatch|cached dispatch bf16|fresh|combine  )|host per call" \
        "$OUT/bench_${round}_rbs$rbs.log"
    done
  done
  for rbs in 1 0; do
    echo "== timeline, TRITONEP_RECEIVE_BEFORE_SYNC=$rbs"
    TRITONEP_RECEIVE_BEFORE_SYNC=$rbs timeout 150 python3 scripts/fresh_dispatch_timeline.py \
      --json "$OUT/timeline_rbs$rbs.json" 2>&1 | grep -v Warn > "$OUT/timeline_rbs$rbs.log"
    head -9 "$OUT/timeline_rbs$rbs.log"
  done
  for ranks in ${RANKS:-2}; do
    echo "== GPU tests, $ranks ranks sharing the GPU"
    TRITONEP_GPU_RANKS=$ranks timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -m gpu tests/test_nvlink.py \
      -p no:cacheprovider -rf --durations=5 -k "$K" 2>&1 | tee "$OUT/tests_${ranks}ranks.log" | tail -12
  done
else
  for ranks in ${RANKS:-2 4}; do
    echo "== GPU tests, $ranks ranks sharing the GPU"
    TRITONEP_GPU_RANKS=$ranks timeout ${TEST_TIMEOUT:-270} python3 -m pytest -q -m gpu tests/test_nvlink.py \
      -p no:cacheprovider -rf --durations=5 -k "$K" 2>&1 | tee "$OUT/tests_${ranks}ranks.log" | tail -12
  done
fi
date -u
