#!/usr/bin/env bash
# Session 12, run 2 (one GPU): the repeat paths of cached dispatch and combine (normal_repeat.py).
# GPU tests at 1 rank (normal mode, DeepEP compatibility) and at 2 ranks sharing the GPU
# (repeated calls, variants, race loop with repeats).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITONEP_TIMEOUT_S=20
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv;
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/system.txt" 2>&1
cat "$OUT/system.txt"
echo "== GPU tests at 1 rank: normal mode (all but the race loop), DeepEP compatibility (normal mode)"
TRITONEP_GPU_RANKS=1 timeout 270 python3 -m pytest -q -m gpu -rf tests/test_nvlink.py tests/test_deep_ep_compat.py \
  -k "not race_loop" -p no:cacheprovider > "$OUT/gpu_tests_1.log" 2>&1; echo "exit $?"
tail -4 "$OUT/gpu_tests_1.log"
echo "== GPU tests at 2 ranks sharing the GPU: repeated calls, variants, race loop"
TRITONEP_GPU_RANKS=2 timeout 300 python3 -m pytest -q -m gpu -rf tests/test_nvlink.py \
  -k "repeated or variants or race_loop" -p no:cacheprovider > "$OUT/gpu_tests_2.log" 2>&1; echo "exit $?"
tail -4 "$OUT/gpu_tests_2.log"
