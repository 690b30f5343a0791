"""Where the time of a low-latency call with ``return_recv_hook=True`` goes, on one GPU.

The bench's hook rows (``send`` / ``recv``, CUDA events from an idle GPU, launch included) put
tritonep's halves behind DeepEP's at one rank, while the single-launch call is ahead
(docs/benchmarks/2026-11-25-h100x1-s11). This probe splits each half into what the host
spends (CPU time to return, GPU idle before), what the GPU spends (each launch's kernel time in
torch.profiler, by launch order), and the event time the bench reports; and it counts how many
calls took the general path instead of the decode-time fast path (low_latency_fast.py).

One process, a one-rank NCCL group, DeepEP's decode shape (128 tokens, hidden 7168, top-8 of
288, fp8 dispatch); with ``--vs-deepep`` DeepEP V1's Buffer gets the same calls (when it imports).

    PYTHONPATH=. python scripts/hook_mode_probe.py [--vs-deepep] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import tritonep
from tritonep.bench_low_latency import _one
from tritonep.bench_timing import load_deepep
from tritonep.rank_pool import init_one_rank_gpu_group


def _event_us(fn: Callable[[], object]) -> float:
    """The bench's per-call figure: L2 flushed, GPU idle at the start event, launch included."""
    return _one(dist.group.WORLD, fn)


def _host_us(fn: Callable[[], object]) -> float:
    """CPU time for ``fn`` to return, the GPU idle before."""
    torch.cuda.synchronize()
    begin = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - begin) / 1e3


def _kernel_us(rounds: Callable[[], None], per_round: int, iters: int) -> list[float]:
    """Median GPU time of each of the ``per_round`` kernels one call of ``rounds`` launches (in
    launch order), over ``iters`` rounds, from torch.profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            rounds()
            torch.cuda.synchronize()
    kernels = sorted((event for event in prof.events() if event.device_type == DeviceType.CUDA),
                     key=lambda event: event.time_range.start)
    kernels = [event for event in kernels if "elementwise" not in event.name and "fill" not in event.name]
    if len(kernels) != per_round * iters:
        return [float("nan")] * per_round
    return [statistics.median(kernels[round_ * per_round + k].time_range.elapsed_us() for round_ in range(iters))
            for k in range(per_round)]


def measure(buffer, x: torch.Tensor, topk_idx: torch.Tensor, weights: torch.Tensor, T: int, E: int,
            iters: int) -> dict:
    packed, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=True)
    expert_out = torch.randn(packed[0].shape, dtype=torch.float32, device=x.device).to(torch.bfloat16)
    pending: list = []

    def dispatch() -> None:
        buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=True)

    def dispatch_send() -> None:
        pending.append(buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=True, return_recv_hook=True)[4])

    def combine() -> None:
        buffer.low_latency_combine(expert_out, topk_idx, weights, handle)

    def combine_send() -> None:
        pending.append(buffer.low_latency_combine(expert_out, topk_idx, weights, handle, return_recv_hook=True)[2])

    def run_hook() -> None:
        pending.pop(0)()

    report = {}
    for name, single, send in (("dispatch", dispatch, dispatch_send), ("combine", combine, combine_send)):
        for _ in range(5):
            single()
            send()
            run_hook()
        rows = {"single_host": [], "single_event": [], "send_host": [], "send_event": [], "recv_host": [],
                "recv_event": []}
        for _ in range(iters):
            rows["single_host"].append(_host_us(single))
            rows["single_event"].append(_event_us(single))
            rows["send_host"].append(_host_us(send))
            rows["recv_host"].append(_host_us(run_hook))
            rows["send_event"].append(_event_us(send))
            rows["recv_event"].append(_event_us(run_hook))
        for key, values in rows.items():
            report[f"{name}_{key}_us"] = round(statistics.median(values), 2)
        report[f"{name}_single_kernel_us"] = round(_kernel_us(single, 1, iters)[0], 2)

        def send_then_hook(send: Callable[[], None] = send) -> None:
            send()
            run_hook()
        send_kernel, recv_kernel = _kernel_us(send_then_hook, 2, iters)
        report[f"{name}_send_kernel_us"], report[f"{name}_recv_kernel_us"] = round(send_kernel, 2), \
            round(recv_kernel, 2)
    return report


def count_general_calls(buffer, x: torch.Tensor, topk_idx: torch.Tensor, weights: torch.Tensor, T: int,
                        E: int) -> dict:
    """How many of 20 hook-mode calls (after 5) left the fast path for the general one."""
    engine = buffer.backend.low_latency
    general = {"dispatch": 0, "combine": 0}
    originals = engine.dispatch, engine.combine

    def counted(kind: str, original: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            general[kind] += 1
            return original(*args, **kwargs)
        return wrapper
    packed, _, handle, _, hook = buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=True, return_recv_hook=True)
    hook()
    expert_out = torch.randn(packed[0].shape, dtype=torch.float32, device=x.device).to(torch.bfloat16)
    for round_ in range(25):
        if round_ == 5:
            engine.dispatch, engine.combine = counted("dispatch", originals[0]), counted("combine", originals[1])
        buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=True, return_recv_hook=True)[4]()
        buffer.low_latency_combine(expert_out, topk_idx, weights, handle, return_recv_hook=True)[2]()
    engine.dispatch, engine.combine = originals
    torch.cuda.synchronize()
    return {f"{kind}_general_calls_of_20": count for kind, count in general.items()}


def _print_profile(buffer, x: torch.Tensor, topk_idx: torch.Tensor, T: int, E: int) -> None:
    import cProfile
    import io
    import pstats

    def rounds() -> None:
        for _ in range(200):
            buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=True, return_recv_hook=True)[4]()
    rounds()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.runcall(rounds)
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(18)
    print(text.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--vs-deepep", action="store_true")
    parser.add_argument("--profile", action="store_true", help="cProfile of 200 hook-mode dispatches")
    parser.add_argument("--json")
    args = parser.parse_args()
    device = init_one_rank_gpu_group()
    T, H, E, K = 128, 7168, 288, 8
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(T, H, generator=generator).to(torch.bfloat16).to(device)
    topk_idx = torch.rand(T, E, generator=generator).topk(K, dim=1).indices.to(device)
    weights = torch.rand(T, K, generator=generator).to(device)
    size = tritonep.Buffer.get_low_latency_rdma_size_hint(T, H, 1, E)
    results = {}
    buffer = tritonep.Buffer(dist.group.WORLD, 0, size, low_latency_mode=True, explicitly_destroy=True)
    results["tritonep"] = measure(buffer, x, topk_idx, weights, T, E, args.iters)
    results["tritonep"].update(count_general_calls(buffer, x, topk_idx, weights, T, E))
    if args.profile:
        _print_profile(buffer, x, topk_idx, T, E)
    buffer.destroy()
    if args.vs_deepep:
        deep_ep, why = load_deepep()
        if deep_ep is None:
            results["deepep"] = why
        else:
            buffer = deep_ep.Buffer(dist.group.WORLD, 0, size, low_latency_mode=True, num_qps_per_rank=E,
                                    allow_nvlink_for_low_latency_mode=True, explicitly_destroy=True)
            results["deepep"] = measure(buffer, x, topk_idx, weights, T, E, args.iters)
            buffer.destroy()
    for who, report in results.items():
        print(f"== {who}")
        if isinstance(report, str):
            print(report)
            continue
        for key, value in report.items():
            print(f"  {key:<34} {value}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(results, file, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
