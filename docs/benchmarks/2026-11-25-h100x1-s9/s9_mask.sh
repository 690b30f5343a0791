#!/usr/bin/env bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export TRITONEP_TIMEOUT_S=${TRITONEP_TIMEOUT_S:-10}
date -u; nvidia-smi --query-gpu=name --format=csv,noheader
for spec in $SPECS; do
  IFS=: read -r R variant <<< "$spec"
  echo "== R=$R $variant"
  timeout ${T:-200} python3 .bench_deps/mask_diag.py $R $variant ${POOL_T:-180} 2>&1 | grep -v "Warning: \|warnings.warn" | tee -a $OUT/mask.log | tail -40
done
