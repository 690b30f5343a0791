"""DeepEP V2's API beside V1's (``--api v2``): ``ElasticBuffer`` and ``Buffer`` on the same
backend, the same inputs, in the same run.

Each row is one V2 call and the V1 call(s) that move the same rows with the same kernels at
the same ``--num-sms``:

* fresh dispatch: V2's ``dispatch(x, topk_idx=..., num_experts=E)`` works out its own layout
  and reads the counts back (exact sizes); V1's is ``get_dispatch_layout`` then ``dispatch``;
* fresh dispatch, no CPU sync: V2's ``do_cpu_sync=False`` (outputs of the worst-case size, as a
  decode step or a CUDA graph needs) against V1's ``num_worst_tokens = R * T``. V2 has no
  low-latency calls of its own: this is the shape its decode steps take;
* cached dispatch: ``dispatch(x, handle=handle)``;
* combine: ``combine(recv_x, handle)``, and with the received top-k weights.

Per call: GPU time (``timing.median_us``: one call at a time, the host path hidden) and host
CPU time per call made back to back (``timing.paired_back_to_back_host_us``): rounds of 10 calls,
V1's and V2's in turn, the order swapped every pair, over ``--rounds`` rounds of 5 pairs (at
least 5 rounds on GPUs), so that the host's speed, which drifts within minutes, moves both
alike; each figure is the median over the rounds of calls and "v2 - v1" the median of the
pairs' differences. Fresh dispatches made back to back wait on the
GPU (the counts a call reads back, the buffer the previous call still uses), so their host time
per call is the GPU's and would charge V2's extra kernel to its front end: on GPUs the fresh
rows' host time is that of one call with the GPU idle before it (``timing.idle_starts``). Even
so, a fresh dispatch that reads its counts back spends most of that time waiting for the count
exchange, whose length is the GPU's work before it and the ranks' skew, and moves by tens of
microseconds from call to call: so the fresh rows time V1's and V2's calls in turn, and "v2 -
v1" is the median of the per-pair differences (``timing.idle_paired_host_us``); they also give
each call's host work, its time less that wait (``internals.count_waits``). V2's
fresh dispatch also makes the EPHandle's fields (prefix sums, source metadata, destination rows)
that V1's handle does not have (and needs no layout call: on the NVLink backend its count
exchange works the layout out itself): on the NVLink backend the dispatch's receivers write them
into one block that also holds the copy of topk_idx, one allocation (``tests/test_v2_repeat.py``
counts it), and an expanded layout adds one launch of the expert-layout kernel. On CPU ranks both run
on the collective backend, which computes the fields with plain torch, and every figure is
wall-clock time.
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

from . import host_profile, inputs, internals, timing
from .normal import make_buffer

# The V2 - V1 host time per call that the V2 front end may add (the target).
HOST_BUDGET_US = 5.0
MIN_ROUNDS = 5
# Pairs of calls per round of a fresh row's host time (each call with the GPU idle before it): one
# such call's host time varies by over a hundred microseconds (the count wait, the ranks' skew, a
# CPU that idled), far more than the V2 - V1 differences the row is there to show.
FRESH_PAIRS_PER_ROUND = 40


def make_elastic_buffer(group: dist.ProcessGroup, backend: str, **kwargs: object) -> tritonep.ElasticBuffer:
    """An ElasticBuffer of the ``backend`` asked for, chosen the documented way (``TRITONEP_BACKEND``)."""
    os.environ["TRITONEP_BACKEND"] = backend
    try:
        return tritonep.ElasticBuffer(group, **kwargs)
    finally:
        os.environ.pop("TRITONEP_BACKEND")


def paired_calls(group: dist.ProcessGroup, args: argparse.Namespace, backend: str,
                 device: torch.device) -> tuple[dict[str, tuple[Callable[[], object], Callable[[], object]]], list]:
    """{row: (V1 call, V2 call)} on one routing, and the two buffers (to destroy)."""
    R, N, H, E, K, n = group.size(), args.tokens, args.hidden, args.experts, args.topk, args.num_sms
    x, topk_idx, topk_weights = inputs.routing(N, H, E, K, group.rank(), device)
    v1 = make_buffer(group, backend, num_nvl_bytes=inputs.nvl_bytes(N, H, R), explicitly_destroy=True)
    v2 = make_elastic_buffer(group, backend, num_max_tokens_per_rank=N, hidden=H, num_topk=K,
                             explicitly_destroy=True)
    config = tritonep.Config(n)

    def v1_fresh(num_worst_tokens: int = 0) -> tuple:
        per_rank, _, per_expert, in_rank, _ = v1.get_dispatch_layout(topk_idx, E)
        return v1.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                           topk_idx=topk_idx, topk_weights=topk_weights, num_worst_tokens=num_worst_tokens,
                           config=config)

    def v2_fresh(do_cpu_sync: bool = True) -> tuple:
        return v2.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=E, num_sms=n,
                           do_cpu_sync=do_cpu_sync)

    recv_x1, _, recv_weights1, _, handle1, _ = v1_fresh()
    recv_x2, _, recv_weights2, handle2, _ = v2_fresh()
    rows = {
        "fresh dispatch": (v1_fresh, v2_fresh),
        "fresh dispatch, no CPU sync": (lambda: v1_fresh(R * N), lambda: v2_fresh(False)),
        "cached dispatch": (lambda: v1.dispatch(x, handle=handle1, config=config),
                            lambda: v2.dispatch(x, handle=handle2, num_sms=n)),
        "combine": (lambda: v1.combine(recv_x1, handle1, config=config), lambda: v2.combine(recv_x2, handle2)),
        "combine, top-k weights": (lambda: v1.combine(recv_x1, handle1, recv_weights1, config=config),
                                   lambda: v2.combine(recv_x2, handle2, topk_weights=recv_weights2)),
    }
    return rows, [v1, v2]


def measure_row(group: dist.ProcessGroup, v1_call: Callable[[], object], v2_call: Callable[[], object],
                args: argparse.Namespace, waits_on_gpu: bool, waited_ns: Callable[[], int]) -> dict:
    """One row's figures (see the module's docstring); every figure the slowest rank's.
    ``waits_on_gpu``: the call waits on the GPU, so that on GPUs its host time is taken with the
    GPU idle before each call, V1's and V2's calls in turn, instead of back to back, and its host
    work without the count exchange's wait too (``waited_ns``: ``internals.count_waits``)."""
    gpu = timing.on_gpu(group)
    idle = gpu and waits_on_gpu
    rounds = max(args.rounds, MIN_ROUNDS) if gpu else args.rounds
    gpu_us: dict[str, list[float]] = {"v1": [], "v2": []}
    host_us: dict[str, list[float]] = {"v1": [], "v2": []}   # per pair: of calls (idle), of rounds of calls
    work_us: dict[str, list[float]] = {"v1": [], "v2": []}
    calls = {"v1": v1_call, "v2": v2_call}
    for round_ in range(rounds):
        order = ("v1", "v2") if round_ % 2 == 0 else ("v2", "v1")
        if idle:
            times = timing.idle_paired_host_us(group, v1_call, v2_call, FRESH_PAIRS_PER_ROUND, waited_ns)
        else:
            times = timing.paired_back_to_back_host_us(v1_call, v2_call, calls=10, pairs=5)
        for api, name in (("v1", "first"), ("v2", "second")):
            host_us[api] += times[name]
            work_us[api] += times.get(f"{name}_work", [])
        for api in order:
            gpu_us[api].append(timing.median_us(group, calls[api], max(args.iters // rounds, 3)))
    row = {f"{api}_gpu_us": statistics.median(gpu_us[api]) for api in calls}
    # "v2 - v1": the median of the per-pair differences (``timing.idle_paired_host_us``,
    # ``timing.paired_back_to_back_host_us``).
    for name, figures in (("host", host_us), ("host_work", work_us)):
        if figures["v1"]:
            differences = [v2 - v1 for v1, v2 in zip(figures["v1"], figures["v2"])]
            row.update({f"{api}_{name}_us": timing.slowest(group, statistics.median(figures[api])) for api in calls})
            row[f"v2_minus_v1_{name}_us"] = timing.slowest(group, statistics.median(differences))
    return row


def run_rank(group: dist.ProcessGroup, args: argparse.Namespace) -> dict:
    """The V2-beside-V1 report (rank 0's copy is printed and saved)."""
    gpu = timing.on_gpu(group)
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    backend = "nvlink" if gpu else "collective"
    report: dict = {"ranks": group.size(), "tokens": args.tokens, "hidden": args.hidden, "experts": args.experts,
                    "topk": args.topk, "num_sms": args.num_sms, "backend": backend,
                    "device": torch.cuda.get_device_name() if gpu else "cpu",
                    "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                    "host_budget_us": HOST_BUDGET_US, "rows": {}}
    # How fast this host is (host figures move with it): a torch add_ back to back.
    yardstick = torch.zeros(16, dtype=torch.float32, device=device)
    report["torch_add_host_back_to_back_us"] = timing.slowest(
        group, timing.back_to_back_host_us(lambda: yardstick.add_(1)))
    rows, buffers = paired_calls(group, args, backend, device)
    with internals.count_waits() as waited_ns:
        for name, (v1_call, v2_call) in rows.items():
            report["rows"][name] = measure_row(group, v1_call, v2_call, args, waits_on_gpu=name.startswith("fresh"),
                                               waited_ns=waited_ns)
    if args.host_profile:
        report["host_profile"] = {}
        for name, (v1_call, v2_call) in rows.items():
            v1_us, v2_us = (host_profile.own_us_per_call(group, call, args.iters) for call in (v1_call, v2_call))
            report["host_profile"][name] = {"v1_us": sum(v1_us.values()), "v2_us": sum(v2_us.values()),
                                            "largest_differences": host_profile.largest_differences(v1_us, v2_us),
                                            "v1_largest": host_profile.largest(v1_us),
                                            "v2_largest": host_profile.largest(v2_us)}
    for buffer in buffers:
        buffer.destroy()
    return report


def print_report(report: dict) -> None:
    print(f"\nV2 (ElasticBuffer) beside V1 (Buffer): {report['ranks']} ranks on {report['device']}, "
          f"{report['backend']} backend, {report['tokens']} tokens/rank, hidden {report['hidden']}, "
          f"top-{report['topk']} of {report['experts']} experts, num_sms={report['num_sms']}")
    # On CPU ranks a call's time is mostly gloo's, and its spread hides a few microseconds.
    gpu = report["backend"] == "nvlink"
    print(f"{'call':<30}{'GPU us v1' if gpu else 'wall us v1':>11}{'v2':>9}{'host us v1':>12}{'v2':>9}{'v2 - v1':>9}")
    for name, row in report["rows"].items():
        over = "  over budget" if gpu and row["v2_minus_v1_host_us"] > report["host_budget_us"] else ""
        print(f"{name:<30}{row['v1_gpu_us']:>11.1f}{row['v2_gpu_us']:>9.1f}{row['v1_host_us']:>12.1f}"
              f"{row['v2_host_us']:>9.1f}{row['v2_minus_v1_host_us']:>9.1f}{over}")
        if "v2_minus_v1_host_work_us" in row:
            over = "  over budget" if row["v2_minus_v1_host_work_us"] > report["host_budget_us"] else ""
            print(f"{'  (host work, no count wait)':<30}{'':>20}{row['v1_host_work_us']:>12.1f}"
                  f"{row['v2_host_work_us']:>9.1f}{row['v2_minus_v1_host_work_us']:>9.1f}{over}")
    print(f"(host: CPU time per call made back to back, fresh dispatches on GPUs one at a time with the GPU idle "
          f"before, and their host work: that time less the wait for the count exchange's result, which mostly "
          f"measures the GPU and the ranks' skew; budget for V2's front end: "
          f"{report['host_budget_us']:.0f} us over V1; a fresh V2 dispatch also makes the EPHandle's fields: on "
          f"GPUs one allocation, the dispatch's receivers writing them)")
    print(f"(host yardstick: a torch add_ per call, back to back, {report['torch_add_host_back_to_back_us']:.1f} us)")
    for name, profiled in report.get("host_profile", {}).items():
        host_profile.print_differences(name, profiled)
