"""Benchmark: tritonep's dispatch/combine against what users would do without it.

    python -m tritonep.bench [--ranks R] [--tokens N] [--hidden H] [--experts E] [--topk K]
                             [--num-sms 24] [--iters 50] [--out DIR] [--sweep] [--vs-deepep]

On GPUs (one rank per GPU, NCCL) it measures, in one run and on the same routing:
* tritonep (NVLink backend): layout, dispatch with its count exchange, cached dispatch in bf16
  and fp8, and combine, at ``--num-sms`` programs; also what the count exchange adds, as the
  median over interleaved pairs of (fresh - cached) dispatch;
* the all_to_all_single path: tritonep's collective backend on NCCL (layout in torch, count
  exchange, permute, ``all_to_all_single``, un-permute), and the bare ``all_to_all_single``
  of the already-permuted rows;
* DeepEP V1 (``--vs-deepep``, when ``import deep_ep`` gives DeepEP itself, built with
  ../shared/deepep/build_on_device.sh): its Buffer on the same inputs with the same timing;
  otherwise the report says why it is missing;
* the link ceiling: the copy engine pushing the same remote bytes into the peers' symmetric
  memory, one stream per peer, peers in rotated order, while every GPU does the same;
* with ``--sweep``, a curve over num_sms (4 to 64, DeepEP's too) and a few kernel shapes;
* the low-latency (decode) calls, see ``bench_low_latency`` (``--ll-tokens``, ``--ll-experts``).

Bandwidth is DeepEP's "NVL GB/s": received bf16 bytes (rows from the rank itself included) over
the time of one call (fp8: bytes scaled by (1 + 4/128) / 2). Times are medians of CUDA-event
timings (``--iters``, 50 by default), the GPUs aligned by a small all-reduce, L2 flushed and the
stream put to sleep for about 1 ms before each call (the host enqueues the call meanwhile, so
the events time the GPU, as DeepEP's flush-then-call timing intends); every figure is the
slowest rank's. The host's CPU time per call is reported beside them. On GPUs the main figures are
taken in ``--rounds`` rounds (2 by default), tritonep and DeepEP in turn: each is the median over
the rounds, and the table gives the rounds' largest spread. Without GPUs it runs the CPU backend
on gloo ranks at a small size so the command works everywhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import tritonep
from tritonep import bench_low_latency, utils
from tritonep.bench_report import plot, print_table
from tritonep.bench_timing import back_to_back_host_us, flush_l2, host_head_start, load_deepep, slowest
from tritonep.rank_pool import RankPool


def _call_times_us(group: dist.ProcessGroup, fns: list[Callable[[], object]], iters: int,
                   warmup: int = 3) -> list[list[float]]:
    """Microseconds of each call of each ``fn``, the fns called in turn ``iters`` times, all
    ranks starting together, L2 flushed and the stream asleep before each call on GPUs (this
    rank's times: the call's time on the GPU, its host path enqueued during the flush and the
    sleep)."""
    gpu = torch.cuda.is_available() and dist.get_backend(group) == "nccl"
    align = torch.zeros(1, dtype=torch.float32, device="cuda" if gpu else "cpu")
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list] = [[] for _ in fns]
    for _ in range(iters):
        for fn, fn_times in zip(fns, times):
            # Align the ranks, flush, then give the host a head start (``host_head_start``): the
            # events time the call on the GPU, its host path enqueued while the GPU still flushes
            # and sleeps, as DeepEP's own timing intends (flush, record, call). Without it, a call
            # whose kernels are shorter than its host path measured its host time instead (cached
            # fp8 dispatch at one rank: 76 us in some rounds, 130-178 in others, kernel 72-74 us;
            # docs/benchmarks/2026-11-24-h200x1-s6). Host time has rows of its own (``host_us``).
            dist.all_reduce(align, group=group)
            if gpu:
                flush_l2()
                host_head_start()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                fn_times.append((start, end))
            else:
                begin = time.perf_counter()
                fn()
                fn_times.append((time.perf_counter() - begin) * 1e6)
    if gpu:
        torch.cuda.synchronize()
        times = [[s.elapsed_time(e) * 1e3 for s, e in fn_times] for fn_times in times]
    return times


def _median_us(group: dist.ProcessGroup, fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    """Median microseconds of ``fn`` over ``iters`` calls, all ranks starting together, L2
    flushed before each call on GPUs; the slowest rank's."""
    return slowest(group, statistics.median(_call_times_us(group, [fn], iters, warmup)[0]))


