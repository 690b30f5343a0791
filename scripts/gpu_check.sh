#!/usr/bin/env bash
# Everything we run on the GPU machine, in one call: GPU tests, the benchmark, the demo.
# Logs and JSON go to $OUT (the device tool brings that folder back).
#   bash scripts/gpu_check.sh [quick|full|normal|short|tests|bench|profile|ll|llprofile|llsource|llab|compat|shared|host|sweep|fresh|cehost]
#     normal: normal mode (tests, STRESS=N: N rounds of scripts/dispatch_stress.py per
#     STRESS_VARIANTS, profile unless PROFILE=0, HOST_PROBE=1: host-path probe, bench with DeepEP,
#     low-latency part too when BENCH_ARGS is set; DeepEP builds during the tests); short: for a
#     multi-GPU machine with little device time, a subset of the tests, the bench at R ranks
#     (both modes) and at EP2 beside DeepEP, in one call;
#     full: GPU tests, benchmark (SWEEP=0: without its sweeps; DeepEP side by side when
#     .bench_deps holds its sources), demo; tests / bench: the first / the second part alone;
#     profile: scripts/normal_profile.py (kernel and copy times of the normal-mode calls);
#     quick: a subset of the GPU tests, no benchmark sweep; ll: the low-latency tests and
#     benchmark only; sweep: the low-latency kernels over LL_SWEEP shapes (ll_sweep); compat:
#     the DeepEP compatibility tests, ll_sweep and the host-path probe (plain and under
#     DeepEP's torch defaults), which also run on a machine with one GPU; shared: the GPU
#     tests at SHARED_RANKS ranks (default "2 4") on however many GPUs there are, ranks sharing
#     GPUs (correctness across processes, not speed; see tritonep/launch.py; STRESS=N adds the
#     dispatch stress at each rank count); host: for a
#     machine with one GPU, the GPU tests at HOST_RANKS ranks (default 1), the host-path probes
#     (A/B against BASELINE=path when set) and DeepEP's low-latency calls side by side; fresh:
#     for a machine with one GPU too, the normal-mode host path stage by stage and the
#     benchmark's normal-mode rows (A/B against BASELINE=path when set); llsource: where the
#     low-latency dispatch kernel stalls, by source line (one GPU); llab: the low-latency kernels
#     A/B against BASELINE, and beside DeepEP at one rank (one GPU); cehost: the copy-engine
#     combine's host operations one by one (scripts/copy_engine_host_probe.py, CE_RANKS).
set -uo pipefail
MODE=${1:-full}
OUT=${OUT:-out}
mkdir -p "$OUT"
ABS_OUT=$(cd "$OUT" && pwd)
# Never enable NVLink multicast on the shared machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TRITONEP_TIMEOUT_S=${TRITONEP_TIMEOUT_S:-20}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nvidia-smi topo -m
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git log -1 --oneline 2>/dev/null || true
} > "$OUT/system.txt" 2>&1
cat "$OUT/system.txt"

