#!/usr/bin/env bash
# Session 13, run 8 (one GPU), final tree: the normal-mode race loop (random shapes, routings
# and num_sms against the CPU backend) at 1 rank, where this session's two changes act, and
# the DeepEP compatibility tests at 2 ranks sharing the GPU.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITONEP_TIMEOUT_S=20
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
W=$OUT/run8; mkdir -p "$W"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv; git log -1 --oneline; } > "$W/system.txt" 2>&1
echo "== race loop at 1 rank"
TRITONEP_GPU_RANKS=1 timeout 300 python3 -m pytest -q -m gpu -rf tests/test_nvlink.py -k "race_loop" \
  -p no:cacheprovider > "$W/gpu_race_1.log" 2>&1; echo "exit $?"; tail -2 "$W/gpu_race_1.log"
echo "== DeepEP compatibility at 2 ranks sharing the GPU"
TRITONEP_GPU_RANKS=2 timeout 200 python3 -m pytest -q -m gpu -rf tests/test_deep_ep_compat.py \
  -p no:cacheprovider > "$W/gpu_compat_2.log" 2>&1; echo "exit $?"; tail -2 "$W/gpu_compat_2.log"
cd "$OUT" && tar czf run8.tgz run8 && rm -rf run8
