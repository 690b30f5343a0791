export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITONEP_TIMEOUT_S=20 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
{ date -u; nvidia-smi -L; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > $OUT/system.txt 2>&1
t() {  # ranks, timeout, log, -k expression
  TRITONEP_GPU_RANKS=$1 timeout $2 python3 -m pytest -v --tb=short -m gpu -rf tests/test_nvlink_low_latency.py \
    tests/test_deep_ep_compat_low_latency.py -k "$4" -p no:cacheprovider > $OUT/$3 2>&1
  echo "rc $?"; grep -cE "PASSED" $OUT/$3; grep -E "FAILED|passed|failed" $OUT/$3 | tail -6
}
echo "== 1 rank: two micro-batches, repeated calls, hooks"; t 1 150 tests_1rank.log "micro or repeated or hook"
echo "== 2 ranks sharing the GPU: two micro-batches, repeated calls, masks"; t 2 220 tests_2ranks.log "micro or repeated or masks"
export TRITONEP_LL_COMBINE_WARPS=4 TRITONEP_LL_COMBINE_PROGRAMS_PER_SM=4 TRITONEP_LL_ROWS=4
echo "== 2 ranks, combine 4 programs x 4 warps per SM, 4 rows: masks"; t 2 110 tests_2ranks_4x4.log "masks"
unset TRITONEP_LL_COMBINE_WARPS TRITONEP_LL_COMBINE_PROGRAMS_PER_SM TRITONEP_LL_ROWS
echo "== launch cost, new then baseline (.baseline = 5649ed7)"
timeout 60 python3 scripts/launch_cost_probe.py --json $OUT/launch_cost.json 2>&1 | grep -v Warn | tail -17
PYTHONPATH=$PWD/.baseline:$PWD/scripts timeout 60 python3 scripts/launch_cost_probe.py --json $OUT/launch_cost_baseline.json > /dev/null 2>&1
cat $OUT/launch_cost_baseline.json
