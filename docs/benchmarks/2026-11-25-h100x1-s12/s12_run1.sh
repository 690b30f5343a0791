#!/usr/bin/env bash
# Session 12, run 1 (one GPU): where hook-mode time goes (scripts/hook_mode_probe.py), tritonep
# alone while DeepEP builds, then beside DeepEP V1.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITONEP_TIMEOUT_S=20
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv;
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/system.txt" 2>&1
cat "$OUT/system.txt"
(timeout 300 bash .bench_deps/build_on_device.sh .bench_deps/deepep-v1-*-src.tar.gz > "$OUT/deepep_build.log" 2>&1; echo "exit $?" >> "$OUT/deepep_build.log") &
build=$!
echo "== hook probe, tritonep alone, with cProfile"
timeout 200 python3 scripts/hook_mode_probe.py --profile --json "$OUT/hook_a.json" > "$OUT/hook_a.log" 2>&1; echo "exit $?"
grep -v Warning "$OUT/hook_a.log" | head -60
wait $build; tail -n 1 "$OUT/deepep_build.log"
echo "== hook probe beside DeepEP"
PYTHONPATH="/tmp/deepep:$PYTHONPATH" timeout 200 python3 scripts/hook_mode_probe.py --vs-deepep --json "$OUT/hook_b.json" > "$OUT/hook_b.log" 2>&1; echo "exit $?"
grep -v Warning "$OUT/hook_b.log" | head -60
