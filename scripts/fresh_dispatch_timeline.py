"""Where the extra time of a fresh (non-cached) normal-mode dispatch goes, stage by stage.

A fresh dispatch costs more than a cached one: the host launches the count exchange and waits
for the counts. Where the receive half waits for them too (the first fresh dispatch of a shape,
or ``TRITONEP_RECEIVE_BEFORE_SYNC=0``), every microsecond of host work between the counts and
its launch delays it; otherwise it was launched before the wait. This probe stamps the host
clock at each stage boundary of the NVLink backend's dispatch (by wrapping its internal steps,
so it follows this tree's names) and prints the median duration of each stage over many calls,
beside the GPU time of a fresh and a cached call (CUDA events, idle GPU at the start, L2 flushed, slowest rank).

    PYTHONPATH=. python scripts/fresh_dispatch_timeline.py [--ranks R] [--calls 50] [--json PATH]

More ranks than GPUs share them (``tritonep.rank_pool``): the host stages then still show what
each rank's host does per call (the combine's per-peer copies grow with R), not GPU speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

import tritonep as deep_ep
from tritonep import nvl_bytes_for
from tritonep.backends.nvlink import backend as nvlink_backend
from tritonep.bench_low_latency import _one, _timed_us  # idle GPU at the start event, L2 flushed, slowest rank
from tritonep.bench_timing import slowest
from tritonep.rank_pool import RankPool


def _stamped(stamps: list, name: str, fn):
    """``fn`` that appends (name + ':start', t) and (name + ':end', t) host stamps around each call."""
    def wrapper(*args, **kwargs):
        stamps.append((name + ":start", time.perf_counter_ns()))
        try:
            return fn(*args, **kwargs)
        finally:
            stamps.append((name + ":end", time.perf_counter_ns()))
    return wrapper


def _start_together(group: dist.ProcessGroup) -> None:
    """Every rank starts the next call at once, the GPU idle: an all-reduce (on the GPU under
    NCCL, on the CPU when ranks share a GPU in a gloo group), then a device sync."""
    dist.all_reduce(torch.zeros(1, device="cuda" if dist.get_backend(group) == "nccl" else "cpu"), group=group)
    torch.cuda.synchronize()


def _targets() -> list[tuple[object, str]]:
    """The host steps whose inclusive time is reported (owner, attribute): torch's allocator
    and stream calls as the library makes them, the checks, the launcher, the backend's steps."""
    from tritonep.core import checks, routing
    from tritonep.runtime import launcher, side_streams
    from tritonep.v1 import buffer as buffer_module
    return [(torch, "empty"), (torch, "zeros"), (torch.Tensor, "view"), (torch.Tensor, "tolist"),
            (torch.Tensor, "copy_"), (torch.Tensor, "narrow"),
            (torch.cuda.Event, "record"), (torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "wait_event"),
            (checks, "check_tensor"), (checks, "split_x"), (buffer_module.Buffer, "_check_tokens_per_node"),
            (launcher.FastLauncher, "__call__"), (launcher._Setup, "__call__"),
            (side_streams.PeerStreams, "mark"), (side_streams.PeerStreams, "fork"),
            (side_streams.PeerStreams, "join"), (nvlink_backend.NvlinkBackend, "check_status"),
            (nvlink_backend.NvlinkBackend, "_dispatch_regions"), (nvlink_backend.NvlinkBackend, "_copy_counts"),
            (nvlink_backend.NvlinkBackend, "_read_counts"), (nvlink_backend.NvlinkBackend, "_wait_counts"),
            (nvlink_backend.NvlinkBackend, "_dispatch_shape"), (nvlink_backend.NvlinkBackend, "_after_launch"),
            (nvlink_backend.NvlinkBackend, "dispatch"), (nvlink_backend.NvlinkBackend, "get_dispatch_layout"),
            (nvlink_backend, "notify_dispatch"), (nvlink_backend, "dispatch_layout"),
            (routing, "count_rows_from_prefix"), (routing, "round_up_counts")]


def _inclusive_us(group: dist.ProcessGroup, fn, calls: int) -> dict[str, float]:
    """Median inclusive host time per call of ``fn`` spent in each of ``_targets()`` (and the whole
    call), with the GPU idle at the start of each call."""
    totals: dict[str, float] = {}
    saved = []
    for owner, attr in _targets():
        if not hasattr(owner, attr):   # steps of another version of the backend
            continue
        original = getattr(owner, attr)
        name = f"{getattr(owner, '__name__', owner)}.{attr}"

        def timed(*args, _original=original, _name=name, **kwargs):
            begin = time.perf_counter_ns()
            try:
                return _original(*args, **kwargs)
            finally:
                totals[_name] = totals.get(_name, 0.0) + (time.perf_counter_ns() - begin) / 1e3
        saved.append((owner, attr, original))
        setattr(owner, attr, timed)
    samples: dict[str, list[float]] = {}
    fn()   # a first call of its kind learns its launches
    try:
        for _ in range(calls):
            _start_together(group)
            totals.clear()
            begin = time.perf_counter_ns()
            fn()
            totals["(whole call)"] = (time.perf_counter_ns() - begin) / 1e3
            for name, us in totals.items():
                samples.setdefault(name, []).append(us)
    finally:
        for owner, attr, original in reversed(saved):
            setattr(owner, attr, original)
    return {name: round(statistics.median(v + [0.0] * (calls - len(v))), 1) for name, v in samples.items()}


