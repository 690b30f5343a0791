#!/usr/bin/env bash
# Session 12, run 4 (one GPU), tree 9351344 (layout launch trimmed): GPU tests at 1 rank; the
# host path A/B against .baseline (025ec93) at 1 rank; cProfile at 1 and 2 ranks; the fresh
# dispatch timeline; the bench's normal-mode rows for both trees. Everything lands in one archive.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITONEP_TIMEOUT_S=20
export PYTHONUNBUFFERED=1
W=$OUT/run4; mkdir -p "$W"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv;
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$W/system.txt" 2>&1
echo "== GPU tests at 1 rank: normal mode (all but the race loop)"
PYTHONPATH=$PWD TRITONEP_GPU_RANKS=1 timeout 150 python3 -m pytest -q -m gpu -rf tests/test_nvlink.py -k "not race_loop" \
  -p no:cacheprovider > "$W/gpu_tests_1.log" 2>&1; echo "exit $?"; tail -2 "$W/gpu_tests_1.log"
summary() { python3 - "$1" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))[0]
print("   ", " | ".join(f"{k} host {r[k]['host_us']} gpu {r[k]['gpu_us']}" for k in
      ("dispatch_cached", "dispatch_cached_fp8", "combine", "layout", "dispatch_fresh") if k in r))
PY
}
for tree in new baseline new baseline; do
  path=$PWD; [ "$tree" = baseline ] && path=$PWD/.baseline
  echo "== host path, 1 rank, $tree"
  PYTHONPATH="$path" timeout 90 python3 scripts/host_path_probe.py --ranks 1 --json "$W/host_$tree.json" \
    > "$W/host_$tree.log" 2>&1; echo "exit $?"; summary "$W/host_$tree.json"
done
for ranks in 1 2; do
  echo "== cProfile, $ranks rank(s), new"
  PYTHONPATH=$PWD timeout 100 python3 scripts/host_path_probe.py --ranks $ranks --profile > "$W/profile_$ranks.log" 2>&1
  echo "exit $?"
done
echo "== fresh dispatch timeline, new"
PYTHONPATH=$PWD timeout 120 python3 scripts/fresh_dispatch_timeline.py --ranks 1 --json "$W/timeline.json" 2>&1 \
  | grep -v Warn > "$W/timeline.log"; echo "exit $?"; head -30 "$W/timeline.log"
for tree in new baseline; do
  dir=.; [ "$tree" = baseline ] && dir=.baseline
  echo "== bench, normal mode, 1 rank, $tree"
  (cd $dir && PYTHONPATH=$PWD timeout 150 python3 -m tritonep.bench --gpu --ranks 1 --tokens 4096 --hidden 7168 \
    --skip-low-latency --iters 30 --out "$W/bench_$tree" > "$W/bench_$tree.log" 2>&1; echo "exit $?")
  grep -E "^tritonep|host" "$W/bench_$tree.log" | head -12
done
cd "$OUT" && tar czf run4.tgz run4 && rm -rf run4
