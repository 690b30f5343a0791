#!/usr/bin/env bash
# Session 13, run 3 (one GPU): scripts/row_copy_probe.py, bytes per second per program of the
# row-gather loop in three loop shapes (shipped, pipelined with num_stages, register prefetch).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
W=$OUT/run3; mkdir -p "$W"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv; } > "$W/system.txt" 2>&1
timeout 500 python3 scripts/row_copy_probe.py --json "$W/row_copy.json" 2>&1 | grep -v Warn | tee "$W/row_copy.log"
cd "$OUT" && tar czf run3.tgz run3 && rm -rf run3
