"""Where a call's time goes on the host: CPU microseconds per call (no sync, many calls) beside
the GPU time of the same call (CUDA events), for every public call of both modes.

Works at any rank count, one GPU included (R = number of GPUs, or --ranks): the host path
(checks, allocation, launches, count read-back) barely depends on R, so a single GPU already
shows it. With --defaults the ranks first run ``torch.set_default_device('cuda')`` and
``torch.set_default_dtype(torch.bfloat16)``, as DeepEP's test harness does.

    PYTHONPATH=. python scripts/host_path_probe.py [--ranks R] [--defaults] [--json out.json]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics

import torch
import torch.distributed as dist

import tritonep as deep_ep
from tritonep import nvl_bytes_for
from tritonep.bench_low_latency import _timed_us  # idle GPU at the start event, launch included
from tritonep.bench_timing import back_to_back_host_us as host_us  # rounds of calls, synced between
from tritonep.rank_pool import RankPool


def _graph_us(fn, calls: int = 10, replays: int = 30) -> float:
    """GPU time per call with no launch cost: ``calls`` calls captured in one CUDA graph, the
    median replay divided by ``calls``."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(samples)


def _profile(fn, calls: int = 100, top: int = 14) -> str:
    """cProfile of ``calls`` calls, the functions with most own time first."""
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        fn()
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def run(group: dist.ProcessGroup, defaults: bool, profile: bool = False, only_low_latency: bool = False) -> dict:
    if defaults:
        torch.set_default_device("cuda")
        torch.set_default_dtype(torch.bfloat16)
    os.environ["TRITONEP_BACKEND"] = "nvlink"
    R, rank = group.size(), group.rank()
    device = torch.device("cuda", torch.cuda.current_device())
    N, H, K, E = 4096, 7168, 8, 256
    T, E_LL = 128, 288
    gen = torch.Generator(device="cpu").manual_seed(rank)

    def rand(*shape: int) -> torch.Tensor:   # drawn on the CPU whatever the default device
        return torch.rand(*shape, generator=gen, dtype=torch.float32, device="cpu").to(device)

    x = (rand(N, H) * 2 - 1).to(torch.bfloat16)
    scores = rand(N, E)
    topk_idx = scores.topk(K, dim=1).indices
    topk_weights = rand(N, K)
    report: dict = {"ranks": R, "defaults": defaults}
    try:
        buffer = deep_ep.Buffer(group, nvl_bytes_for(N, H, R), deep_ep.Buffer.get_low_latency_rdma_size_hint(
            T, H, R, E_LL), low_latency_mode=True, explicitly_destroy=True)
    except Exception as error:   # the probe reports, it does not stop
        return {**report, "constructor_error": f"{type(error).__name__}: {error}"}

    def layout():
        return buffer.get_dispatch_layout(topk_idx, E)

    per_rank, _, per_expert, in_rank, _ = layout()

    def fresh():
        return buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                               num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights)

    recv_x, _, _, _, handle, _ = fresh()
    x_fp8 = deep_ep.utils.per_token_cast_to_fp8(x)
    calls = {
        "layout": layout,
        "dispatch_fresh": fresh,
        "dispatch_cached": lambda: buffer.dispatch(x, handle=handle),
        "dispatch_cached_fp8": lambda: buffer.dispatch(x_fp8, handle=handle),
        "dispatch_worst": lambda: buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                  num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                                                  topk_weights=topk_weights, num_worst_tokens=N * R),
        "combine": lambda: buffer.combine(recv_x, handle),
    }
    if only_low_latency:
        calls = {}
    x_ll = x[:T].contiguous()
    idx_ll = rand(T, E_LL).topk(K, dim=1).indices
    w_ll = topk_weights[:T].contiguous()
    packed, _, ll_handle, _, _ = buffer.low_latency_dispatch(x_ll, idx_ll, T, E_LL)
    y = (rand(*packed[0].shape) * 2 - 1).to(torch.bfloat16)
    calls["ll_dispatch"] = lambda: buffer.low_latency_dispatch(x_ll, idx_ll, T, E_LL)
    calls["ll_dispatch_bf16"] = lambda: buffer.low_latency_dispatch(x_ll, idx_ll, T, E_LL, use_fp8=False)
    calls["ll_combine"] = lambda: buffer.low_latency_combine(y, idx_ll, w_ll, ll_handle)
    for name, fn in calls.items():
        try:
            report[name] = {"host_us": round(host_us(fn), 1), "gpu_us": round(_timed_us(group, fn, 30), 1)}
            if name.startswith("ll_"):   # capturable calls: their kernel time alone
                report[name]["graph_us"] = round(_graph_us(fn), 1)
            if profile:
                report[name]["profile"] = _profile(fn)
        except Exception as error:
            report[name] = {"error": f"{type(error).__name__}: {error}"}
    # Correctness at a glance: with R=1 every token comes back once.
    out, _, _ = buffer.combine(recv_x, handle)
    expected = x.float() * in_rank.sum(1, keepdim=True).float()
    report["combine_identity_max_err"] = float((out.float() - expected).abs().max())
    buffer.destroy()
    if defaults:
        torch.set_default_device(None)
        torch.set_default_dtype(torch.float32)
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=torch.cuda.device_count())
    parser.add_argument("--defaults", action="store_true")
    parser.add_argument("--profile", action="store_true", help="cProfile each call (printed per call)")
    parser.add_argument("--only-low-latency", action="store_true", help="skip the normal-mode calls")
    parser.add_argument("--json")
    args = parser.parse_args()
    with RankPool(args.ranks, use_gpu=True, timeout=300) as pool:
        reports = pool.run(run, args.defaults, args.profile, args.only_low_latency)
    for name, value in reports[0].items():
        if isinstance(value, dict) and "profile" in value:
            print(f"== {name}: host {value['host_us']} us, GPU {value['gpu_us']} us per call")
            print("\n".join(value.pop("profile").splitlines()[6:24]))
    print(json.dumps(reports[0], indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=1)


if __name__ == "__main__":
    main()
