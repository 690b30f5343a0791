#!/usr/bin/env bash
# PART=ab: bench A/B (receive before/after the read-back), pairs probe, GPU tests at 1 and 2 ranks.
# PART=ranks: GPU tests at RANKS ranks sharing the GPU.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITONEP_TIMEOUT_S=20
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
OUT=${OUT:-out}; mkdir -p "$OUT"
date -u; nvidia-smi -L; git log -1 --oneline 2>/dev/null
K="sized or invalid or fresh_then_cached or variants or combine_piece or graph or race"
if [ "${PART:-ab}" = ab ]; then
  timeout 100 python3 -m tritonep.bench --gpu --ranks 1 --tokens 4096 --hidden 7168 --skip-low-latency --iters 5 \
    --out "$OUT/warmup" > /dev/null 2>&1; rm -rf "$OUT/warmup"
  for round in 1 2; do
    for rbs in 1 0; do
      echo "== round $round, TRITONEP_RECEIVE_BEFORE_SYNC=$rbs"
      TRITONEP_RECEIVE_BEFORE_SYNC=$rbs timeout 120 python3 -m tritonep.bench --gpu --ranks 1 --tokens 4096 \
        --hidden 7168 --skip-low-latency --out "$OUT/b${round}_$rbs" 2>&1 | grep -v Warn > "$OUT/b${round}_$rbs.log"
      grep -E "^tritonep: (layout |dispatch|cached dispatch bf16|fresh|combine  )|host per call|spread" \
        "$OUT/b${round}_$rbs.log"
    done
  done
  echo "== pairs probe, TRITONEP_RECEIVE_BEFORE_SYNC=1"
  timeout 120 python3 .bench_deps/pairs_probe.py 60 2>&1 | grep -v Warn | tee "$OUT/pairs_probe.log"
  echo "== GPU tests, 1 rank, DeepEP's torch defaults"
  TRITONEP_TEST_DEFAULT_DTYPE=bfloat16 TRITONEP_TEST_DEFAULT_DEVICE=cuda timeout 200 python3 -m pytest -q -m gpu \
    tests/test_nvlink.py -p no:cacheprovider -rf --durations=3 2>&1 | tee "$OUT/tests_1rank.log" | tail -6
  RANKS=${RANKS:-2}
fi
for ranks in ${RANKS:-3 4}; do
  echo "== GPU tests, $ranks ranks sharing the GPU"
  TRITONEP_GPU_RANKS=$ranks timeout ${TEST_TIMEOUT:-250} python3 -m pytest -q -m gpu tests/test_nvlink.py \
    -p no:cacheprovider -rf --durations=5 -k "$K" 2>&1 | tee "$OUT/tests_${ranks}ranks.log" | tail -10
done
(cd "$OUT" && tar czf run.tgz $(ls | grep -v run.tgz) && rm -rf $(ls | grep -v run.tgz))
date -u
