#!/usr/bin/env bash
# The main job: install what is missing, then run the toy MoE demo across ranks.
# Arguments go to the demo, e.g. `bash scripts/run_demo.sh --ranks 2 --tokens 1024`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
"$PY" -m tritonep.demo "$@"
