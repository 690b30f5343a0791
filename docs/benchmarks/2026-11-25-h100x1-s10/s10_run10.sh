#!/usr/bin/env bash
# Session 10, run 10 (one GPU), after the review (gpu_pool fixture in conftest; the lifetime
# test's normal-mode use through nvlink_cases.round_trip): the lifetime tests at 1 and 4 ranks,
# and a few tests of each GPU module at 2 ranks sharing the GPU.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export TRITONEP_TIMEOUT_S=${TRITONEP_TIMEOUT_S:-60} TRITONEP_TEST_DEFAULT_DTYPE=bfloat16 TRITONEP_TEST_DEFAULT_DEVICE=cuda
{ date -u; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; git status --short; } | tee $OUT/system.txt
for R in 1 4; do
  echo "== tests/test_nvlink_buffer_lifetime.py at $R ranks"
  TRITONEP_GPU_RANKS=$R timeout 150 python3 -m pytest -v -m gpu -rfs tests/test_nvlink_buffer_lifetime.py -p no:cacheprovider 2>&1 \
    | grep "PASS\|FAIL\|SKIP\|Error\|assert\|passed\|failed" | tail -12
done 2>&1 | tee $OUT/tests.log
echo "== a few tests per GPU module at 2 ranks" | tee -a $OUT/tests.log
TRITONEP_GPU_RANKS=2 timeout 200 python3 -m pytest -v -m gpu -rfs tests/test_nvlink.py tests/test_nvlink_low_latency.py -p no:cacheprovider \
  -k "sized_before_counts or invalid_expert or variants and out or repeated_calls and plain" 2>&1 \
  | grep "PASS\|FAIL\|SKIP\|Error\|assert\|passed\|failed" | tail -12 | tee -a $OUT/tests.log