def _extra_us(group: dist.ProcessGroup, fn: Callable[[], object], base: Callable[[], object], iters: int) -> float:
    """Median over pairs of (``fn``'s time - ``base``'s), the two called in turn: a difference
    that the host's speed drifting over seconds moves far less than two separate medians."""
    fn_times, base_times = _call_times_us(group, [fn, base], iters)
    return slowest(group, statistics.median(a - b for a, b in zip(fn_times, base_times)))


def _pipelined_us(group: dist.ProcessGroup, fn: Callable[[], object], iters: int) -> float:
    """Microseconds per call when calls are issued back to back (host runs ahead of the GPU,
    as in a training loop): per-call host overhead hides behind the previous call's kernels."""
    align = torch.zeros(1, dtype=torch.float32, device="cuda")
    fn()
    dist.all_reduce(align, group=group)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return slowest(group, start.elapsed_time(end) * 1e3 / iters)


def _make_routing(args: argparse.Namespace, rank: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(1234 + rank)
    x = torch.randn(args.tokens, args.hidden, dtype=torch.float32, device=device).to(torch.bfloat16)
    scores = torch.randn(args.tokens, args.experts, dtype=torch.float32, device=device).abs() + 1
    topk_idx = scores.topk(args.topk, dim=-1).indices
    topk_weights = torch.rand(args.tokens, args.topk, dtype=torch.float32, device=device)
    return x, topk_idx, topk_weights


def _buffer(group: dist.ProcessGroup, backend: str, nvl_bytes: int) -> tritonep.Buffer:
    os.environ["TRITONEP_BACKEND"] = backend
    try:
        return tritonep.Buffer(group, num_nvl_bytes=nvl_bytes)
    finally:
        os.environ.pop("TRITONEP_BACKEND")


def _measure_buffer(group, buffer, args, x, topk_idx, topk_weights, num_sms: int, fp8: bool = True,
                    module=tritonep, only: str | None = None) -> dict:
    """Times of one Buffer's calls and the received bytes they move. ``module`` is the package
    the Buffer comes from (tritonep, or DeepEP's deep_ep): both size their configs the same way."""
    module.Buffer.set_num_sms(num_sms)
    config = module.Buffer.get_dispatch_config(group.size())
    combine_config = module.Buffer.get_combine_config(group.size())
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, args.experts)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    recv_x, _, recv_weights, _, handle, _ = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights,
                                                            config=config, **layout)
    recv_bytes = recv_x.numel() * 2
    x_fp8 = utils.per_token_cast_to_fp8(x)
    iters = args.iters

    def layout_call() -> object:
        return buffer.get_dispatch_layout(topk_idx, args.experts)

    def fresh() -> object:
        return buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, config=config, **layout)

    def cached() -> object:
        return buffer.dispatch(x, handle=handle, config=config)

    def combine() -> object:
        return buffer.combine(recv_x, handle, config=combine_config)

    if only == "combine":
        return {"combine_us": _median_us(group, combine, iters)}
    result = {
        "recv_rows": recv_x.shape[0],
        "layout_us": _median_us(group, layout_call, iters),
        "dispatch_us": _median_us(group, fresh, iters),
        "cached_dispatch_us": _median_us(group, cached, iters),
        "combine_us": _median_us(group, combine, iters),
    }
    if x.is_cuda:
        # CPU time per call, calls made back to back (the GPU synchronised between rounds).
        result["host_us"] = {name: back_to_back_host_us(fn, calls=10, rounds=7) for name, fn in
                             (("layout", layout_call), ("cached_dispatch", cached), ("combine", combine))}
        result["layout_pipelined_us"] = _pipelined_us(group, layout_call, iters)
        result["cached_dispatch_pipelined_us"] = _pipelined_us(group, cached, iters)
        result["combine_pipelined_us"] = _pipelined_us(group, combine, iters)
    if fp8:   # the main measurement of tritonep and DeepEP (the sweeps and the all_to_all path skip these)
        # The end event is recorded after the host has the counts and did its work after them,
        # so this row is the count exchange plus whatever of that host work outlasts the receive
        # kernel: at one rank (a 112 us receive then, 64 us since every program receives there)
        # it followed the host's speed, 18 us in one run and 62-78 us in another
        # (docs/benchmarks/2026-11-25-h100x1-s13, fresh_pairs_probe.py).
        result["fresh_minus_cached_dispatch_us"] = _extra_us(group, fresh, cached, iters)
        result["cached_dispatch_fp8_us"] = _median_us(group, lambda: buffer.dispatch(x_fp8, handle=handle,
                                                                                     config=config), iters)
    recv = torch.tensor([recv_bytes], dtype=torch.float64, device=x.device)
    dist.all_reduce(recv, op=dist.ReduceOp.MIN, group=group)
    result["recv_bytes"] = float(recv)
    return result


