export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITONEP_TIMEOUT_S=20 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
{ date -u; nvidia-smi -L; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > $OUT/system.txt 2>&1
(timeout 300 bash .bench_deps/build_on_device.sh .bench_deps/deepep-v1-*-src.tar.gz > /tmp/deepep_build.log 2>&1; echo "exit $?" >> /tmp/deepep_build.log) &
build=$!
t() {  # ranks, timeout, log, -k expression
  TRITONEP_GPU_RANKS=$1 timeout $2 python3 -m pytest -v --tb=short -m gpu -rf tests/test_nvlink_low_latency.py \
    tests/test_deep_ep_compat_low_latency.py -k "$4" -p no:cacheprovider > $OUT/$3 2>&1
  echo "rc $?"; grep -cE "PASSED" $OUT/$3; grep -E "FAILED|passed|failed" $OUT/$3 | tail -6
}
echo "== 2 ranks sharing the GPU (combine default now 4 programs x 4 warps per SM, 4 rows)"
t 2 170 tests_2ranks.log "micro or repeated or dead_rank or stalled or third"
echo "== 4 ranks sharing the GPU"; t 4 170 tests_4ranks.log "masks or graph or benchmark_shape"
wait $build; tail -1 /tmp/deepep_build.log
echo "== bench, low latency at 1 rank beside DeepEP"
PYTHONPATH="/tmp/deepep:$PYTHONPATH" timeout 130 python3 -m tritonep.bench --gpu --skip-normal --vs-deepep --hidden 7168 --ll-tokens 128 \
  --ll-experts 288 --out $OUT/bench 2>&1 | grep -v Warning > $OUT/bench_ll.log; grep -E "pair|GPU time|graph|host CPU|send|recv" $OUT/bench_ll.log | grep -v all_to_all
cd $OUT && tar czf bench.tgz bench && rm -rf bench
