"""Why the bench's "fresh - cached, pairs" row spreads between rounds, call by call.

The bench times (fresh, cached) dispatches in turn, each after an L2 flush and a ~1 ms sleep of
the stream (``bench._call_times_us``), and reports the median of their differences. Its two
rounds at one rank gave 68.8 and 14.5 us for the same code (docs/benchmarks/2026-11-25-h100x1-s12,
run 4), while the separate medians of fresh and cached agreed within 0.1%. This probe makes the
same timed calls and keeps every call's figures:

* GPU: start event -> an event the host records just before it waits for the counts (the
  receive half, when launched before the read-back, is queued ahead of it) -> an event
  recorded right after the counts came back -> the end event;
* host: the same four points on the CPU clock, relative to the start event's record;
* how many times the receive half was launched (2: the guessed outputs were too small).

It repeats the bench's timing steps (align, flush, head start, events) instead of calling
``bench._call_times_us``, which keeps only the start-to-end times: the marks above need the
start event and a stamp per call. Options: ``--no-head-start``; ``--gc-off``;
``--profile-after-wait`` (cProfile of the host's work after the counts); ``--yardstick`` (a fixed
host workload timed right after the wait and before each call).

    PYTHONPATH=. python scripts/fresh_pairs_probe.py [--iters 100] [--json PATH]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist

import tritonep as deep_ep
from tritonep import nvl_bytes_for
from tritonep.backends.nvlink import backend as nvlink_backend
from tritonep.bench_timing import flush_l2, host_head_start
from tritonep.rank_pool import RankPool


def _percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    pick = lambda q: round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)  # noqa: E731
    return {"p10": pick(0.1), "p50": pick(0.5), "p90": pick(0.9), "min": round(ordered[0], 1),
            "max": round(ordered[-1], 1)}


def _yardstick(tensor: torch.Tensor) -> int:
    """Nanoseconds of a fixed host workload: four slices of a CUDA tensor and a short Python loop."""
    begin = time.perf_counter_ns()
    for rows in (1, 2, 3, 4):
        tensor[:rows]
    total = 0
    for i in range(200):
        total += i
    return time.perf_counter_ns() - begin


def run(group: dist.ProcessGroup, iters: int, head_start: bool, profile_after_wait: bool, gc_off: bool,
        yardstick: bool) -> dict:
    os.environ["TRITONEP_BACKEND"] = "nvlink"
    R, rank = group.size(), group.rank()
    N, H, K, E = 4096, 7168, 8, 256
    torch.manual_seed(1234 + rank)
    x = torch.randn(N, H, device="cuda").to(torch.bfloat16)
    topk_idx = (torch.randn(N, E, device="cuda").abs() + 1).topk(K, dim=1).indices
    topk_weights = torch.rand(N, K, device="cuda")
    buffer = deep_ep.Buffer(group, nvl_bytes_for(N, H, R), explicitly_destroy=True)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
    backend = buffer.backend

    marks: dict[str, object] = {}
    launches = [0]
    original_wait, original_outputs = backend._wait_counts, nvlink_backend.dispatch_outputs

    profiler = cProfile.Profile() if profile_after_wait else None

    def wait_counts(shape):
        marks["before_wait"] = (torch.cuda.Event(enable_timing=True), time.perf_counter_ns())
        marks["before_wait"][0].record()
        try:
            return original_wait(shape)
        finally:
            if yardstick:   # the same workload right after the wait as before the call (below)
                marks["yard_after"] = _yardstick(x)
            marks["after_wait"] = (torch.cuda.Event(enable_timing=True), time.perf_counter_ns())
            marks["after_wait"][0].record()
            if profiler is not None and marks.get("profiled"):
                profiler.enable()

    def outputs(*args, **kwargs):
        launches[0] += 1
        return original_outputs(*args, **kwargs)

    backend._wait_counts = wait_counts
    nvlink_backend.dispatch_outputs = outputs

    def fresh():
        return buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                               num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights)

    handle = fresh()[4]

    def cached():
        return buffer.dispatch(x, handle=handle)

    collections: list[tuple[int, int]] = []   # (generation, ns) of every garbage collection while timing
    gc_started = [0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_started[0] = time.perf_counter_ns()
        else:
            collections.append((info["generation"], time.perf_counter_ns() - gc_started[0]))

    gc.callbacks.append(on_gc)
    align = torch.zeros(1, device="cuda")
    if gc_off:
        gc.disable()
    records: dict[str, list] = {"fresh": [], "cached": []}
    try:
        for _ in range(3):
            fresh(), cached()
        for _ in range(iters):
            for name, fn in (("fresh", fresh), ("cached", cached)):
                dist.all_reduce(align, group=group)
                flush_l2()
                if head_start:
                    host_head_start()
                marks.clear()
                if yardstick:
                    marks["yard_before"] = _yardstick(x)
                marks["profiled"] = name == "fresh"
                launches[0] = 0
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                host_start = time.perf_counter_ns()
                fn()
                host_return = time.perf_counter_ns()
                if profiler is not None:
                    profiler.disable()
                end.record()
                records[name].append((start, end, host_start, host_return, dict(marks), launches[0]))
        torch.cuda.synchronize()
    finally:
        gc.callbacks.remove(on_gc)
        gc.enable()
        del backend._wait_counts
        nvlink_backend.dispatch_outputs = original_outputs

    by_generation = {g: [ns for generation, ns in collections if generation == g] for g in (0, 1, 2)}
    fresh_marks = [c[4] for c in records["fresh"]]
    report_yard = {when: _percentiles([m[when] / 1e3 for m in fresh_marks])
                   for when in ("yard_before", "yard_after")} if yardstick else None
    report: dict = {"rank": rank, "ranks": R, "head_start": head_start, "gc_off": gc_off,
                    "threads": [thread.name for thread in threading.enumerate()],
                    "switch_interval_s": sys.getswitchinterval(),
                    "collections_count_us": {g: [len(v), round(sum(v) / 1e3, 1)] for g, v in by_generation.items()}}
    if yardstick:
        report["yardstick_us"] = report_yard
    if profiler is not None:   # where the host's time after the counts goes (cumulative over the calls)
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
        report["after_wait_profile"] = text.getvalue()
    rows = []
    for name, calls in records.items():
        gpu = [s.elapsed_time(e) * 1e3 for s, e, *_ in calls]
        report[f"{name}_gpu_us"] = _percentiles(gpu)
        report[f"{name}_host_us"] = _percentiles([(r - h) / 1e3 for _, _, h, r, _, _ in calls])
        if name == "fresh":
            report["fresh_receive_launches"] = {n: sum(1 for c in calls if c[5] == n) for n in (0, 1, 2)}
            for (s, e, h, r, m, n), c_gpu in zip(calls, [s.elapsed_time(e) * 1e3 for s, e, *_ in records["cached"]]):
                bw, aw = m["before_wait"], m["after_wait"]
                rows.append({
                    "fresh_us": round(s.elapsed_time(e) * 1e3, 1), "cached_us": round(c_gpu, 1),
                    "gpu_start_to_before_wait": round(s.elapsed_time(bw[0]) * 1e3, 1),
                    "gpu_before_to_after_wait": round(bw[0].elapsed_time(aw[0]) * 1e3, 1),
                    "gpu_after_wait_to_end": round(aw[0].elapsed_time(e) * 1e3, 1),
                    "host_start_to_before_wait": round((bw[1] - h) / 1e3, 1),
                    "host_wait": round((aw[1] - bw[1]) / 1e3, 1),
                    "host_after_wait_to_return": round((r - aw[1]) / 1e3, 1),
                    "receive_launches": n})
    differences = [row["fresh_us"] - row["cached_us"] for row in rows]
    report["pair_differences_us"] = _percentiles(differences)
    report["stages"] = {key: _percentiles([row[key] for row in rows]) for key in rows[0] if key != "receive_launches"}
    # The calls of the slow mode beside those of the fast one.
    cut = statistics.median(differences)
    report["slow_examples"] = [row for row, d in zip(rows, differences) if d > cut + 20][:5]
    report["fast_examples"] = [row for row, d in zip(rows, differences) if d <= cut][:3]
    buffer.destroy()
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=torch.cuda.device_count())
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--no-head-start", action="store_true")
    parser.add_argument("--profile-after-wait", action="store_true")
    parser.add_argument("--gc-off", action="store_true")
    parser.add_argument("--yardstick", action="store_true", help="time a fixed host workload after the wait and "
                        "before the call")
    parser.add_argument("--json")
    args = parser.parse_args()
    with RankPool(args.ranks, use_gpu=True, timeout=300) as pool:
        reports = pool.run(run, args.iters, not args.no_head_start, args.profile_after_wait,
                           args.gc_off, args.yardstick)
    for report in reports:
        print(report.pop("after_wait_profile", ""))
        print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=1)


if __name__ == "__main__":
    main()
