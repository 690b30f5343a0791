"""Where a normal-mode call's GPU time goes (``--profile``): torch.profiler over each kind of
call, per rank, on DeepEP's problem.

For each kind (layout; fresh dispatch, with the GPU's idle time between the count exchange's
kernel and the dispatch kernel: the host's share; cached dispatch; combine with the copy
engines; combine with SMs only) it runs ``CALLS`` calls under the profiler and reports the mean
device time per call of each kernel and copy (copy-engine copies show as "Memcpy PtoP" / "Memcpy
DtoD"), the mean wall time per call, and the last call's timeline. On CPU ranks it profiles the
collective backend's ops (CPU time), so that the mode runs anywhere. With ``--gpus-per-node N``
it profiles the internode backend instead (the group split into nodes of N ranks), whose kernels
are named ``tritonep::internode::*``; its combine has one path, reported as ``combine_copy_engine``.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.distributed as dist

import tritonep

from . import inputs, timing
from .internals import changed_tuning
from .internode import split_buffer
from .normal import make_buffer

CALLS = 20
KINDS = ("layout", "fresh_dispatch", "cached_dispatch", "combine_copy_engine", "combine_sm_only")


def profile_calls(fn: Callable[[], object], gpu: bool, gaps: tuple[str, str] | None = None) -> dict:
    """Mean device time per call of each kernel and copy of ``fn`` (on CPU: of each op); with
    ``gaps=(a, b)`` also the mean idle time between the end of kernel ``a`` and the start of the
    next ``b``, kernels named by the last part of their profiler name (``tritonep::intranode::a``)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    if gpu:
        torch.cuda.synchronize()
    activity, device = (ProfilerActivity.CUDA, DeviceType.CUDA) if gpu else (ProfilerActivity.CPU, DeviceType.CPU)
    with profile(activities=[activity]) as prof:
        begin = time.perf_counter()
        for _ in range(CALLS):
            fn()
        if gpu:
            torch.cuda.synchronize()
        wall_us = (time.perf_counter() - begin) * 1e6 / CALLS
    events = sorted((e for e in prof.events() if e.device_type == device), key=lambda e: e.time_range.start)
    totals: dict[str, float] = defaultdict(float)
    for event in events:
        totals[event.name[:60]] += event.time_range.elapsed_us() if gpu else event.self_cpu_time_total
    per_call = {name: round(us / CALLS, 1) for name, us in sorted(totals.items(), key=lambda item: -item[1])}
    result: dict = {"wall_us_per_call": round(wall_us, 1), "device_us_per_call": per_call}
    # The last call's kernels and copies: start (from the first one's) and duration, in us.
    last = events[len(events) - len(events) // CALLS:]
    if last:
        origin = last[0].time_range.start
        result["last_call"] = [(e.name[:40], round(e.time_range.start - origin, 1), round(e.time_range.elapsed_us(), 1))
                               for e in last]
    if gaps is not None:
        idle, first_end = [], None
        for event in events:
            name = event.name.rsplit("::", 1)[-1]
            if name == gaps[0]:
                first_end = event.time_range.end
            elif name == gaps[1] and first_end is not None:
                idle.append(event.time_range.start - first_end)
                first_end = None
        if idle:
            result[f"idle_us_{gaps[0]}_to_{gaps[1]}"] = round(sum(idle) / len(idle), 1)
    return result


def run_rank(group: dist.ProcessGroup, args: argparse.Namespace) -> dict:
    rank = group.rank()
    gpu = timing.on_gpu(group)
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    x, topk_idx, topk_weights = inputs.routing(args.tokens, args.hidden, args.experts, args.topk, rank, device)
    nvl_bytes = inputs.nvl_bytes(args.tokens, args.hidden, group.size())
    internode = bool(args.gpus_per_node) and gpu
    if internode:
        buffer = split_buffer(group, args, gpu)
    else:
        buffer = make_buffer(group, "nvlink" if gpu else "collective", num_nvl_bytes=nvl_bytes,
                             explicitly_destroy=True)
    config = tritonep.Config(args.num_sms)
    per_rank, per_node, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, args.experts)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    if internode:
        layout["num_tokens_per_rdma_rank"] = per_node

    def fresh() -> object:
        return buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, config=config, **layout)

    recv_x, _, recv_weights, _, handle, _ = fresh()

    def combine() -> object:
        return buffer.combine(recv_x, handle, topk_weights=recv_weights, config=config)

    report = {"rank": rank, "recv_rows": recv_x.shape[0]}
    report["layout"] = profile_calls(lambda: buffer.get_dispatch_layout(topk_idx, args.experts), gpu)
    report["fresh_dispatch"] = profile_calls(fresh, gpu, gaps=None if internode else ("notify_counts", "dispatch"))
    report["cached_dispatch"] = profile_calls(lambda: buffer.dispatch(x, handle=handle, config=config), gpu)
    report["combine_copy_engine"] = profile_calls(combine, gpu)
    if gpu and not internode:
        with changed_tuning(buffer, copy_engine_combine=False):
            report["combine_sm_only"] = profile_calls(combine, gpu)
    buffer.destroy()
    return report


def print_reports(reports: list[dict]) -> None:
    for report in reports:
        print(f"== rank {report['rank']} ({report['recv_rows']} rows received)")
        for kind in KINDS:
            if kind not in report:
                continue
            gaps = {key: value for key, value in report[kind].items() if key.startswith("idle_us")}
            print(f"  {kind}: {report[kind]['wall_us_per_call']} us per call {gaps or ''}")
            for name, us in list(report[kind]["device_us_per_call"].items())[:6]:
                print(f"    {us:9.1f} us  {name}")
            print("    last call: " + "; ".join(f"{name} @{begin} +{length}"
                                                for name, begin, length in report[kind].get("last_call", [])[:16]))
