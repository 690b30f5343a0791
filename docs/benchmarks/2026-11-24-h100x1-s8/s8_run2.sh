#!/usr/bin/env bash
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITONEP_TIMEOUT_S=20
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
OUT=${OUT:-out}; mkdir -p "$OUT"
date -u; nvidia-smi -L
for rbs in 1 0 1; do
  echo "== pairs probe, TRITONEP_RECEIVE_BEFORE_SYNC=$rbs"
  TRITONEP_RECEIVE_BEFORE_SYNC=$rbs timeout 120 python3 .bench_deps/pairs_probe.py 60 "$OUT/pairs_rbs$rbs.json" 2>&1 | grep -v Warn
done
echo "== GPU tests, 2 ranks sharing the GPU"
TRITONEP_GPU_RANKS=2 timeout ${TEST_TIMEOUT:-330} python3 -m pytest -q -m gpu tests/test_nvlink.py \
  -p no:cacheprovider -rf --durations=8 -k "${K:-sized or invalid or fresh_then_cached or variants or combine_piece or graph}" 2>&1 | tee "$OUT/tests_2ranks.log" | tail -14
date -u
