#!/usr/bin/env bash
# Session 10, run 3 (one GPU): the Buffer-lifetime tests at 1, 2, 3, 4 and 8 ranks (test input
# dtype fixed), then the normal-mode race loop at 8 ranks sharing the GPU (not run there before).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export TRITONEP_TIMEOUT_S=${TRITONEP_TIMEOUT_S:-60}
{ date -u; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; git log -1 --oneline 2>/dev/null; git status --short; } | tee $OUT/system.txt
for R in 1 2 3 4 8; do
  echo "== tests/test_nvlink_buffer_lifetime.py at $R ranks"
  TRITONEP_GPU_RANKS=$R TRITONEP_TEST_DEFAULT_DTYPE=bfloat16 TRITONEP_TEST_DEFAULT_DEVICE=cuda \
    timeout 150 python3 -m pytest -v -m gpu -rfs tests/test_nvlink_buffer_lifetime.py -p no:cacheprovider 2>&1 \
    | grep -v "Warn\|warn" | grep "PASS\|FAIL\|SKIP\|Error\|error\|assert\|passed\|failed" | tail -20
done 2>&1 | tee $OUT/tests.log
echo "== normal-mode race loop at 8 ranks"
RANKS=8 FILES="tests/test_nvlink.py" K="race_loop" DUMP_AT=${DUMP_AT:-420} \
  bash .bench_deps/s9_suite.sh 2>&1 | grep "PASS\|FAIL\|SKIP\|Error\|passed\|failed\|still running\|MiB\|exit\|mismatch" | tail -40 | tee $OUT/race8.log
