#!/usr/bin/env bash
# Session 10, run 7 (one GPU): tests/test_nvlink_buffer_lifetime.py at 1 rank (symmetric memory:
# its own out-of-memory error on a full GPU) and at 2 and 5 ranks sharing the GPU.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{ date -u; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; git log -1 --oneline; git status --short; } | tee $OUT/system.txt
for R in 1 2 5; do
  echo "== tests/test_nvlink_buffer_lifetime.py at $R ranks"
  TRITONEP_GPU_RANKS=$R TRITONEP_TEST_DEFAULT_DTYPE=bfloat16 TRITONEP_TEST_DEFAULT_DEVICE=cuda \
    timeout 150 python3 -m pytest -v -m gpu -rfs tests/test_nvlink_buffer_lifetime.py -p no:cacheprovider 2>&1 \
    | grep -v "Warn\|warn" | grep "PASS\|FAIL\|SKIP\|Error\|error\|assert\|passed\|failed" | tail -20
done 2>&1 | tee $OUT/tests.log
