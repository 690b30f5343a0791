export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITONEP_TIMEOUT_S=20 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
{ date -u; nvidia-smi -L; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > $OUT/system.txt 2>&1
t() {  # ranks, timeout, log, -k expression
  TRITONEP_GPU_RANKS=$1 timeout $2 python3 -m pytest -v --tb=short -m gpu -rf tests/test_nvlink_low_latency.py \
    tests/test_deep_ep_compat_low_latency.py -k "$4" -p no:cacheprovider > $OUT/$3 2>&1
  echo "rc $?"; grep -cE "PASSED" $OUT/$3; grep -E "FAILED|passed|failed" $OUT/$3 | tail -6
}
echo "== launch cost (repeat of run 4's code)"
timeout 50 python3 scripts/launch_cost_probe.py --json $OUT/launch_cost.json 2>&1 | grep -v Warn | grep -E "buffer|general|compiled|add_"
echo "== 4 ranks sharing the GPU, default shapes"; t 4 190 tests_4ranks.log "repeated or micro"
export TRITONEP_LL_COMBINE_WARPS=4 TRITONEP_LL_COMBINE_PROGRAMS_PER_SM=4 TRITONEP_LL_ROWS=4
echo "== 2 ranks, combine 4 programs x 4 warps per SM, 4 rows"; t 2 170 tests_2ranks_4x4.log "benchmark_shape or variants or graph or masks"
for round in 1 2; do
  for shape in 4x4 default; do
    [ $shape = default ] && unset TRITONEP_LL_COMBINE_WARPS TRITONEP_LL_COMBINE_PROGRAMS_PER_SM TRITONEP_LL_ROWS
    [ $shape = 4x4 ] && export TRITONEP_LL_COMBINE_WARPS=4 TRITONEP_LL_COMBINE_PROGRAMS_PER_SM=4 TRITONEP_LL_ROWS=4
    echo "== kernels, combine $shape, round $round"
    timeout 60 python3 scripts/host_path_probe.py --only-low-latency --json /tmp/probe_${shape}_$round.json 2>&1 | grep -E "graph_us" | head -4
  done
done
python3 - <<'PY' > $OUT/ll_kernels.json
import glob, json
print(json.dumps({f: json.load(open(f)) for f in sorted(glob.glob("/tmp/probe_*.json"))}, indent=1))
PY