# The low-latency kernels alone (CUDA-graph replay) over their tile shapes: LL_SWEEP lists
# rows:warps[:programs per SM[:receive rows]] (rows: the combine's rows per step; receive rows:
# the dispatch receive's); with BASELINE=path also a package copy from before a change (its
# default shape), for an A/B in the same run.
ll_sweep() {
  for shape in ${LL_SWEEP:-2:8:2:4 4:4:4:4 2:4:4:4}; do
    IFS=: read -r rows warps per_sm recv_rows <<< "$shape"
    per_sm=${per_sm:-1} recv_rows=${recv_rows:-4}
    echo "== low-latency kernels: rows $rows, warps $warps, programs per SM $per_sm, receive rows $recv_rows"
    TRITONEP_LL_ROWS=$rows TRITONEP_LL_WARPS=$warps TRITONEP_LL_COMBINE_WARPS=$warps TRITONEP_LL_RECV_ROWS=$recv_rows \
      TRITONEP_LL_PROGRAMS_PER_SM=$per_sm TRITONEP_LL_COMBINE_PROGRAMS_PER_SM=$per_sm timeout 150 python3 scripts/host_path_probe.py --only-low-latency \
      --json "$OUT/ll_$rows-$warps-$per_sm-$recv_rows.json" 2>&1 | grep -v Warning >> "$OUT/ll_sweep.log"
  done
  if [ -n "${BASELINE:-}" ]; then
    echo "== low-latency kernels: baseline package $BASELINE"
    PYTHONPATH="$BASELINE" timeout 150 python3 scripts/host_path_probe.py --only-low-latency \
      --json "$OUT/ll_baseline.json" 2>&1 | grep -v Warning >> "$OUT/ll_sweep.log"
  fi
  # One table and one JSON for the sweep (the device tool brings back few files).
  python3 - "$OUT" <<'PYEOF'
import glob, json, os, sys
merged = {}
for path in sorted(glob.glob(os.path.join(sys.argv[1], "ll_*.json"))):
  name = os.path.basename(path)[len("ll_"):-len(".json")]
  merged[name] = report = json.load(open(path))[0]
  os.remove(path)
  cells = [f"{call} {report[call].get('graph_us')} us (host {report[call].get('host_us')})"
           for call in ("ll_dispatch", "ll_dispatch_bf16", "ll_combine") if call in report]
  print(f"{name:<12}", " | ".join(cells))
json.dump(merged, open(os.path.join(sys.argv[1], "ll_sweep.json"), "w"), indent=1)
PYEOF
}

# DeepEP V1 for the side-by-side rows (--vs-deepep), when .bench_deps holds its sources (see
# ../shared/deepep/README.md): it builds on the CPUs in the background while the GPU work runs;
# wait_deepep_build waits for it (false when there is none).
start_deepep_build() {
  [ -f .bench_deps/build_on_device.sh ] || return 0
  (timeout 400 bash .bench_deps/build_on_device.sh .bench_deps/deepep-v1-*-src.tar.gz > "$OUT/deepep_build.log" 2>&1;
   echo "exit $?" >> "$OUT/deepep_build.log") &
  build=$!
}
wait_deepep_build() {
  [ -n "${build:-}" ] || return 1
  wait "$build"; tail -n 2 "$OUT/deepep_build.log"
}
# The low-latency benchmark at one rank beside DeepEP, DeepEP's decode shape (after start_deepep_build).
bench_ll_beside_deepep() {
  wait_deepep_build || return 0
  echo "== low-latency benchmark at one rank beside DeepEP"
  PYTHONPATH="/tmp/deepep:$PYTHONPATH" timeout 200 python3 -m tritonep.bench --gpu --skip-normal --vs-deepep \
    --hidden 7168 --ll-tokens 128 --ll-experts 288 --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/bench_ll.log" | tail -32
}
# The warm low-latency dispatch launches of scripts/ll_kernel_profile.py that llsource and llab
# profile, name:launches to skip (8 single launches, then send/receive pairs).
DISPATCH_LAUNCHES="single:6 send:14 receive:15"

if [ "$MODE" = sweep ]; then
  ll_sweep
  exit $status
fi

if [ "$MODE" = llsource ]; then
  # One GPU is enough: where the low-latency dispatch kernel's warps stall, by source line
  # (scripts/ncu_hotspots.py), for a warm single launch, a warm send half and its receive half
  # of scripts/ll_kernel_profile.py. Reports and CSVs end up in one archive.
  for launch in $DISPATCH_LAUNCHES; do
    IFS=: read -r name skip <<< "$launch"
    echo "== ncu source hotspots: low_latency_dispatch_kernel, $name launch"
    timeout ${NCU_TIMEOUT:-150} ncu --clock-control none --set full --import-source yes \
      -k regex:low_latency_dispatch --launch-skip "$skip" --launch-count 1 -f -o "$OUT/ncu_src_$name" \
      python3 scripts/ll_kernel_profile.py > "$OUT/ncu_src_$name.log" 2>&1 || { status=1; tail -5 "$OUT/ncu_src_$name.log"; }
    ncu -i "$OUT/ncu_src_$name.ncu-rep" --page details 2>&1 | grep -E "^    Duration|Registers Per" | head -2
    python3 scripts/ncu_hotspots.py "$OUT/ncu_src_$name.ncu-rep" --top ${HOT_LINES:-25} 2>&1 | tee "$OUT/hot_$name.log"
  done
  (cd "$OUT" && tar czf ncu_src.tgz ncu_src_* hot_* && rm -f ncu_src_*)
  exit $status
