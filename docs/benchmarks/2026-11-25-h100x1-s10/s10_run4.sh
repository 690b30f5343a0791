#!/usr/bin/env bash
# Session 10, run 4 (one GPU): a rank count that divides nothing, 5 ranks sharing the GPU: the
# normal-mode GPU tests but the race loop, the DeepEP compatibility tests, the Buffer-lifetime
# tests, and the low-latency benchmark shapes and variants (288 experts -> 160 at 5 ranks).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{ date -u; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; git log -1 --oneline 2>/dev/null; git status --short; } | tee $OUT/system.txt
RANKS=${RANKS:-5} FILES="tests/test_nvlink.py tests/test_deep_ep_compat.py tests/test_deep_ep_compat_low_latency.py tests/test_nvlink_buffer_lifetime.py tests/test_nvlink_low_latency.py" \
  K="${K:-not race_loop and (not test_nvlink_low_latency or benchmark_shape or variants)}" DUMP_AT=${DUMP_AT:-510} \
  bash .bench_deps/s9_suite.sh 2>&1 | grep "PASS\|FAIL\|SKIP\|Error\|passed\|failed\|still running\|MiB\|exit\|mismatch\|==" | tail -120 | tee $OUT/tests_5ranks.log
