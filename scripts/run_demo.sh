#!/usr/bin/env bash
# The main job: install what is missing, then run the toy MoE layer of examples/moe_layer.py
# across ranks, with tritonep and with plain all_to_all_single, checked and timed.
# Arguments go to the example, e.g. `bash scripts/run_demo.sh --ranks 2 --tokens 1024`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
"$PY" examples/moe_layer.py "$@"