fi

if [ "$MODE" = llab ]; then
  # One GPU is enough: the low-latency kernels against the package at BASELINE (default
  # .baseline), ROUNDS alternating rounds of CUDA-graph replay (host_path_probe), each
  # dispatch launch's duration under ncu (single launch, send half, receive half), and with
  # .bench_deps the benchmark at one rank beside DeepEP.
  start_deepep_build
  for round in $(seq "${ROUNDS:-2}"); do
    for package in "" "${BASELINE:-.baseline}"; do
      tag=${package:+baseline_}$round
      PYTHONPATH="${package:+$package:}$PYTHONPATH" timeout 150 python3 scripts/host_path_probe.py --only-low-latency \
        --json "$OUT/ll_$tag.json" > "$OUT/ll_$tag.log" 2>&1 || status=1
      echo "== round $round ${package:-(this tree)}: $(grep -E "graph_us" "$OUT/ll_$tag.log" | tr -s ' ' | tr '\n' ';')"
    done
  done
  for package in "" "${BASELINE:-.baseline}"; do
    for launch in $DISPATCH_LAUNCHES; do
      IFS=: read -r name skip <<< "$launch"
      PYTHONPATH="${package:+$package:}$PYTHONPATH" timeout 100 ncu --clock-control none --section SpeedOfLight \
        -k regex:low_latency_dispatch --launch-skip "$skip" --launch-count 1 python3 scripts/ll_kernel_profile.py \
        > "$OUT/ncu_$name${package:+_baseline}.log" 2>&1
      echo "ncu ${package:-(this tree)} $name: $(grep -E '^ +Duration' "$OUT/ncu_$name${package:+_baseline}.log")"
    done
  done
  bench_ll_beside_deepep
  (cd "$OUT" && tar czf llab.tgz ll_* ncu_* && rm -f ll_* ncu_*)
  exit $status
fi

if [ "$MODE" = llprofile ]; then
  # One GPU is enough: the low-latency kernels under Nsight Compute (warm launches of
  # scripts/ll_kernel_profile.py: two single-launch dispatches, three send/receive pairs, a
  # combine), the host path with cProfile, the LL_SWEEP shapes, and DeepEP's low-latency calls
  # at one rank in the same run when .bench_deps holds its sources (built during the rest).
  start_deepep_build
  for kernel in dispatch combine; do
    [ $kernel = dispatch ] && launches="--launch-skip 6 --launch-count 8" || launches="--launch-skip 4 --launch-count 1"
    echo "== ncu: low_latency_${kernel}_kernel ($launches)"
    timeout ${NCU_TIMEOUT:-200} ncu --clock-control none --set full --import-source yes -k "regex:low_latency_$kernel" \
      $launches -f -o "$OUT/ncu_ll_$kernel" python3 scripts/ll_kernel_profile.py > "$OUT/ncu_ll_$kernel.log" 2>&1
    echo "exit $?"; tail -n 3 "$OUT/ncu_ll_$kernel.log"
    ncu -i "$OUT/ncu_ll_$kernel.ncu-rep" --page details > "$OUT/ncu_ll_${kernel}_details.txt" 2>&1
    grep -E "Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Memory Throughput|One or More|No Eligible|Block Limit" \
      "$OUT/ncu_ll_${kernel}_details.txt" | head -${NCU_LINES:-60}
  done
  tar -C "$OUT" -czf "$OUT/ncu_ll.tgz" $(cd "$OUT" && ls ncu_ll_*) && (cd "$OUT" && rm -f ncu_ll_*)
  echo "== host path probe, low-latency calls (cProfile per call)"
  timeout 200 python3 scripts/host_path_probe.py --only-low-latency --profile --json "$OUT/host_path.json" \
    > "$OUT/host_path.log" 2>&1 || status=1
  grep -v Warning "$OUT/host_path.log" | grep -E "^==|host_us|gpu_us|graph_us|tottime|\.py:" | head -${HOST_LINES:-70}
  [ -z "${LL_SWEEP:-}" ] || ll_sweep
  bench_ll_beside_deepep
  exit $status
