#!/usr/bin/env bash
# Session 10, run 8 (one GPU): the whole GPU suite at one rank (torch symmetric memory, NCCL
# group) on this session's final code, and the host-path probe.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export TRITONEP_TIMEOUT_S=${TRITONEP_TIMEOUT_S:-60}
{ date -u; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; git log -1 --oneline; git status --short; } | tee $OUT/system.txt
TRITONEP_GPU_RANKS=1 TRITONEP_TEST_DEFAULT_DTYPE=bfloat16 TRITONEP_TEST_DEFAULT_DEVICE=cuda \
  timeout 420 python3 -m pytest -q -m gpu -rfE tests -p no:cacheprovider 2>&1 | grep -v "Warn\|warn" | tail -25 | tee $OUT/tests_1rank.log
timeout 100 python3 scripts/host_path_probe.py --ranks 1 --json $OUT/host.json 2>&1 | grep "==\|host\|Error" | tail -20 | tee $OUT/host.log
