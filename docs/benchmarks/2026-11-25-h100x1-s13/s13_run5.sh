#!/usr/bin/env bash
# Session 13, run 5 (one GPU): the combine's reduction tile by rank count (8 tokens at one
# rank). GPU tests at 1 rank (normal mode but the race loop) and at 2 ranks sharing the GPU
# (the routing variants); then the bench's normal-mode rows at 1 rank, the old tile
# (TRITONEP_REDUCE_TOKENS=4) and the new default in turn, twice each.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITONEP_TIMEOUT_S=20
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
W=$OUT/run5; mkdir -p "$W"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv; git log -1 --oneline; } > "$W/system.txt" 2>&1
echo "== GPU tests at 1 rank: normal mode (all but the race loop)"
TRITONEP_GPU_RANKS=1 timeout 170 python3 -m pytest -q -m gpu -rf tests/test_nvlink.py -k "not race_loop" \
  -p no:cacheprovider > "$W/gpu_tests_1.log" 2>&1; echo "exit $?"; tail -2 "$W/gpu_tests_1.log"
echo "== GPU tests at 2 ranks sharing the GPU: routing variants"
TRITONEP_GPU_RANKS=2 timeout 150 python3 -m pytest -q -m gpu -rf tests/test_nvlink.py -k "variants" \
  -p no:cacheprovider > "$W/gpu_tests_2.log" 2>&1; echo "exit $?"; tail -2 "$W/gpu_tests_2.log"
for round in 1 2; do
  for tokens in 4 default; do
    echo "== bench, normal mode, 1 rank, reduction tokens $tokens, round $round"
    env $([ "$tokens" = 4 ] && echo TRITONEP_REDUCE_TOKENS=4) timeout 150 python3 -m tritonep.bench --gpu --ranks 1 \
      --tokens 4096 --hidden 7168 --skip-low-latency --iters 30 --out "$W/bench_${tokens}_$round" \
      > "$W/bench_${tokens}_$round.log" 2>&1; echo "exit $?"
    grep -E "^tritonep: (combine|cached dispatch bf16)" "$W/bench_${tokens}_$round.log"
  done
done
cd "$OUT" && tar czf run5.tgz run5 && rm -rf run5
