"""Low-latency (decode) part of ``python -m tritonep.bench``.

DeepEP's decode problem: 128 tokens per rank, hidden 7168, top-8 of 288 experts, fp8
dispatch, bf16 combine. Per path (tritonep's NVLink kernels, and the collective backend on
NCCL = the all_to_all_single path) it times, with CUDA events:

* ``call``: one call as a user sees it, launch included: the GPU is idle when the start event
  is recorded (the ranks are aligned with an all-reduce, then the host waits for the GPU);
* ``send`` / ``recv``: the two halves with ``return_recv_hook=True`` (the recv is the hook);
* ``graph``: per-call time of ``GRAPH_CALLS`` calls captured in one CUDA graph and replayed
  (no launch cost at all; tritonep only: NCCL calls do not capture here).

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

import tritonep as deep_ep

GRAPH_CALLS = 10


def _timed_us(group: dist.ProcessGroup, fn: Callable[[], object], iters: int) -> float:
    """Median of ``iters`` timed calls after 3 untimed ones."""
    for _ in range(3):
        fn()
    return statistics.median(_one(group, fn) for _ in range(iters))


def _measure(group: dist.ProcessGroup, buffer: deep_ep.Buffer, args: argparse.Namespace, x: torch.Tensor,
             topk_idx: torch.Tensor, weights: torch.Tensor, graphs: bool) -> dict:
    T, E = args.ll_tokens, args.ll_experts
    packed, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=True)
    expert_out = torch.randn(packed[0].shape, dtype=torch.float32, device=x.device).to(torch.bfloat16)
    result = {
        "dispatch_us": _timed_us(group, lambda: buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=True),
                                 args.iters),
        "combine_us": _timed_us(group, lambda: buffer.low_latency_combine(expert_out, topk_idx, weights, handle),
                                args.iters),
    }
    result.update(_hook_split(group, buffer, args, x, topk_idx, weights, expert_out, handle))
    if graphs:
        result.update(_graph_times(group, buffer, args, x, topk_idx, weights, expert_out, handle))
    return result


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
        times[f"{name}_send_us"] = statistics.median(sends[3:])
        times[f"{name}_recv_us"] = statistics.median(recvs[3:])
    return times


def _one(group: dist.ProcessGroup, fn: Callable[[], object]) -> float:
    """One timed call, all ranks starting together and the GPU idle at the start event (launch
    included). CPU ranks: wall-clock time."""
    if dist.get_backend(group) != "nccl":
        dist.barrier(group=group)
        begin = time.perf_counter()
        fn()
        return (time.perf_counter() - begin) * 1e6
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
    size = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, num_ranks, E)
    for backend in backends:
        os.environ["TRITONEP_BACKEND"] = backend
        try:
            buffer = deep_ep.Buffer(group, num_rdma_bytes=size, low_latency_mode=True, explicitly_destroy=True)
        finally:
            os.environ.pop("TRITONEP_BACKEND")
        report[backend] = _measure(group, buffer, args, x, topk_idx, weights, graphs=gpu and backend == "nvlink")
        buffer.destroy()
    return report


def print_table(report: dict) -> None:
    print(f"\nlow latency: {report['tokens']} tokens/rank, hidden {report['hidden']}, top-{report['topk']} of "
          f"{report['experts']} experts, fp8 dispatch, bf16 combine")
    print(f"{'path':<52}{'time (us)':>12}{'GB/s':>10}")
    names = {"nvlink": "tritonep", "collective": "all_to_all_single path"}
    for backend, name in names.items():
        if backend not in report:
            continue
        m = report[backend]
        for kind in ("dispatch", "combine"):
            num_bytes = report[f"{kind}_bytes"]
            rows = [("call", f"{kind}_us"), ("send (hook mode)", f"{kind}_send_us"),
                    ("recv (the hook)", f"{kind}_recv_us"), ("CUDA graph replay, per call", f"{kind}_graph_us")]
            for label, key in rows:
                if key in m:
                    us = m[key]
                    print(f"{name + ': ' + kind + ' ' + label:<52}{us:>12.1f}{num_bytes / us / 1e3:>10.1f}")
