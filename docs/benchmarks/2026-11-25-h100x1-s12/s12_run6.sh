#!/usr/bin/env bash
# Session 12, run 6 (one GPU), tree after the review (shared fit check of the repeat paths,
# launch.init_one_rank_gpu_group): the normal-mode GPU tests at 1 rank (all but the race loop)
# and at 2 ranks sharing the GPU (repeated calls, the combine's piece paths); the hook-mode probe
# and the low-latency kernel profile script, which now share the one-rank group helper.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITONEP_TIMEOUT_S=20
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
W=$OUT/run6; mkdir -p "$W"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv;
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$W/system.txt" 2>&1
echo "== GPU tests at 1 rank: normal mode but the race loop"
TRITONEP_GPU_RANKS=1 timeout 120 python3 -m pytest -q -m gpu -rf tests/test_nvlink.py -k "not race_loop" \
  -p no:cacheprovider > "$W/gpu_tests_1.log" 2>&1; echo "exit $?"; tail -2 "$W/gpu_tests_1.log"
echo "== GPU tests at 2 ranks sharing the GPU: repeated calls, combine piece paths"
TRITONEP_GPU_RANKS=2 timeout 150 python3 -m pytest -q -m gpu -rf tests/test_nvlink.py -k "repeated or combine_piece" \
  -p no:cacheprovider > "$W/gpu_tests_2.log" 2>&1; echo "exit $?"; tail -2 "$W/gpu_tests_2.log"
echo "== hook-mode probe"
timeout 90 python3 scripts/hook_mode_probe.py --iters 30 --json "$W/hook.json" > "$W/hook.log" 2>&1; echo "exit $?"
grep -E "kernel_us|send_event|recv_event|general" "$W/hook.log"
echo "== low-latency kernel profile script (no ncu: runs its calls)"
timeout 60 python3 scripts/ll_kernel_profile.py --calls 4 > "$W/ll_kernel_profile.log" 2>&1; echo "exit $?"; tail -1 "$W/ll_kernel_profile.log"
cd "$OUT" && tar czf run6.tgz run6 && rm -rf run6