fi

if [ "$MODE" = compat ]; then
  echo "== compatibility tests (R = $(nvidia-smi -L | wc -l) GPUs)"
  timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -m gpu tests/test_deep_ep_compat.py tests/test_deep_ep_compat_low_latency.py -p no:cacheprovider \
    2>&1 | tee "$OUT/gpu_compat_tests.log" | tail -25
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  ll_sweep
  for defaults in "" --defaults; do
    echo "== host path probe $defaults"
    timeout 240 python3 scripts/host_path_probe.py $defaults --json "$OUT/host_path${defaults:+_defaults}.json" \
      2>&1 | grep -v Warning | tee -a "$OUT/host_path.log" | tail -45
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  done
  exit $status
fi

if [ "$MODE" = host ]; then
  # One GPU is enough: the GPU tests at HOST_RANKS ranks (sharing the GPU), the host-path
  # probes, DeepEP's low-latency calls side by side when .bench_deps holds its sources, and
  # (HOST_NVSHMEM=1) whether NVSHMEM runs several ranks on one GPU.
  for ranks in ${HOST_RANKS:-1}; do
    echo "== GPU tests at $ranks rank(s): ${HOST_TESTS:-all but the race loops}"
    TRITONEP_GPU_RANKS=$ranks timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -m gpu -rf \
      tests/test_nvlink.py tests/test_nvlink_low_latency.py tests/test_deep_ep_compat.py \
      tests/test_deep_ep_compat_low_latency.py -k "${HOST_TESTS:-not race_loop}" \
      -p no:cacheprovider > "$OUT/gpu_tests_$ranks.log" 2>&1
    [ $? -eq 0 ] || status=1
    grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tests_$ranks.log" | tail -15
  done
  echo "== host path probe${HOST_PROFILE:+ (cProfile per call)}"
  timeout 300 python3 scripts/host_path_probe.py ${HOST_PROFILE:+--profile} --json "$OUT/host_path.json" \
    > "$OUT/host_path.log" 2>&1 || status=1
  grep -v Warning "$OUT/host_path.log" | grep -E "^==|host_us|gpu_us|graph_us|error" | head -40
  if [ -n "${BASELINE:-}" ]; then   # the package before a change, same run (A/B)
    echo "== host path probe, baseline package $BASELINE"
    PYTHONPATH="$BASELINE:$PYTHONPATH" timeout 150 python3 scripts/host_path_probe.py \
      --json "$OUT/host_path_baseline.json" > "$OUT/host_path_baseline.log" 2>&1 || status=1
    grep -E "host_us|gpu_us|graph_us|error" "$OUT/host_path_baseline.log" | head -30
  fi
  echo "== launch cost, layer by layer"
  timeout 120 python3 scripts/launch_cost_probe.py --json "$OUT/launch_cost.json" 2>&1 | grep -v Warning | tail -16
  start_deepep_build   # built here, not during the probes: they time the host
  bench_ll_beside_deepep
  if [ -n "${HOST_NVSHMEM:-}" ]; then
    echo "== NVSHMEM, two ranks on one GPU"
    timeout 120 python3 scripts/nvshmem_shared_gpu_probe.py --ranks 2 > "$OUT/nvshmem_probe.log" 2>&1
    echo "exit $?"; grep -E "^rank|FAILED|Error|MPG" "$OUT/nvshmem_probe.log" | head -12
  fi
  exit $status
