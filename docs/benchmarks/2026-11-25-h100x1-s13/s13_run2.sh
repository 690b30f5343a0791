#!/usr/bin/env bash
# Session 13, run 2 (one GPU), tree 879b09d + scripts/fresh_pairs_probe.py with --profile-after-wait
# and --gc-off: where a fresh dispatch's host time after its counts goes (run 1: 60-200 us).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITONEP_TIMEOUT_S=20
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
W=$OUT/run2; mkdir -p "$W"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv; lscpu | grep -E "Model name|^CPU\(s\)"; } > "$W/system.txt" 2>&1
brief() { python3 - "$1" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))[0]
for k in ("pair_differences_us", "collections_count_us"):
    print("   ", k, r[k])
for k in ("host_start_to_before_wait", "host_after_wait_to_return", "gpu_after_wait_to_end"):
    print("   ", k, r["stages"][k])
PY
}
for case in plain gc_off profile plain_again; do
  echo "== fresh pairs probe: $case"
  flags=""
  [ "$case" = gc_off ] && flags="--gc-off"
  [ "$case" = profile ] && flags="--profile-after-wait"
  timeout 120 python3 scripts/fresh_pairs_probe.py --ranks 1 --iters 100 $flags --json "$W/pairs_$case.json" \
    > "$W/pairs_$case.log" 2>&1; echo "exit $?"; brief "$W/pairs_$case.json"
done
head -45 "$W/pairs_profile.log"
cd "$OUT" && tar czf run2.tgz run2 && rm -rf run2
