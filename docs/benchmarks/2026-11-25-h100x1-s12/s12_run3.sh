#!/usr/bin/env bash
# Session 12, run 3 (one GPU): host time of the normal-mode calls, this tree against .baseline
# (HEAD before the repeat paths), alternating, at 1 rank and at 2 ranks sharing the GPU; then the
# repeated-call tests at 4 ranks sharing the GPU.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITONEP_TIMEOUT_S=20
export PYTHONUNBUFFERED=1
summary() { python3 - "$1" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))[0]
print("   ", " | ".join(f"{k} host {r[k]['host_us']} gpu {r[k]['gpu_us']}" for k in
      ("dispatch_cached", "dispatch_cached_fp8", "combine", "layout", "dispatch_fresh", "ll_dispatch") if k in r))
PY
}
for ranks in 1 2; do
  for round in 1 2; do
    for tree in new baseline; do
      [ "$ranks" = 2 ] && [ "$round" = 2 ] && continue
      path=$PWD; [ "$tree" = baseline ] && path=$PWD/.baseline
      echo "== $ranks rank(s), round $round, $tree"
      PYTHONPATH="$path" timeout 100 python3 scripts/host_path_probe.py --ranks $ranks \
        --json "$OUT/host_${ranks}_${round}_${tree}.json" > "$OUT/host_${ranks}_${round}_${tree}.log" 2>&1; echo "exit $?"
      summary "$OUT/host_${ranks}_${round}_${tree}.json"
    done
  done
done
echo "== cProfile of the new tree at 1 rank"
PYTHONPATH="$PWD" timeout 100 python3 scripts/host_path_probe.py --ranks 1 --profile > "$OUT/host_profile.log" 2>&1; echo "exit $?"
echo "== GPU tests at 4 ranks sharing the GPU: repeated calls"
PYTHONPATH="$PWD" TRITONEP_GPU_RANKS=4 timeout 150 python3 -m pytest -q -m gpu -rf tests/test_nvlink.py -k "repeated" \
  -p no:cacheprovider > "$OUT/gpu_tests_4.log" 2>&1; echo "exit $?"
tail -3 "$OUT/gpu_tests_4.log"