fi

if [ "$MODE" = fresh ]; then
  # One GPU is enough: the normal-mode host path stage by stage (scripts/fresh_dispatch_timeline.py)
  # and the benchmark's normal-mode rows at the machine's rank count; with BASELINE=path both
  # again for the package there, ROUNDS times alternating (A/B in one run: this machine's host
  # speed drifts within minutes). Logs, JSON and PNGs end up in one archive.
  # The first benchmark process after the machine has idled ran slow even on rows no change
  # touched (2026-11-24-h200x1-s5): one untimed short run goes first.
  timeout 120 python3 -m tritonep.bench --gpu --ranks 1 --tokens 4096 --hidden 7168 --skip-low-latency --iters 5 \
    --out "$ABS_OUT/warmup" > /dev/null 2>&1; rm -rf "$ABS_OUT/warmup"
  for round in $(seq "${ROUNDS:-1}"); do
    for package in "" ${BASELINE:-}; do
      tag=${package:+_baseline}_$round
      echo "== round $round, fresh dispatch timeline${package:+ (baseline $package)}"
      PYTHONPATH="${package:+$package:}$PYTHONPATH" timeout 200 python3 scripts/fresh_dispatch_timeline.py \
        --json "$OUT/timeline$tag.json" 2>&1 | grep -v Warn > "$OUT/timeline$tag.log"
      head -${TIMELINE_LINES:-30} "$OUT/timeline$tag.log"
      echo "== round $round, benchmark, normal mode${package:+ (baseline $package)}"
      # python -m puts the working directory first on sys.path, ahead of PYTHONPATH: the
      # baseline's bench runs from the baseline's folder, or it would import this tree.
      (cd "${package:-.}" && PYTHONPATH="${package:+$PWD:}$PYTHONPATH" timeout 240 python3 -m tritonep.bench --gpu \
        --ranks "$(nvidia-smi -L | wc -l)" --tokens 4096 --hidden 7168 --skip-low-latency --out "$ABS_OUT/bench$tag" \
        2>&1 | grep -v Warn > "$ABS_OUT/bench$tag.log"
      python3 -c "import tritonep; print('bench package:', tritonep.__file__)" >> "$ABS_OUT/bench$tag.log")
      grep -E "^tritonep|^all_to_all_single path: (cached|combine)" "$OUT/bench$tag.log"
    done
  done
  (cd "$OUT" && tar czf fresh.tgz $(ls | grep -v 'fresh.tgz\|system.txt') && rm -rf $(ls | grep -v 'fresh.tgz\|system.txt'))
  exit $status
fi

if [ "$MODE" = shared ]; then
  for ranks in ${SHARED_RANKS:-2 4}; do
    echo "== GPU tests at $ranks ranks on $(nvidia-smi -L | wc -l) GPU(s), DeepEP's torch defaults"
    TRITONEP_GPU_RANKS=$ranks TRITONEP_TEST_DEFAULT_DTYPE=bfloat16 TRITONEP_TEST_DEFAULT_DEVICE=cuda \
      timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -m gpu -rf ${SHARED_TESTS:-tests/test_nvlink.py \
      tests/test_nvlink_low_latency.py tests/test_deep_ep_compat.py tests/test_deep_ep_compat_low_latency.py} \
      -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests_shared_$ranks.log" | tail -12
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    if [ -n "${STRESS:-}" ]; then   # repeated normal-mode cases against the CPU backend
      echo "== dispatch stress at $ranks ranks ($STRESS rounds per variant)"
      TRITONEP_GPU_RANKS=$ranks PYTHONPATH="$PWD/tests:$PYTHONPATH" timeout ${STRESS_TIMEOUT:-300} \
        python3 scripts/dispatch_stress.py --rounds "$STRESS" --variants ${STRESS_VARIANTS:-defaults} 2>&1 \
        | grep -v Warn | tee "$OUT/stress_shared_$ranks.log" | tail -8
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    fi
  done
  exit $status