def _bare_all_to_all_us(group, args, x, in_rank) -> float:
    """all_to_all_single of rows already grouped by destination (the transfer alone)."""
    counts = in_rank.sum(0).tolist()
    send = x[in_rank.t().nonzero()[:, 1]]
    recv_counts = torch.tensor(counts, dtype=torch.int64, device=x.device)
    all_counts = torch.empty_like(recv_counts)
    dist.all_to_all_single(all_counts, recv_counts, group=group)
    recv = torch.empty(int(all_counts.sum()), x.shape[1], dtype=x.dtype, device=x.device)
    return _median_us(group, lambda: dist.all_to_all_single(recv, send, all_counts.tolist(), counts, group=group),
                      args.iters)


def _copy_engine_ceiling(group, remote_bytes: int) -> float:
    """GB/s of the copy engine pushing ``remote_bytes`` into peers' symmetric memory, all GPUs at once."""
    import torch.distributed._symmetric_memory as symm_mem

    rank, num_ranks = group.rank(), group.size()
    largest = torch.tensor([remote_bytes], dtype=torch.int64, device="cuda")
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)    # symmetric memory: same size everywhere
    per_peer = max(int(largest) // max(num_ranks - 1, 1) // 16 * 16, 16)
    buffer = symm_mem.empty(per_peer * num_ranks, dtype=torch.uint8, device="cuda")
    handle = symm_mem.rendezvous(buffer, group.group_name)
    source = torch.randint(0, 255, (per_peer,), dtype=torch.uint8, device="cuda")
    # Peers in rotated order (rank+1, rank+2, ...), so that the GPUs do not all start on the same
    # peer, and one stream per peer, so that the copies to different peers run at once.
    peers = [(rank + step) % num_ranks for step in range(1, num_ranks)]
    views = [handle.get_buffer(peer, (per_peer,), torch.uint8, storage_offset=rank * per_peer) for peer in peers]
    streams = [torch.cuda.Stream() for _ in peers]

    def push() -> None:
        current = torch.cuda.current_stream()
        for view, stream in zip(views, streams):
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                view.copy_(source, non_blocking=True)
        for stream in streams:
            current.wait_stream(stream)
    us = _median_us(group, push, 20)
    return per_peer * len(views) / us / 1e3


def run_rank(group: dist.ProcessGroup, args: argparse.Namespace) -> dict:
    rank, num_ranks = group.rank(), group.size()
    gpu = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    x, topk_idx, topk_weights = _make_routing(args, rank, device)
    nvl_bytes = 2 * (args.tokens * num_ranks * (args.hidden * 2 + 256)) + (64 << 20)
    report: dict = {"ranks": num_ranks, "tokens": args.tokens, "hidden": args.hidden, "experts": args.experts,
                    "topk": args.topk, "num_sms": args.num_sms, "device": torch.cuda.get_device_name() if gpu
                    else "cpu", "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    collective = _buffer(group, "collective", 0)
    report["all_to_all_path"] = _measure_buffer(group, collective, args, x, topk_idx, topk_weights, args.num_sms,
                                                fp8=False)
    _, _, _, in_rank, _ = collective.get_dispatch_layout(topk_idx, args.experts)
    report["bare_all_to_all_us"] = _bare_all_to_all_us(group, args, x, in_rank)
    ours = _buffer(group, "nvlink", nvl_bytes) if gpu else None
    deepep = _deepep_buffer(group, nvl_bytes, gpu) if args.vs_deepep else None
    # Rounds of the main figures, tritonep and DeepEP in turn: each figure is the median over
    # rounds, and the rounds' spread shows whether the run is a result (issue #10: within 10%).
    rounds: dict[str, list[dict]] = {"tritonep": [], "deepep": []}
    for _ in range(args.rounds if gpu else 1):
        if ours is not None:
            rounds["tritonep"].append(_measure_buffer(group, ours, args, x, topk_idx, topk_weights, args.num_sms))
        if isinstance(deepep, tuple):
            rounds["deepep"].append(_measure_deepep(group, deepep, args, x, topk_idx, topk_weights, args.num_sms))
    for name, measured in rounds.items():
        if measured and all("error" not in m for m in measured):
            report[name] = combine_rounds(measured)
        elif measured:
            report[name] = next(m for m in measured if "error" in m)
    if isinstance(deepep, dict):
        report["deepep"] = deepep
    if ours is not None:
        report["tritonep"]["combine_sm_only_us"] = _sm_only_combine_us(group, ours, args, x, topk_idx, topk_weights)
        remote_rows = int(in_rank.sum()) - int(in_rank[:, rank].sum())
        report["remote_bytes"] = remote_rows * args.hidden * 2
        report["copy_engine_ceiling_gbps"] = _copy_engine_ceiling(group, report["remote_bytes"])
        if args.sweep:
            report["num_sms_curve"] = {
                n: _measure_buffer(group, ours, args, x, topk_idx, topk_weights, n, fp8=False) for n in SWEEP_SMS}
            report["shape_sweep"] = _shape_sweep(group, ours, args, x, topk_idx, topk_weights)
    if isinstance(deepep, tuple):
        if args.sweep and "error" not in report["deepep"]:
            report["deepep"]["num_sms_curve"] = {n: _measure_deepep(group, deepep, args, x, topk_idx, topk_weights,
                                                                    n, fp8=False) for n in SWEEP_SMS}
        try:
            deepep[1].destroy()
        except Exception as error:  # noqa: BLE001 - e.g. its runtime refusing this rank count
            report["deepep"].setdefault("error", f"destroy: {type(error).__name__}: {error}")
        deepep[0].Buffer.set_num_sms(args.num_sms)
    tritonep.Buffer.set_num_sms(args.num_sms)
    return report


def combine_rounds(rounds: list[dict]) -> dict:
    """One report from several rounds of ``_measure_buffer``: each figure the median over the
    rounds; with 2+ rounds also ``rounds`` (each round's figures) and ``round_spread`` (per GPU
    time figure, slowest / fastest round - 1; the host times are left out)."""
    if len(rounds) == 1:
        return dict(rounds[0])
    def median(values: list) -> object:   # numbers, or dicts of numbers (host_us) key by key
        if isinstance(values[0], dict):
            return {key: statistics.median(v[key] for v in values) for key in values[0]}
        return statistics.median(values)

    result = {key: median([m[key] for m in rounds]) for key in rounds[0]}
    result["recv_rows"], result["recv_bytes"] = rounds[0]["recv_rows"], rounds[0]["recv_bytes"]
    result["rounds"] = rounds
    timed = [key for key in rounds[0] if key.endswith("_us") and isinstance(rounds[0][key], float | int)]
    result["round_spread"] = {key: max(m[key] for m in rounds) / min(m[key] for m in rounds) - 1
                              for key in timed if min(m[key] for m in rounds) > 0}
    return result


SWEEP_SMS = (4, 8, 16, 24, 32, 64)


def _sm_only_combine_us(group, buffer, args, x, topk_idx, topk_weights) -> float:
    """Combine with the rows pushed by SMs instead of the copy engines (what a dispatch made
    with num_worst_tokens gets), same handle and timing, to compare the two paths."""
    default = buffer.backend.tuning
    buffer.backend.tuning = dataclasses.replace(default, copy_engine_combine=False)
    try:
        return _measure_buffer(group, buffer, args, x, topk_idx, topk_weights, args.num_sms, fp8=False,
                               only="combine")["combine_us"]
    finally:
        buffer.backend.tuning = default


def _deepep_buffer(group, nvl_bytes: int, gpu: bool) -> tuple | dict:
    """``(deep_ep module, its Buffer)`` for ``--vs-deepep``, or a ``{"missing": why}`` /
    ``{"error": ...}`` entry when deep_ep does not import or its Buffer fails, so that the rest
    of the run still reports."""
    module, why = load_deepep()
    if module is None or not gpu:
        return {"missing": why or "DeepEP runs on GPUs only"}
    try:
        return module, module.Buffer(group, nvl_bytes, 0, low_latency_mode=False, num_qps_per_rank=1,
                                     explicitly_destroy=True)
    except Exception as error:  # noqa: BLE001 - report it, keep the run's other figures
        return {"error": f"{type(error).__name__}: {error}"}


def _measure_deepep(group, deepep: tuple, args, x, topk_idx, topk_weights, num_sms: int, fp8: bool = True) -> dict:
    """DeepEP V1's Buffer on the same inputs with the same timing, or ``{"error": ...}``."""
    module, buffer = deepep
    try:
        return _measure_buffer(group, buffer, args, x, topk_idx, topk_weights, num_sms, fp8=fp8, module=module)
    except Exception as error:  # noqa: BLE001 - report it, keep the run's other figures
        return {"error": f"{type(error).__name__}: {error}"}


def _shape_sweep(group, buffer, args, x, topk_idx, topk_weights) -> list[dict]:
    """Kernel shapes around the defaults (one field changed at a time) at --num-sms."""
    results = []
    default = buffer.backend.tuning
    # block: the row-moving chunk (default 64 KB, tuning.tile_block, chosen at one rank: its best
    # width over NVLink is still to measure); combine_pieces: 1 and 2 per peer at any rank count.
    # sender_fraction 1/3 and 0.4: a program moves at most ~47 GB/s of rows (session 13), and at
    # EP2 the receivers copy twice the rows the senders push (own rows and arrived rows against
    # the rows sent), so a third of the programs sending should balance the halves there.
    variants = [dict(), dict(warps=16), dict(rows=4), dict(rows=16), dict(block=1024), dict(block=4096),
                dict(combine_pieces=1), dict(combine_pieces=2),
                dict(tokens=1), dict(tokens=2), dict(tokens=8), dict(combine_block=1024), dict(combine_block=4096),
                dict(sender_fraction=1 / 3), dict(sender_fraction=0.4),
                dict(sender_fraction=0.5, combine_sender_fraction=0.25),
                dict(sender_fraction=0.75, combine_sender_fraction=0.5)]
    for change in variants:
        buffer.backend.tuning = dataclasses.replace(default, **change)
        measured = _measure_buffer(group, buffer, args, x, topk_idx, topk_weights, args.num_sms, fp8=False)
        results.append({"change": change or "defaults", **dataclasses.asdict(buffer.backend.tuning), **measured})
    buffer.backend.tuning = default
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    gpus = torch.cuda.device_count()
    parser.add_argument("--ranks", type=int, default=gpus if gpus >= 2 else 4)
    parser.add_argument("--tokens", type=int, default=4096 if gpus >= 2 else 256)
    parser.add_argument("--hidden", type=int, default=7168 if gpus >= 2 else 512)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--num-sms", type=int, default=24)
    parser.add_argument("--iters", type=int, default=50, help="timed calls per figure (median)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="rounds of the main figures on GPUs (tritonep and DeepEP in turn): medians and spread")
    parser.add_argument("--sweep", action="store_true", help=f"num_sms curve {SWEEP_SMS} and kernel shapes")
    parser.add_argument("--vs-deepep", action="store_true",
                        help="also DeepEP V1 (import deep_ep) on the same inputs, when it imports")
    parser.add_argument("--cpu", action="store_true", help="CPU ranks even when GPUs exist")
    parser.add_argument("--gpu", action="store_true",
                        help="GPU ranks (one per GPU) even on a machine with one GPU, where the default is CPU ranks")
    parser.add_argument("--ll-tokens", type=int, default=128 if gpus >= 2 else 16,
                        help="low-latency part: tokens per rank (T)")
    parser.add_argument("--ll-experts", type=int, default=288 if gpus >= 2 else 16)
    parser.add_argument("--skip-normal", action="store_true", help="only the low-latency part")
    parser.add_argument("--skip-low-latency", action="store_true", help="only the normal-mode part")
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args(argv)
    use_gpu = (gpus >= 2 or (args.gpu and gpus >= 1)) and not args.cpu
    backends = ["nvlink", "collective"] if use_gpu else ["collective"]
    with RankPool(args.ranks if not use_gpu else min(args.ranks, gpus), use_gpu=use_gpu, timeout=1200) as pool:
        report = {} if args.skip_normal else pool.run(run_rank, args)[0]
        if not args.skip_low_latency:
            report["low_latency"] = pool.run(bench_low_latency.run_rank, args, backends)[0]
    if not args.skip_normal:
        print_table(report)
    if "low_latency" in report:
        bench_low_latency.print_table(report["low_latency"])
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path}")
    plot(report, os.path.join(args.out, "bench.png"))


if __name__ == "__main__":
    main()
