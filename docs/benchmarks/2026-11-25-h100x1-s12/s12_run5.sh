#!/usr/bin/env bash
# Session 12, run 5 (one GPU), tree becfcaa: the GPU tests at 1 rank (normal mode but the race
# loop, low latency but the race loop, both DeepEP compatibility files), and the normal-mode
# tests at 2 ranks sharing the GPU (repeated calls, variants).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITONEP_TIMEOUT_S=20
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
W=$OUT/run5; mkdir -p "$W"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv;
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$W/system.txt" 2>&1
echo "== GPU tests at 1 rank"
TRITONEP_GPU_RANKS=1 timeout 330 python3 -m pytest -q -m gpu -rf tests/test_nvlink.py tests/test_nvlink_low_latency.py \
  tests/test_deep_ep_compat.py tests/test_deep_ep_compat_low_latency.py -k "not race_loop" -p no:cacheprovider \
  > "$W/gpu_tests_1.log" 2>&1; echo "exit $?"; tail -3 "$W/gpu_tests_1.log"
echo "== GPU tests at 2 ranks sharing the GPU: repeated calls, variants"
TRITONEP_GPU_RANKS=2 timeout 150 python3 -m pytest -q -m gpu -rf tests/test_nvlink.py -k "repeated or variants" \
  -p no:cacheprovider > "$W/gpu_tests_2.log" 2>&1; echo "exit $?"; tail -3 "$W/gpu_tests_2.log"
cd "$OUT" && tar czf run5.tgz run5 && rm -rf run5