fi

if [ "$MODE" = short ]; then
  # A machine of several GPUs and little device time left: one call of under 10 minutes (time
  # limits 180 + 200 + 200 s) with the figures both open issues need. DeepEP builds on the CPUs
  # while a subset of the GPU tests runs at R ranks (one per GPU; SHORT_TESTS picks them); then
  # the benchmark at R ranks beside DeepEP, normal and low-latency modes, no sweep; then, with
  # more than 2 GPUs, the normal-mode benchmark at EP2 beside DeepEP.
  start_deepep_build
  gpus=$(nvidia-smi -L | wc -l)
  echo "== GPU tests at $gpus ranks (${SHORT_TESTS:-variants, hidden 7168, fresh then cached, low-latency shapes and micro-batches})"
  TRITONEP_TEST_DEFAULT_DTYPE=bfloat16 TRITONEP_TEST_DEFAULT_DEVICE=cuda \
    timeout ${TEST_TIMEOUT:-180} python3 -m pytest -q -m gpu -rf tests/test_nvlink.py tests/test_nvlink_low_latency.py \
    -k "${SHORT_TESTS:-variants or 7168 or fresh_then_cached or benchmark_shape or two_micro_batches}" \
    -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -8
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  wait_deepep_build && export PYTHONPATH="/tmp/deepep:$PYTHONPATH"
  echo "== benchmark at $gpus ranks beside DeepEP"
  timeout ${BENCH_TIMEOUT:-200} python3 -m tritonep.bench --vs-deepep --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log" \
    | grep -v Warning | tail -50
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  if [ "$gpus" -gt 2 ]; then
    echo "== normal-mode benchmark at 2 ranks beside DeepEP"
    timeout ${BENCH_TIMEOUT:-200} python3 -m tritonep.bench --ranks 2 --vs-deepep --skip-low-latency --out "$OUT/bench_ep2" \
      2>&1 | tee "$OUT/bench_ep2.log" | grep -v Warning | tail -30
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  fi
  # One archive: the device tool brings back at most 8 files per call.
  tar czf /tmp/short.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/short.tgz "$OUT"/
  exit $status
fi

if [ "$MODE" = normal ]; then
  # Normal mode only, in one call: DeepEP builds on the CPUs while the GPU tests run, then
  # the profile of the normal-mode calls and the benchmark side by side with DeepEP.
  start_deepep_build
  echo "== normal-mode GPU tests, under DeepEP's torch defaults (cuda device, bf16 dtype)"
  TRITONEP_TEST_DEFAULT_DTYPE=bfloat16 TRITONEP_TEST_DEFAULT_DEVICE=cuda \
    timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -m gpu -rf ${NORMAL_TESTS:-tests/test_nvlink.py} \
    -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  if [ -n "${STRESS:-}" ]; then   # repeated cases against the CPU backend, per Tuning variant
    echo "== dispatch stress ($STRESS rounds per variant)"
    PYTHONPATH="$PWD/tests:$PYTHONPATH" timeout 300 python3 scripts/dispatch_stress.py --rounds "$STRESS" \
      --variants ${STRESS_VARIANTS:-defaults} 2>&1 | grep -v Warn | tee "$OUT/stress.log" | tail -12
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  fi
  # The profile also times the combine with 1 and 2 pieces per peer (the default picks by rank
  # count, combine_copy_engine.pieces_per_peer: which is faster at EP4 and EP8 is still to measure).
  [ "${PROFILE:-1}" = 0 ] || echo "== profile"
  [ "${PROFILE:-1}" = 0 ] || timeout 150 python3 scripts/normal_profile.py --json "$OUT/normal_profile.json" \
    --combine-variants ${COMBINE_VARIANTS:-combine_pieces=1 combine_pieces=2} 2>&1 | grep -v Warning \
    | tee "$OUT/normal_profile.log" | tail -60
  if [ -n "${HOST_PROBE:-}" ]; then   # the host path of each call, with cProfile
    echo "== host path probe (cProfile per call)"
    timeout 200 python3 scripts/host_path_probe.py --profile --json "$OUT/host_path.json" > "$OUT/host_path.log" 2>&1
    grep -v Warning "$OUT/host_path.log" | grep -E "^==|host_us|gpu_us|tottime|\.py:" | head -${HOST_LINES:-80}
  fi
  wait_deepep_build && export PYTHONPATH="/tmp/deepep:$PYTHONPATH"
  echo "== benchmark (normal mode)"
  timeout ${BENCH_TIMEOUT:-200} python3 -m tritonep.bench --vs-deepep ${BENCH_ARGS:---skip-low-latency} \
    --out "$OUT" 2>&1 | tee "$OUT/bench.log" | grep -v Warning | tail -30
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  exit $status
fi

