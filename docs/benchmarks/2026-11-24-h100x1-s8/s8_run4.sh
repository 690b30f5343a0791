#!/usr/bin/env bash
# The DeepEP-compatibility GPU tests (normal and low-latency) at 1 rank and the normal ones at 2
# ranks sharing the GPU, under DeepEP's torch defaults.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITONEP_TIMEOUT_S=20
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" TRITONEP_TEST_DEFAULT_DTYPE=bfloat16 TRITONEP_TEST_DEFAULT_DEVICE=cuda
OUT=${OUT:-out}; mkdir -p "$OUT"
date -u; nvidia-smi -L
echo "== 1 rank"
timeout 250 python3 -m pytest -q -m gpu tests/test_deep_ep_compat.py tests/test_deep_ep_compat_low_latency.py \
  -p no:cacheprovider -rf 2>&1 | tee "$OUT/compat_1rank.log" | tail -5
echo "== 2 ranks sharing the GPU"
TRITONEP_GPU_RANKS=2 timeout 250 python3 -m pytest -q -m gpu tests/test_deep_ep_compat.py -p no:cacheprovider -rf \
  2>&1 | tee "$OUT/compat_2ranks.log" | tail -5
date -u
