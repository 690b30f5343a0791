"""Low-latency (decode) part of ``python -m tritonep.bench``.

DeepEP's decode problem: 128 tokens per rank, hidden 7168, top-8 of 288 experts, fp8
dispatch, bf16 combine. Per path (tritonep's NVLink kernels, DeepEP V1 with ``--vs-deepep``
when ``deep_ep`` imports, and the collective backend on NCCL = the all_to_all_single path) it
times, with CUDA events and L2 flushed before each timed call:

* ``call``: one call as a user sees it, launch included: the GPU is idle when the start event
  is recorded (the ranks are aligned with an all-reduce, then the host waits for the GPU);
* ``pair``: a dispatch and its combine back to back, timed as one, as DeepEP's test times them;
* ``send`` / ``recv``: the two halves with ``return_recv_hook=True`` (the recv is the hook);
* ``graph``: per-call time of ``GRAPH_CALLS`` calls captured in one CUDA graph and replayed
  (no launch cost at all; not for the all_to_all_single path: NCCL calls do not capture here);
* ``gpu``: GPU time per call from torch.profiler (every kernel the call launches, summed);
* ``host``: CPU time the call takes to return (no synchronisation; the GPU idle before it);
* ``host back to back``: CPU time per call of calls made back to back, as a decode loop makes
  them (``bench_timing.back_to_back_host_us``; the host-path probes' method), beside one
  torch ``add_`` timed the same way as a yardstick of the host's speed.

Times are medians over ``--iters``. "GB/s" is the bytes every rank receives (fp8 rows with
their scales for dispatch, bf16 rows for combine, each (token, expert) pair counted) over
the time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import tritonep
from tritonep.bench_timing import back_to_back_host_us, flush_l2, load_deepep, slowest

GRAPH_CALLS = 10


def _timed_us(group: dist.ProcessGroup, fn: Callable[[], object], iters: int) -> float:
    """Median of ``iters`` timed calls after 3 untimed ones, on the slowest rank."""
    for _ in range(3):
        fn()
    return slowest(group, statistics.median(_one(group, fn) for _ in range(iters)))


def _measure(group: dist.ProcessGroup, buffer, args: argparse.Namespace, x: torch.Tensor,
             topk_idx: torch.Tensor, weights: torch.Tensor, graphs: bool) -> dict:
    """``buffer``: a tritonep or DeepEP Buffer in low-latency mode (the same API)."""
    T, E = args.ll_tokens, args.ll_experts
    packed, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=True)
    expert_out = torch.randn(packed[0].shape, dtype=torch.float32, device=x.device).to(torch.bfloat16)

    def dispatch() -> object:
        return buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=True)

    def combine() -> object:
        return buffer.low_latency_combine(expert_out, topk_idx, weights, handle)

    def pair() -> object:
        pair_handle = buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=True)[2]
        return buffer.low_latency_combine(expert_out, topk_idx, weights, pair_handle)

    result = {"dispatch_us": _timed_us(group, dispatch, args.iters),
              "combine_us": _timed_us(group, combine, args.iters),
              "pair_us": _timed_us(group, pair, args.iters)}
    result.update(_hook_split(group, buffer, args, x, topk_idx, weights, expert_out, handle))
    for name, call in (("dispatch", dispatch), ("combine", combine)):
        result[f"{name}_host_us"] = _host_us(group, call, args.iters)
        result[f"{name}_host_back_to_back_us"] = slowest(group, back_to_back_host_us(call))
        if x.is_cuda:
            try:
                result[f"{name}_gpu_us"] = _profiled_gpu_us(call, args.iters)
            except Exception as error:  # noqa: BLE001 - a profiler problem must not cost the run
                result[f"{name}_gpu_error"] = f"{type(error).__name__}: {error}"
    if graphs:
        result.update(_graph_times(group, buffer, args, x, topk_idx, weights, expert_out, handle))
    return result


def _host_us(group: dist.ProcessGroup, fn: Callable[[], object], iters: int) -> float:
    """Median CPU time for ``fn`` to return, the GPU idle before each call (slowest rank)."""
    times = []
    for _ in range(iters + 3):
        if torch.cuda.is_available() and dist.get_backend(group) != "gloo":
            torch.cuda.synchronize()
        dist.barrier(group=group)
        begin = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - begin) / 1e3)
    return slowest(group, statistics.median(times[3:]))


def _profiled_gpu_us(fn: Callable[[], object], iters: int) -> float:
    """GPU time per call of ``fn``: every kernel (and memset/copy) it runs, summed, as
    torch.profiler sees them; the same for any Buffer, whatever its kernels are called."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    device_events = [event for event in prof.events() if event.device_type == DeviceType.CUDA]
    return sum(event.time_range.elapsed_us() for event in device_events) / iters