if [ "$MODE" = cehost ]; then
  # The copy-engine combine's host operations one by one (scripts/copy_engine_host_probe.py),
  # at CE_RANKS ranks (default "1 2 4"; ranks beyond the GPUs share them, only rank 0 times).
  for ranks in ${CE_RANKS:-1 2 4}; do
    echo "== copy-engine host probe, $ranks rank(s)"
    timeout 200 python3 scripts/copy_engine_host_probe.py --ranks "$ranks" --json "$OUT/ce_host_$ranks.json" \
      2>&1 | grep -v Warning | tee "$OUT/ce_host_$ranks.log" | tail -40
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  done
  exit $status
fi

if [ "$MODE" = profile ]; then
  # Where the normal-mode GPU time goes (kernels and copy-engine copies, per rank).
  timeout 200 python3 scripts/normal_profile.py --json "$OUT/normal_profile.json" \
    ${COMBINE_VARIANTS:+--combine-variants $COMBINE_VARIANTS} 2>&1 | grep -v Warning \
    | tee "$OUT/normal_profile.log" | tail -40
  exit "${PIPESTATUS[0]}"
fi

if [ "$MODE" = quick ]; then
  tests=(tests/test_nvlink.py tests/test_nvlink_low_latency.py -k "variants or 7168 or race or graph")
  bench_args=()
elif [ "$MODE" = ll ]; then
  tests=(tests/test_nvlink_low_latency.py)
  bench_args=(--skip-normal)
else
  tests=(tests/test_nvlink.py tests/test_nvlink_low_latency.py tests/test_deep_ep_compat.py tests/test_deep_ep_compat_low_latency.py)
  bench_args=()
  [ "${SWEEP:-1}" = 0 ] || bench_args=(--sweep)
fi
# tests: the GPU tests alone; bench: the benchmark (and DeepEP) alone; full: both and the demo.
if [ "$MODE" != bench ]; then
  echo "== GPU tests ($MODE), under DeepEP's torch defaults (cuda device, bf16 dtype)"
  TRITONEP_TEST_DEFAULT_DTYPE=bfloat16 TRITONEP_TEST_DEFAULT_DEVICE=cuda \
    timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -m gpu -rf "${tests[@]}" -p no:cacheprovider \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -25
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  [ "$MODE" != tests ] || exit $status
fi

# DeepEP V1 side by side (--vs-deepep) when its sources were carried in .bench_deps (see
# ../shared/deepep/README.md: mkdir -p .bench_deps && cp ../shared/deepep/* .bench_deps/).
start_deepep_build
if wait_deepep_build; then
  export PYTHONPATH="/tmp/deepep:$PYTHONPATH"
  bench_args+=(--vs-deepep)
fi
echo "== benchmark"
timeout ${BENCH_TIMEOUT:-300} python3 -m tritonep.bench "${bench_args[@]}" --out "$OUT" 2>&1 | tee "$OUT/bench.log" | grep -v Warning | tail -40
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

[ "$MODE" != bench ] || exit $status
echo "== demo on GPUs"
timeout 120 python3 -m tritonep.demo 2>&1 | tee "$OUT/demo.log" | tail -15
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
exit $status
