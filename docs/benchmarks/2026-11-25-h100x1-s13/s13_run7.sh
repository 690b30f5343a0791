#!/usr/bin/env bash
# Session 13, run 7 (one GPU), tree after run 6: the fresh pairs probe with a yardstick (a
# fixed host workload timed right after the wait for the counts and before each call), and
# the process's Python threads.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITONEP_TIMEOUT_S=20
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
W=$OUT/run7; mkdir -p "$W"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv; git log -1 --oneline; } > "$W/system.txt" 2>&1
for round in 1 2; do
  echo "== fresh pairs probe with the yardstick, round $round"
  timeout 120 python3 scripts/fresh_pairs_probe.py --ranks 1 --iters 100 --yardstick --json "$W/pairs_$round.json" \
    > "$W/pairs_$round.log" 2>&1; echo "exit $?"
  python3 - "$W/pairs_$round.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))[0]
print("   threads", r["threads"], "switch interval", r["switch_interval_s"])
print("   yardstick", r["yardstick_us"])
print("   pairs", r["pair_differences_us"], "cached", r["cached_gpu_us"]["p50"])
for k in ("host_start_to_before_wait", "host_after_wait_to_return", "gpu_after_wait_to_end"):
    print("  ", k, r["stages"][k])
PY
done
cd "$OUT" && tar czf run7.tgz run7 && rm -rf run7