def run(group: dist.ProcessGroup, calls: int) -> dict:
    os.environ["TRITONEP_BACKEND"] = "nvlink"
    R, rank = group.size(), group.rank()
    N, H, K, E = 4096, 7168, 8, 256
    torch.manual_seed(rank)
    x = torch.randn(N, H, device="cuda").to(torch.bfloat16)
    topk_idx = (torch.randn(N, E, device="cuda").abs() + 1).topk(K, dim=1).indices
    topk_weights = torch.rand(N, K, device="cuda")
    buffer = deep_ep.Buffer(group, nvl_bytes_for(N, H, R), explicitly_destroy=True)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)

    def fresh():
        return buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                               num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights)

    recv_x, _, _, _, handle, _ = fresh()

    def cached():
        return buffer.dispatch(x, handle=handle)

    report = {"ranks": R, "fresh_gpu_us": _timed_us(group, fresh, calls),
              "cached_gpu_us": _timed_us(group, cached, calls)}
    # The same difference from interleaved pairs (fresh, then cached): the host's speed drifts
    # over seconds on these machines, which moves two separate medians far more.
    pairs = [_one(group, fresh) - _one(group, cached) for _ in range(calls)]
    report["fresh_minus_cached_pairs_us"] = slowest(group, statistics.median(pairs))

    # Host stages of the fresh dispatch: wrap the backend's steps on this instance only.
    stamps: list = []
    backend = buffer.backend
    wrapped = {"notify": ("notify_dispatch", nvlink_backend),
               "launch": ("_DISPATCH", nvlink_backend)}
    saved = {name: getattr(module, attr) for name, (attr, module) in wrapped.items()}
    for name, (attr, module) in wrapped.items():
        setattr(module, attr, _stamped(stamps, name, saved[name]))
    for name, attr in (("copy_counts", "_copy_counts"), ("read_counts", "_read_counts"),
                       ("wait_counts", "_wait_counts")):
        if hasattr(backend, attr):   # this tree's steps (the probe also runs on older packages)
            setattr(backend, attr, _stamped(stamps, name, getattr(backend, attr)))
    # The side stream's fork: of the receive half (older trees), of the send half (this tree).
    side = getattr(backend, "_send_stream", None) or backend._receive_streams
    side.fork = _stamped(stamps, "fork", side.fork)
    per_stage: dict[str, list[float]] = {}
    try:
        for _ in range(calls):
            _start_together(group)
            stamps.clear()
            begin = time.perf_counter_ns()
            fresh()
            stamps.append(("call:end", time.perf_counter_ns()))
            previous, previous_name = begin, "call:start"
            for name, t in stamps:
                per_stage.setdefault(f"{previous_name} -> {name}", []).append((t - previous) / 1e3)
                previous, previous_name = t, name
    finally:
        for name, (attr, module) in wrapped.items():
            setattr(module, attr, saved[name])
        for attr in ("_copy_counts", "_read_counts", "_wait_counts"):   # the class's methods again
            backend.__dict__.pop(attr, None)
        del side.fork
    report["host_stages_us"] = {k: round(statistics.median(v), 1) for k, v in per_stage.items()
                                if len(v) == calls}
    calls_by_kind = {"fresh": fresh, "cached": cached,
                     "combine": lambda: buffer.combine(recv_x, handle),
                     "layout": lambda: buffer.get_dispatch_layout(topk_idx, E)}
    report["inclusive_us"] = {kind: _inclusive_us(group, fn, calls) for kind, fn in calls_by_kind.items()}
    if hasattr(backend.tuning, "combine_driver"):   # the combine's pieces the other way (torch copies)
        default = backend.tuning
        backend.tuning = dataclasses.replace(default, combine_driver=not default.combine_driver)
        report["inclusive_us"][f"combine, combine_driver={backend.tuning.combine_driver}"] = _inclusive_us(
            group, calls_by_kind["combine"], calls)
        backend.tuning = default
    buffer.destroy()
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=torch.cuda.device_count())
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--json")
    args = parser.parse_args()
    with RankPool(args.ranks, use_gpu=True, timeout=300) as pool:
        reports = pool.run(run, args.calls)
    for rank, report in enumerate(reports):
        print(f"== rank {rank}: fresh {report['fresh_gpu_us']:.1f} us, cached {report['cached_gpu_us']:.1f} us, "
              f"fresh - cached in pairs {report['fresh_minus_cached_pairs_us']:.1f} us (GPU, idle at start, "
              f"slowest rank)")
        for stage, us in report["host_stages_us"].items():
            print(f"  {us:8.1f} us  {stage}")
        for kind, table in report["inclusive_us"].items():
            print(f"  -- {kind}: inclusive host time per call, wrappers included")
            for name, us in sorted(table.items(), key=lambda item: -item[1]):
                print(f"  {us:8.1f} us  {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=1)


if __name__ == "__main__":
    main()
