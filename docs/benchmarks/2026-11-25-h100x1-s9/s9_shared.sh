#!/usr/bin/env bash
# Session 9: GPU tests with RANKS ranks sharing one GPU (correctness at the rank count, not speed).
#   RANKS=8 FILES="tests/test_nvlink.py" K="not race_loop" bash .bench_deps/s9_shared.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export TRITONEP_TIMEOUT_S=${TRITONEP_TIMEOUT_S:-60}
date -u; nvidia-smi --query-gpu=name --format=csv,noheader; git log -1 --oneline 2>/dev/null
echo "== RANKS=$RANKS FILES=$FILES K=$K"
TRITONEP_GPU_RANKS=$RANKS TRITONEP_TEST_DEFAULT_DTYPE=bfloat16 TRITONEP_TEST_DEFAULT_DEVICE=cuda \
  timeout ${TEST_TIMEOUT:-540} python3 -m pytest -v -m gpu -rf $FILES -k "$K" -p no:cacheprovider --durations=15 2>&1 \
  | grep -v Warn | tee "$OUT/tests_${RANKS}ranks.log" | tail -60
