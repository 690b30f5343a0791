#!/usr/bin/env bash
# Session 10, run 9 (one GPU): the GPU tests run 8's time limit cut, at one rank, then the
# host-path probe on a quiet machine (nothing else running).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export TRITONEP_TIMEOUT_S=${TRITONEP_TIMEOUT_S:-60}
{ date -u; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; git status --short; } | tee $OUT/system.txt
TRITONEP_GPU_RANKS=1 TRITONEP_TEST_DEFAULT_DTYPE=bfloat16 TRITONEP_TEST_DEFAULT_DEVICE=cuda \
  timeout 300 python3 -m pytest -v -m gpu -rfs tests/test_nvlink_low_latency.py -p no:cacheprovider \
  -k "two_micro_batches or cuda_graph_replay or masks or masked or dead_rank or stalled_peer" 2>&1 \
  | grep "PASS\|FAIL\|SKIP\|Error\|passed\|failed" | tail -30 | tee $OUT/tests_1rank.log
sleep 5; nvidia-smi --query-compute-apps=pid,used_memory --format=csv | tee -a $OUT/system.txt
timeout 120 python3 scripts/host_path_probe.py --ranks 1 --json $OUT/host.json > $OUT/host.log 2>&1
grep "==\|yardstick\|add_" $OUT/host.log | head
