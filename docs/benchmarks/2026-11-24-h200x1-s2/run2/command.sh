export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITONEP_TIMEOUT_S=20 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
{ date -u; nvidia-smi -L; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > $OUT/system.txt 2>&1
(timeout 300 bash .bench_deps/build_on_device.sh .bench_deps/deepep-v1-*-src.tar.gz > /tmp/deepep_build.log 2>&1; echo "exit $?" >> /tmp/deepep_build.log) &
build=$!
echo "== 1 rank: low-latency GPU tests (fast path)"
TRITONEP_GPU_RANKS=1 timeout 170 python3 -m pytest -q -m gpu -rf tests/test_nvlink_low_latency.py tests/test_deep_ep_compat_low_latency.py \
  -k "repeated or benchmark_shape or micro or graph or variants or zero_copy or hook" -p no:cacheprovider > $OUT/tests_1rank.log 2>&1
tail -3 $OUT/tests_1rank.log
for shape in default 4x4; do
  if [ $shape = 4x4 ]; then export TRITONEP_LL_COMBINE_WARPS=4 TRITONEP_LL_COMBINE_PROGRAMS_PER_SM=4 TRITONEP_LL_ROWS=4; fi
  echo "== 2 ranks sharing the GPU, combine shape $shape: masks and repeated calls"
  TRITONEP_GPU_RANKS=2 timeout 100 python3 -m pytest -q -m gpu -rf tests/test_nvlink_low_latency.py -k "masks or repeated" \
    -p no:cacheprovider > $OUT/tests_2ranks_$shape.log 2>&1
  tail -3 $OUT/tests_2ranks_$shape.log
done
unset TRITONEP_LL_COMBINE_WARPS TRITONEP_LL_COMBINE_PROGRAMS_PER_SM TRITONEP_LL_ROWS
echo "== launch cost, new then baseline (.baseline = 5649ed7)"
timeout 90 python3 scripts/launch_cost_probe.py --json $OUT/launch_cost.json 2>&1 | grep -v Warn | tail -22
PYTHONPATH=$PWD/.baseline:$PWD/scripts timeout 90 python3 scripts/launch_cost_probe.py --json $OUT/launch_cost_baseline.json 2>&1 | grep -v Warn | tail -14
wait $build; tail -1 /tmp/deepep_build.log
echo "== bench, low latency at 1 rank beside DeepEP"
PYTHONPATH="/tmp/deepep:$PYTHONPATH" timeout 150 python3 -m tritonep.bench --gpu --skip-normal --vs-deepep --hidden 7168 --ll-tokens 128 \
  --ll-experts 288 --out $OUT/bench 2>&1 | grep -v Warning > $OUT/bench_ll.log; tail -25 $OUT/bench_ll.log
cd $OUT && tar czf bench.tgz bench && rm -rf bench
