#!/usr/bin/env bash
# Session 13, run 4 (one GPU): scripts/row_copy_probe.py with the Gluon TMA variant (one row per TMA load and store, STAGES rows in flight, the refill after its store read the slot or one store later).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
W=$OUT/run4; mkdir -p "$W"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv; } > "$W/system.txt" 2>&1
timeout 500 python3 scripts/row_copy_probe.py --json "$W/row_copy.json" 2>&1 | grep -v Warn > "$W/row_copy.log"
grep -E "shipped|tma|rror|WRONG" "$W/row_copy.log" | head -60
cd "$OUT" && tar czf run4.tgz run4 && rm -rf run4