def _hook_split(group, buffer, args, x, topk_idx, weights, expert_out, handle) -> dict:
    """Send and receive halves timed separately; each round sends, then runs the hook."""
    T, E = args.ll_tokens, args.ll_experts
    pending: list = []

    def dispatch_send() -> None:
        pending.append(buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=True, return_recv_hook=True)[4])

    def run_hook() -> None:
        pending.pop(0)()

    def combine_send() -> None:
        pending.append(buffer.low_latency_combine(expert_out, topk_idx, weights, handle, return_recv_hook=True)[2])

    times = {}
    for name, send in (("dispatch", dispatch_send), ("combine", combine_send)):
        sends, recvs = [], []
        for _ in range(args.iters + 3):
            sends.append(_one(group, send))
            recvs.append(_one(group, run_hook))
        times[f"{name}_send_us"] = slowest(group, statistics.median(sends[3:]))
        times[f"{name}_recv_us"] = slowest(group, statistics.median(recvs[3:]))
    return times


def _one(group: dist.ProcessGroup, fn: Callable[[], object]) -> float:
    """One timed call, all ranks starting together and the GPU idle at the start event (launch
    included). CPU ranks: wall-clock time."""
    if dist.get_backend(group) != "nccl":
        dist.barrier(group=group)
        begin = time.perf_counter()
        fn()
        return (time.perf_counter() - begin) * 1e6
    flush_l2()
    dist.all_reduce(torch.zeros(1, dtype=torch.float32, device="cuda"), group=group)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def _graph_times(group, buffer, args, x, topk_idx, weights, expert_out, handle) -> dict:
    T, E = args.ll_tokens, args.ll_experts
    times = {}
    calls = {"dispatch": lambda: buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=True),
             "combine": lambda: buffer.low_latency_combine(expert_out, topk_idx, weights, handle)}
    for name, call in calls.items():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(GRAPH_CALLS):
                call()
        times[f"{name}_graph_us"] = _timed_us(group, graph.replay, args.iters) / GRAPH_CALLS
        del graph
    return times


