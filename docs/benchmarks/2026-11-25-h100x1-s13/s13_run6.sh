#!/usr/bin/env bash
# Session 13, run 6 (one GPU), tree after "dispatch: at one rank every program copies our own
# rows": GPU tests at 1 rank (normal mode but the race loop; DeepEP compatibility) and at 2
# ranks sharing the GPU (variants, repeated calls); the bench's normal-mode rows at 1 rank for
# this tree and .baseline (aa19188) in turn, twice each.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITONEP_TIMEOUT_S=20
export PYTHONUNBUFFERED=1
W=$OUT/run6; mkdir -p "$W"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv; git log -1 --oneline; } > "$W/system.txt" 2>&1
echo "== GPU tests at 1 rank: normal mode (all but the race loop), DeepEP compatibility"
PYTHONPATH=$PWD TRITONEP_GPU_RANKS=1 timeout 200 python3 -m pytest -q -m gpu -rf tests/test_nvlink.py \
  tests/test_deep_ep_compat.py -k "not race_loop" -p no:cacheprovider > "$W/gpu_tests_1.log" 2>&1
echo "exit $?"; tail -2 "$W/gpu_tests_1.log"
echo "== GPU tests at 2 ranks sharing the GPU: variants, repeated calls"
PYTHONPATH=$PWD TRITONEP_GPU_RANKS=2 timeout 150 python3 -m pytest -q -m gpu -rf tests/test_nvlink.py \
  -k "variants or repeated" -p no:cacheprovider > "$W/gpu_tests_2.log" 2>&1; echo "exit $?"; tail -2 "$W/gpu_tests_2.log"
for round in 1 2; do
  for tree in new baseline; do
    path=$PWD; [ "$tree" = baseline ] && path=$PWD/.baseline
    echo "== bench, normal mode, 1 rank, $tree, round $round"
    # From the tree's own folder: ``python -m`` puts the working directory first on sys.path.
    (cd "$path" && PYTHONPATH=$path timeout 150 python3 -m tritonep.bench --gpu --ranks 1 --tokens 4096 --hidden 7168 \
      --skip-low-latency --iters 30 --out "$W/bench_${tree}_$round" > "$W/bench_${tree}_$round.log" 2>&1; echo "exit $?")
    grep -E "^tritonep: (layout  |dispatch \(with|cached dispatch|combine  |fresh)" "$W/bench_${tree}_$round.log"
  done
done
cd "$OUT" && tar czf run6.tgz run6 && rm -rf run6
