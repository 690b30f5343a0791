#!/usr/bin/env bash
# Session 12, run 7 (one GPU), tree after the second review (Buffer._repeat_num_sms): the
# repeated-call and variant tests at 1 rank and at 2 ranks sharing the GPU, and the host path at 1 rank.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITONEP_TIMEOUT_S=20
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
W=$OUT/run7; mkdir -p "$W"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv;
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$W/system.txt" 2>&1
for ranks in 1 2; do
  echo "== GPU tests at $ranks rank(s): repeated calls, variants, DeepEP compatibility (normal mode)"
  TRITONEP_GPU_RANKS=$ranks timeout 150 python3 -m pytest -q -m gpu -rf "tests/test_nvlink.py::test_gpu_repeated_calls_with_a_handle" \
    "tests/test_nvlink.py::test_gpu_variants" tests/test_deep_ep_compat.py -p no:cacheprovider > "$W/gpu_tests_$ranks.log" 2>&1
  echo "exit $?"; tail -2 "$W/gpu_tests_$ranks.log"
done
echo "== host path, 1 rank"
timeout 90 python3 scripts/host_path_probe.py --ranks 1 --json "$W/host.json" > "$W/host.log" 2>&1; echo "exit $?"
python3 -c "
import json; r = json.load(open('$W/host.json'))[0]
print(' | '.join(f\"{k} host {r[k]['host_us']}\" for k in ('dispatch_cached', 'dispatch_cached_fp8', 'combine')))"
cd "$OUT" && tar czf run7.tgz run7 && rm -rf run7
