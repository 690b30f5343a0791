#!/usr/bin/env bash
# Session 10, run 2 (one GPU), after the CUDA IPC fix (one export per peer; destroy() collects):
# the memory probe at 4 and 8 ranks, the Buffer-lifetime tests at 1, 2, 3, 4 and 8 ranks, then
# the DeepEP compatibility tests at 8 ranks (they stopped at the GPU's capacity in session 9).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export TRITONEP_TIMEOUT_S=${TRITONEP_TIMEOUT_S:-60}
{ date -u; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; git log -1 --oneline 2>/dev/null; git status --short; } | tee $OUT/system.txt
for R in 4 8; do
  echo "== buffer_memory_probe.py --ranks $R"
  timeout 150 python3 scripts/buffer_memory_probe.py --ranks $R --json $OUT/memory_$R.json 2>&1 | grep -v "Warn\|warn" | tail -8
done 2>&1 | tee $OUT/memory.log
for R in 1 2 3 4 8; do
  echo "== tests/test_nvlink_buffer_lifetime.py at $R ranks"
  TRITONEP_GPU_RANKS=$R TRITONEP_TEST_DEFAULT_DTYPE=bfloat16 TRITONEP_TEST_DEFAULT_DEVICE=cuda \
    timeout 150 python3 -m pytest -v -m gpu -rfs tests/test_nvlink_buffer_lifetime.py -p no:cacheprovider 2>&1 \
    | grep -v "Warn\|warn" | grep "PASS\|FAIL\|SKIP\|Error\|error\|assert\|passed\|failed" | tail -20
done 2>&1 | tee $OUT/tests.log
echo "== DeepEP compatibility tests at 8 ranks"
RANKS=8 FILES="tests/test_deep_ep_compat.py tests/test_deep_ep_compat_low_latency.py" K="" DUMP_AT=${DUMP_AT:-300} \
  bash .bench_deps/s9_suite.sh 2>&1 | grep "PASS\|FAIL\|SKIP\|Error\|passed\|failed\|still running\|MiB\|exit" | tail -60 | tee $OUT/compat8.log
