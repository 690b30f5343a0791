#!/usr/bin/env bash
# Session 13, run 1 (one GPU), tree 879b09d + scripts/fresh_pairs_probe.py: the bench's
# "fresh - cached, pairs" row call by call (with the bench's ~1 ms head start, without it, and
# with the receive half launched only after the read-back), then the bench's normal-mode rows
# twice. Everything lands in one archive.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITONEP_TIMEOUT_S=20
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
W=$OUT/run1; mkdir -p "$W"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv; lscpu | grep -E "Model name|^CPU\(s\)";
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$W/system.txt" 2>&1
cat "$W/system.txt"
brief() { python3 - "$1" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))[0]
for k in ("fresh_gpu_us", "cached_gpu_us", "pair_differences_us", "fresh_receive_launches", "stages"):
    print("   ", k, r[k])
PY
}
for case in head_start no_head_start after_sync head_start_again; do
  echo "== fresh pairs probe: $case"
  flags="--iters 100"; env=""
  [ "$case" = no_head_start ] && flags="--iters 60 --no-head-start"
  [ "$case" = after_sync ] && env="TRITONEP_RECEIVE_BEFORE_SYNC=0"
  env $env timeout 120 python3 scripts/fresh_pairs_probe.py --ranks 1 $flags --json "$W/pairs_$case.json" \
    > "$W/pairs_$case.log" 2>&1; echo "exit $?"; brief "$W/pairs_$case.json"
done
for round in 1 2; do
  echo "== bench, normal mode, 1 rank, round $round"
  timeout 150 python3 -m tritonep.bench --gpu --ranks 1 --tokens 4096 --hidden 7168 \
    --skip-low-latency --iters 30 --out "$W/bench_$round" > "$W/bench_$round.log" 2>&1; echo "exit $?"
  grep -E "^tritonep|spread" "$W/bench_$round.log" | head -14
done
cd "$OUT" && tar czf run1.tgz run1 && rm -rf run1
