export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TRITONEP_TIMEOUT_S=20 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
{ date -u; nvidia-smi -L; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > $OUT/system.txt 2>&1
echo "== 1 rank, DeepEP's torch defaults (cuda device, bf16 dtype): low-latency compatibility tests"
TRITONEP_GPU_RANKS=1 TRITONEP_TEST_DEFAULT_DTYPE=bfloat16 TRITONEP_TEST_DEFAULT_DEVICE=cuda timeout 170 python3 -m pytest -v --tb=short -m gpu -rf \
  tests/test_deep_ep_compat_low_latency.py -p no:cacheprovider > $OUT/tests_compat_1rank_defaults.log 2>&1
echo "rc $?"; grep -c PASSED $OUT/tests_compat_1rank_defaults.log; grep -E "FAILED|passed|failed" $OUT/tests_compat_1rank_defaults.log | tail -5
echo "== 1 rank: race loop"
TRITONEP_GPU_RANKS=1 timeout 120 python3 -m pytest -v --tb=short -m gpu -rf tests/test_nvlink_low_latency.py -k race_loop -p no:cacheprovider > $OUT/tests_race_1rank.log 2>&1
echo "rc $?"; grep -E "PASSED|FAILED|passed|failed" $OUT/tests_race_1rank.log | tail -3