def run_rank(group: dist.ProcessGroup, args: argparse.Namespace, backends: list[str]) -> dict:
    """Measure each backend in ``backends`` ("nvlink", "collective") on the same routing."""
    rank, num_ranks = group.rank(), group.size()
    gpu = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    generator = torch.Generator().manual_seed(7 + rank)
    T, E, K, H = args.ll_tokens, args.ll_experts, args.topk, args.hidden
    cpu32 = dict(generator=generator, dtype=torch.float32, device="cpu")
    x = torch.randn(T, H, **cpu32).to(torch.bfloat16).to(device)
    topk_idx = torch.rand(T, E, **cpu32).topk(K, dim=1).indices.to(device)
    weights = torch.rand(T, K, **cpu32).to(device)
    pairs = torch.tensor([topk_idx.numel()], dtype=torch.float64, device=device)
    dist.all_reduce(pairs, group=group)   # pairs sent by all ranks = received by all ranks
    received_pairs = float(pairs) / num_ranks
    report = {"tokens": T, "hidden": H, "experts": E, "topk": K,
              "dispatch_bytes": received_pairs * (H + H // 128 * 4), "combine_bytes": received_pairs * H * 2}
    # The host's speed, for reading the host rows: one torch op (``add_``) timed the same way.
    # It differs by up to 1.5x between machines of the same kind (docs/benchmarks).
    yardstick = torch.zeros(16, dtype=torch.float32, device=device)
    report["torch_add_host_back_to_back_us"] = slowest(group, back_to_back_host_us(lambda: yardstick.add_(1)))
    size = tritonep.Buffer.get_low_latency_rdma_size_hint(T, H, num_ranks, E)
    for backend in backends:
        os.environ["TRITONEP_BACKEND"] = backend
        try:
            buffer = tritonep.Buffer(group, num_rdma_bytes=size, low_latency_mode=True, explicitly_destroy=True)
        finally:
            os.environ.pop("TRITONEP_BACKEND")
        report[backend] = _measure(group, buffer, args, x, topk_idx, weights, graphs=gpu and backend == "nvlink")
        buffer.destroy()
    if getattr(args, "vs_deepep", False):
        report["deepep"] = _deepep(group, args, x, topk_idx, weights, gpu)
    return report


def _deepep(group, args, x, topk_idx, weights, gpu: bool) -> dict:
    """DeepEP V1's low-latency calls on the same inputs (``--vs-deepep``), or why not."""
    module, why = load_deepep()
    if module is None or not gpu:
        return {"missing": why or "DeepEP runs on GPUs only"}
    T, E, num_ranks = args.ll_tokens, args.ll_experts, group.size()
    try:
        size = module.Buffer.get_low_latency_rdma_size_hint(T, args.hidden, num_ranks, E)
        buffer = module.Buffer(group, 0, size, low_latency_mode=True, num_qps_per_rank=E // num_ranks,
                               allow_nvlink_for_low_latency_mode=True, explicitly_destroy=True)
        try:
            return _measure(group, buffer, args, x, topk_idx, weights, graphs=True)
        finally:
            buffer.destroy()
    except Exception as error:  # noqa: BLE001 - report it, keep the run's other figures
        return {"error": f"{type(error).__name__}: {error}"}


def print_table(report: dict) -> None:
    print(f"\nlow latency: {report['tokens']} tokens/rank, hidden {report['hidden']}, top-{report['topk']} of "
          f"{report['experts']} experts, fp8 dispatch, bf16 combine")
    print(f"{'path':<52}{'time (us)':>12}{'GB/s':>10}")
    if "torch_add_host_back_to_back_us" in report:
        print(f"{'host yardstick: torch add_ per call, back to back':<52}"
              f"{report['torch_add_host_back_to_back_us']:>12.1f}")
    names = {"nvlink": "tritonep", "deepep": "DeepEP V1", "collective": "all_to_all_single path"}
    for backend, name in names.items():
        m = report.get(backend, {})
        if "missing" in m or "error" in m:
            print(f"{name}: {m.get('missing') or m.get('error')}")
        if "dispatch_us" not in m:
            continue
        print(f"{name + ': dispatch + combine pair':<52}{m['pair_us']:>12.1f}")
        for kind in ("dispatch", "combine"):
            num_bytes = report[f"{kind}_bytes"]
            rows = [("call", f"{kind}_us"), ("send (hook mode)", f"{kind}_send_us"),
                    ("recv (the hook)", f"{kind}_recv_us"), ("CUDA graph replay, per call", f"{kind}_graph_us"),
                    ("GPU time (profiler)", f"{kind}_gpu_us")]
            for label, key in rows:
                if key in m:
                    us = m[key]
                    print(f"{name + ': ' + kind + ' ' + label:<52}{us:>12.1f}{num_bytes / us / 1e3:>10.1f}")
            print(f"{name + ': ' + kind + ' host CPU time per call':<52}{m[f'{kind}_host_us']:>12.1f}")
            if f"{kind}_host_back_to_back_us" in m:
                print(f"{name + ': ' + kind + ' host CPU per call, back to back':<52}"
                      f"{m[f'{kind}_host_back_to_back_us']:>12.1f}")
