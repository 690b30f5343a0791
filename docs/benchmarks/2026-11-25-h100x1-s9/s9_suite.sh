#!/usr/bin/env bash
# Session 9: a pytest selection at RANKS ranks sharing one GPU; after DUMP_AT s still running,
# every Python process dumps its stacks (SIGUSR1, .bench_deps/site/sitecustomize.py).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/.bench_deps/site:$PWD TRITONEP_TIMEOUT_S=${TRITONEP_TIMEOUT_S:-60}
export TRITONEP_GPU_RANKS=$RANKS TRITONEP_TEST_DEFAULT_DTYPE=bfloat16 TRITONEP_TEST_DEFAULT_DEVICE=cuda
date -u; echo "== RANKS=$RANKS FILES=$FILES K=$K timeout ${TRITONEP_TIMEOUT_S}s"
python3 -m pytest -v -s -m gpu -rf $FILES -k "$K" -p no:cacheprovider > $OUT/suite.log 2>&1 &
pid=$!
for i in $(seq 1 $DUMP_AT); do sleep 1; kill -0 $pid 2>/dev/null || break; done
if kill -0 $pid 2>/dev/null; then
  echo "== still running after $DUMP_AT s: stacks"; nvidia-smi --query-compute-apps=pid,used_memory --format=csv
  pkill -USR1 -f python3; sleep 5; pkill -9 -f pytest; pkill -9 -f multiprocessing; sleep 2
fi
wait $pid; echo "exit $?"
grep -v "Warning: \|warnings.warn" $OUT/suite.log | tail -150
