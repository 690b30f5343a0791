#!/usr/bin/env bash
# Session 10, run 1 (one GPU): does a Buffer give its memory back (buffer_memory_probe.py at
# 1, 4 and 8 ranks), and the Buffer-lifetime GPU tests at 1, 2 and 4 ranks.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export TRITONEP_TIMEOUT_S=${TRITONEP_TIMEOUT_S:-60}
{ date -u; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; git log -1 --oneline 2>/dev/null; } | tee $OUT/system.txt
for R in ${PROBE_RANKS:-1 4 8}; do
  echo "== buffer_memory_probe.py --ranks $R"
  timeout 150 python3 scripts/buffer_memory_probe.py --ranks $R --json $OUT/memory_$R.json 2>&1 | grep -v "Warn\|warn" | tail -12
done 2>&1 | tee $OUT/memory.log
for R in ${TEST_RANKS:-1 2 4}; do
  echo "== tests/test_nvlink_buffer_lifetime.py at $R ranks"
  TRITONEP_GPU_RANKS=$R TRITONEP_TEST_DEFAULT_DTYPE=bfloat16 TRITONEP_TEST_DEFAULT_DEVICE=cuda \
    timeout 150 python3 -m pytest -v -m gpu -rfs tests/test_nvlink_buffer_lifetime.py -p no:cacheprovider 2>&1 \
    | grep -v "Warn\|warn" | tail -25
done 2>&1 | tee $OUT/tests.log
