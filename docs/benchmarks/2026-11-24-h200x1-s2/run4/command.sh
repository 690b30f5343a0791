export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITONEP_TIMEOUT_S=20 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
{ date -u; nvidia-smi -L; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; git log -1 --oneline; } > $OUT/system.txt 2>&1
(timeout 300 bash .bench_deps/build_on_device.sh .bench_deps/deepep-v1-*-src.tar.gz > /tmp/deepep_build.log 2>&1; echo "exit $?" >> /tmp/deepep_build.log) &
build=$!
t() {  # ranks, timeout, log, -k expression
  TRITONEP_GPU_RANKS=$1 timeout $2 python3 -m pytest -v --tb=short -m gpu -rf tests/test_nvlink_low_latency.py \
    tests/test_deep_ep_compat_low_latency.py -k "$4" -p no:cacheprovider > $OUT/$3 2>&1
  echo "rc $?"; grep -cE "PASSED" $OUT/$3; grep -E "FAILED|passed|failed" $OUT/$3 | tail -6
}
echo "== 1 rank"; t 1 200 tests_1rank.log "repeated or micro or benchmark_shape or graph or variants"
echo "== 2 ranks sharing the GPU"; t 2 150 tests_2ranks.log "repeated or micro"
wait $build; tail -1 /tmp/deepep_build.log
echo "== launch cost"
timeout 50 python3 scripts/launch_cost_probe.py --json $OUT/launch_cost.json 2>&1 | grep -v Warn | tail -20
echo "== bench, low latency at 1 rank beside DeepEP"
PYTHONPATH="/tmp/deepep:$PYTHONPATH" timeout 130 python3 -m tritonep.bench --gpu --skip-normal --vs-deepep --hidden 7168 --ll-tokens 128 \
  --ll-experts 288 --out $OUT/bench 2>&1 | grep -v Warning > $OUT/bench_ll.log; grep -E "pair|GPU time|graph|host CPU" $OUT/bench_ll.log | grep -v all_to_all
cd $OUT && tar czf bench.tgz bench && rm -rf bench
