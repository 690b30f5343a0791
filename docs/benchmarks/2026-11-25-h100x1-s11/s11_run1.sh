#!/usr/bin/env bash
# Session 11: today's device image, the tree of 86ecf58 unchanged: GPU tests at 1 rank (all
# but the race loops), a subset at 4 ranks sharing the GPU, the low-latency bench beside DeepEP.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITONEP_TIMEOUT_S=20
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv;
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/system.txt" 2>&1
cat "$OUT/system.txt"
(timeout 300 bash .bench_deps/build_on_device.sh .bench_deps/deepep-v1-*-src.tar.gz > "$OUT/deepep_build.log" 2>&1; echo "exit $?" >> "$OUT/deepep_build.log") &
build=$!
echo "== GPU tests at 1 rank, all but the race loops"
TRITONEP_GPU_RANKS=1 timeout 280 python3 -m pytest -q -m gpu -rf tests/test_nvlink.py tests/test_nvlink_low_latency.py \
  tests/test_deep_ep_compat.py tests/test_deep_ep_compat_low_latency.py tests/test_nvlink_buffer_lifetime.py \
  -k "not race_loop" -p no:cacheprovider > "$OUT/gpu_tests_1.log" 2>&1; echo "exit $?"
tail -3 "$OUT/gpu_tests_1.log"
echo "== GPU tests at 4 ranks sharing the GPU: variants, Buffer lifetime"
TRITONEP_GPU_RANKS=4 timeout 150 python3 -m pytest -q -m gpu -rf tests/test_nvlink.py tests/test_nvlink_buffer_lifetime.py \
  -k "variants or sizes or allocation or memory" -p no:cacheprovider > "$OUT/gpu_tests_4.log" 2>&1; echo "exit $?"
tail -3 "$OUT/gpu_tests_4.log"
wait $build; tail -n 1 "$OUT/deepep_build.log"
echo "== low-latency benchmark at one rank beside DeepEP"
PYTHONPATH="/tmp/deepep:$PYTHONPATH" timeout 120 python3 -m tritonep.bench --gpu --skip-normal --vs-deepep \
  --hidden 7168 --ll-tokens 128 --ll-experts 288 --out "$OUT" 2>&1 | grep -v Warning > "$OUT/bench_ll.log"; echo "exit $?"
tail -30 "$OUT/bench_ll.log"
