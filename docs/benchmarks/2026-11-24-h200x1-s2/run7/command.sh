export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITONEP_TIMEOUT_S=20 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
{ date -u; nvidia-smi -L; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > $OUT/system.txt 2>&1
(timeout 300 bash .bench_deps/build_on_device.sh .bench_deps/deepep-v1-*-src.tar.gz > /tmp/deepep_build.log 2>&1; echo "exit $?" >> /tmp/deepep_build.log) &
build=$!
echo "== dead rank (3 ranks on the GPU, killed and stalled)"
timeout 200 python3 -m pytest -v --tb=short -m gpu -rf tests/test_nvlink_low_latency.py -k "dead_rank" -p no:cacheprovider > $OUT/tests_dead_rank.log 2>&1
echo "rc $?"; grep -E "PASSED|FAILED|passed|failed" $OUT/tests_dead_rank.log | tail -4
wait $build; tail -1 /tmp/deepep_build.log
echo "== launch cost"
timeout 50 python3 scripts/launch_cost_probe.py --json $OUT/launch_cost.json 2>&1 | grep -v Warn | grep -E "buffer|general|compiled|add_|bindings"
echo "== bench, low latency at 1 rank beside DeepEP"
PYTHONPATH="/tmp/deepep:$PYTHONPATH" timeout 150 python3 -m tritonep.bench --gpu --skip-normal --vs-deepep --hidden 7168 --ll-tokens 128 \
  --ll-experts 288 --out $OUT 2>&1 | grep -v Warning > $OUT/bench_ll.log; grep -E "pair|GPU time|graph|host CPU" $OUT/bench_ll.log | grep -v all_to_all
