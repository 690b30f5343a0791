"""Normal mode (training and prefill): tritonep's NVLink backend, the all_to_all_single path
and DeepEP V1 on the same routing, with the same timing.

Per Buffer: layout, dispatch with its count exchange, cached dispatch in bf16 and fp8, combine,
each timed on its own (``timing.median_us``) and, on GPUs, back to back; the host's CPU time per
call, of a call repeated with one handle and of a cached dispatch and a combine each on a new
handle (what a training step makes); the count exchange's cost as the median over interleaved
pairs of (fresh - cached). The main figures are taken in ``--rounds`` rounds, tritonep and
DeepEP in turn.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import tritonep

from . import ceiling, host_profile, inputs, timing
from .deepep import deepep_buffer, guarded
from .internals import changed_tuning, copy_engine_receives

SWEEP_SMS = (4, 8, 16, 24, 32, 64)


def make_buffer(group: dist.ProcessGroup, backend: str, env: dict[str, str] | None = None,
                **kwargs: object) -> tritonep.Buffer:
    """A tritonep Buffer of the ``backend`` asked for ("nvlink", or "collective": the
    all_to_all_single path), chosen the documented way (``TRITONEP_BACKEND``), with the
    variables ``env`` (e.g. ``TRITONEP_GPUS_PER_NODE``) set while it is built."""
    settings = {"TRITONEP_BACKEND": backend, **(env or {})}
    os.environ.update(settings)
    try:
        return tritonep.Buffer(group, **kwargs)
    finally:
        for name in settings:
            os.environ.pop(name)


def buffer_calls(group: dist.ProcessGroup, buffer: object, args: argparse.Namespace, x: torch.Tensor,
                 topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_sms: int,
                 module: object = tritonep) -> tuple[dict[str, Callable[..., object]], torch.Tensor]:
    """The calls the bench makes on one Buffer, after one fresh dispatch that makes their handle:
    ``layout``, ``fresh`` (dispatch with the count exchange, returning what dispatch returns),
    ``cached(x)`` (a dispatch of ``x`` with the handle) and ``combine(x)``, and the same two with
    another fresh dispatch's outputs, ``cached_with(handle)`` and ``combine_with(dispatched)``;
    and the rows that dispatch received. ``module`` is the package the Buffer comes from
    (tritonep, or DeepEP's deep_ep): both size their configs the same way."""
    module.Buffer.set_num_sms(num_sms)
    config = module.Buffer.get_dispatch_config(group.size())
    combine_config = module.Buffer.get_combine_config(group.size())
    per_rank, per_node, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, args.experts)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    if per_node is not None:   # a group split into nodes
        layout["num_tokens_per_rdma_rank"] = per_node
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, config=config,
                                                 **layout)
    calls = {
        "layout": lambda: buffer.get_dispatch_layout(topk_idx, args.experts),
        "fresh": lambda: buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, config=config, **layout),
        "cached": lambda x_in=x: buffer.dispatch(x_in, handle=handle, config=config),
        "combine": lambda x_in=recv_x: buffer.combine(x_in, handle, config=combine_config),
        "cached_with": lambda other: buffer.dispatch(x, handle=other, config=config),
        # ``dispatched``: a fresh dispatch's return value, (recv_x, ..., handle, event).
        "combine_with": lambda dispatched: buffer.combine(dispatched[0], dispatched[4], config=combine_config),
    }
    return calls, recv_x


def on_new_rows(combine: Callable[[torch.Tensor], object], recv_x: torch.Tensor) -> Callable[[], object]:
    """``combine`` of rows like ``recv_x`` at another address than the call before: two copies in
    turn, so that nothing a library keeps for a repeated input serves it."""
    copies = itertools.cycle([recv_x.clone(), recv_x.clone()])
    return lambda: combine(next(copies))


def measure_buffer(group: dist.ProcessGroup, buffer: object, args: argparse.Namespace, x: torch.Tensor,
                   topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_sms: int, fp8: bool = True,
                   module: object = tritonep, only_combine: bool = False, fp8_cached: bool = False) -> dict:
    """Times of one Buffer's calls (``buffer_calls``) and the bytes they receive. ``fp8=False``
    leaves out the rows only the main measurement needs; ``fp8_cached`` keeps the cached fp8
    dispatch among them."""
    calls, recv_x = buffer_calls(group, buffer, args, x, topk_idx, topk_weights, num_sms, module)
    layout_call, fresh, cached, combine = calls["layout"], calls["fresh"], calls["cached"], calls["combine"]
    iters = args.iters
    if only_combine:
        return {"combine_us": timing.median_us(group, combine, iters)}
    result = {
        "recv_rows": recv_x.shape[0],
        "layout_us": timing.median_us(group, layout_call, iters),
        "dispatch_us": timing.median_us(group, fresh, iters),
        "cached_dispatch_us": timing.median_us(group, cached, iters),
        "combine_us": timing.median_us(group, combine, iters),
    }
    # Host time per call: of one call repeated (as the GPU rows), of a cached dispatch and a
    # combine each on a new handle (as in training, where routing changes every step), and of a
    # combine with the handle again but new rows each call (the backward of a step's dispatch:
    # its input never repeats, so no work captured for a repeated input serves it).
    result["host_us"] = {name: timing.back_to_back_host_us(fn, calls=10, rounds=7) for name, fn in
                         (("layout", layout_call), ("cached_dispatch", cached), ("combine", combine))}
    result["host_us"]["combine_new_inputs"] = timing.back_to_back_host_us(on_new_rows(combine, recv_x),
                                                                          calls=10, rounds=7)
    result["host_us"]["cached_dispatch_new_handle"] = timing.first_use_host_us(lambda: fresh()[4],
                                                                               calls["cached_with"])
    result["host_us"]["combine_new_handle"] = timing.first_use_host_us(fresh, calls["combine_with"])
    if x.is_cuda:
        result["layout_pipelined_us"] = timing.back_to_back_us(group, layout_call, iters)
        result["cached_dispatch_pipelined_us"] = timing.back_to_back_us(group, cached, iters)
        result["combine_pipelined_us"] = timing.back_to_back_us(group, combine, iters)
    if fp8:
        # The end event is recorded after the host has the counts and did its work after them,
        # so this row is the count exchange plus whatever of that host work outlasts the
        # receive kernel (docs/findings.md).
        result["fresh_minus_cached_dispatch_us"] = timing.extra_us(group, fresh, cached, iters)
    if fp8 or fp8_cached:
        x_fp8 = tritonep.utils.per_token_cast_to_fp8(x)
        result["cached_dispatch_fp8_us"] = timing.median_us(group, lambda: cached(x_fp8), iters)
    recv = torch.tensor([recv_x.numel() * 2], dtype=torch.float64, device=x.device)
    dist.all_reduce(recv, op=dist.ReduceOp.MIN, group=group)
    result["recv_bytes"] = float(recv)
    return result


def bare_all_to_all_us(group: dist.ProcessGroup, args: argparse.Namespace, x: torch.Tensor,
                       in_rank: torch.Tensor) -> float:
    """all_to_all_single of rows already grouped by destination (the transfer alone)."""
    counts = in_rank.sum(0).tolist()
    send = x[in_rank.t().nonzero()[:, 1]]
    all_counts = torch.empty(len(counts), dtype=torch.int64, device=x.device)
    dist.all_to_all_single(all_counts, torch.tensor(counts, dtype=torch.int64, device=x.device), group=group)
    recv = torch.empty(int(all_counts.sum()), x.shape[1], dtype=x.dtype, device=x.device)
    return timing.median_us(
        group, lambda: dist.all_to_all_single(recv, send, all_counts.tolist(), counts, group=group), args.iters)


def combine_rounds(rounds: list[dict]) -> dict:
    """One report from several rounds of ``measure_buffer``: each figure the median over the
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


def shape_sweep(group: dist.ProcessGroup, buffer: tritonep.Buffer, args: argparse.Namespace,
                x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> list[dict]:
    """Kernel shapes around the defaults, one field changed at a time, at ``--num-sms``: each
    variant once per round, ``--rounds`` rounds (so that a drift of the machine reaches every
    variant alike), the medians and spread over the rounds (``combine_rounds``)."""
    # copy_engine_dispatch: the cached dispatch's rows received on the copy engines, every
    # program sending (dispatch_copy_engine.py), on and off whatever the default, through the
    # driver or torch (copy_driver), with 32 and 16 warps; sender_fraction 1/3: the SM receive's
    # best split at EP4; combine_pieces: how the copy-engine combine cuts each peer's block;
    # combine_copy_streams: the peers' pieces on a side stream each; tokens and combine_block:
    # the combine's reduction tile.
    variants = [dict(), dict(copy_engine_dispatch=True), dict(copy_engine_dispatch=False),
                dict(copy_engine_dispatch=True, copy_driver=False), dict(copy_engine_dispatch=True, warps=16),
                dict(warps=16), dict(sender_fraction=1 / 3), dict(combine_pieces=3), dict(combine_copy_streams=3),
                dict(combine_copy_streams=3, combine_pieces=4), dict(tokens=16, combine_block=2048),
                dict(tokens=32, combine_block=1024)]
    fields: dict[int, dict] = {}

    def measure(index: int, change: dict) -> dict:
        with changed_tuning(buffer, **change) as fields[index]:
            return measure_buffer(group, buffer, args, x, topk_idx, topk_weights, args.num_sms, fp8=False,
                                  fp8_cached=True)

    measured = _rounds({index: functools.partial(measure, index, change) for index, change in enumerate(variants)},
                       args.rounds)
    return [{"change": change or "defaults", **fields[index], **measured[index]}
            for index, change in enumerate(variants)]


def _rounds(paths: dict[Any, Callable[[], dict]], count: int) -> dict:
    """Each path's figures over ``count`` rounds, the paths measured in turn within a round."""
    measured: dict[str, list[dict]] = {name: [] for name in paths}
    for _ in range(count):
        for name, measure in paths.items():
            measured[name].append(measure())
    report = {}
    for name, rounds in measured.items():
        failed = [m for m in rounds if "error" in m]
        report[name] = failed[0] if failed else combine_rounds(rounds)
    return report


def host_profiles(group: dist.ProcessGroup, buffer: object, args: argparse.Namespace, x: torch.Tensor,
                  topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> dict:
    """``--host-profile``: each call of the host rows under cProfile, one at a time with the GPU
    idle before it (``host_profile.own_us_per_call``), as {call: {"us": the sum of own times,
    "largest": the functions with the most}}; the cached dispatch also with the other receive
    (SM receivers, or the copy engines where the default leaves them off), so that the two
    paths' host work can be told apart."""
    calls, recv_x = buffer_calls(group, buffer, args, x, topk_idx, topk_weights, args.num_sms)
    rows = {"layout": calls["layout"], "cached_dispatch": calls["cached"], "combine": calls["combine"]}
    profiles = {name: host_profile.own_us_per_call(group, fn, args.iters) for name, fn in rows.items()}
    # A handle's first calls (training's: new routing every step), which no replay serves.
    profiles["cached_dispatch_new_handle"] = host_profile.own_us_per_first_use(
        group, lambda: calls["fresh"]()[4], calls["cached_with"], min(args.iters, 16))
    profiles["combine_new_handle"] = host_profile.own_us_per_first_use(
        group, calls["fresh"], calls["combine_with"], min(args.iters, 16))
    profiles["combine_new_inputs"] = host_profile.own_us_per_call(group, on_new_rows(calls["combine"], recv_x),
                                                                  args.iters)
    tuning = getattr(buffer.backend, "tuning", None)   # (the CPU backend has no kernels to tune)
    if tuning is not None and group.size() > 1:
        other = 0 if copy_engine_receives(tuning.copy_engine_dispatch, group.size()) else 2   # (2: from 2 ranks)
        with changed_tuning(buffer, copy_engine_dispatch=other):
            calls, _ = buffer_calls(group, buffer, args, x, topk_idx, topk_weights, args.num_sms)
            profiles[f"cached_dispatch, copy_engine_dispatch={other}"] = host_profile.own_us_per_call(
                group, calls["cached"], args.iters)
    return {name: {"us": sum(own.values()), "largest": host_profile.largest(own)} for name, own in profiles.items()}


def run_rank(group: dist.ProcessGroup, args: argparse.Namespace) -> dict:
    """The normal-mode report (rank 0's copy is printed and saved)."""
    rank, num_ranks = group.rank(), group.size()
    gpu = timing.on_gpu(group)
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    x, topk_idx, topk_weights = inputs.routing(args.tokens, args.hidden, args.experts, args.topk, rank, device)
    nvl_bytes = inputs.nvl_bytes(args.tokens, args.hidden, num_ranks)
    report: dict = {"ranks": num_ranks, "tokens": args.tokens, "hidden": args.hidden, "experts": args.experts,
                    "topk": args.topk, "num_sms": args.num_sms,
                    "device": torch.cuda.get_device_name() if gpu else "cpu",
                    "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    collective = make_buffer(group, "collective")
    report["all_to_all_path"] = measure_buffer(group, collective, args, x, topk_idx, topk_weights, args.num_sms,
                                               fp8=False)
    in_rank = collective.get_dispatch_layout(topk_idx, args.experts)[3]
    report["bare_all_to_all_us"] = bare_all_to_all_us(group, args, x, in_rank)
    ours = make_buffer(group, "nvlink", num_nvl_bytes=nvl_bytes) if gpu else None
    deepep = deepep_buffer(group, gpu, num_nvl_bytes=nvl_bytes) if args.vs_deepep else None
    paths: dict[str, Callable[[], dict]] = {}
    if ours is not None:
        paths["tritonep"] = lambda: measure_buffer(group, ours, args, x, topk_idx, topk_weights, args.num_sms)
    if isinstance(deepep, tuple):
        module, theirs = deepep
        paths["deepep"] = lambda: guarded(lambda: measure_buffer(group, theirs, args, x, topk_idx, topk_weights,
                                                                 args.num_sms, module=module))
    # Rounds, tritonep and DeepEP in turn: the rounds' spread shows whether the run is a result.
    report.update(_rounds(paths, args.rounds if gpu else 1))
    if isinstance(deepep, dict):
        report["deepep"] = deepep
    if ours is not None:
        with changed_tuning(ours, copy_engine_combine=False):
            report["tritonep"]["combine_sm_only_us"] = measure_buffer(
                group, ours, args, x, topk_idx, topk_weights, args.num_sms, fp8=False, only_combine=True)["combine_us"]
        remote_rows = int(in_rank.sum()) - int(in_rank[:, rank].sum())
        report["remote_bytes"] = remote_rows * args.hidden * 2
        report["link_ceiling"] = ceiling.measure(group, report["remote_bytes"], args.iters)
        if args.sweep or args.curve:
            report["num_sms_curve"] = {
                n: measure_buffer(group, ours, args, x, topk_idx, topk_weights, n, fp8=False) for n in SWEEP_SMS}
        if args.sweep:
            report["shape_sweep"] = shape_sweep(group, ours, args, x, topk_idx, topk_weights)
    if args.host_profile:
        report["host_profile"] = host_profiles(group, ours if ours is not None else collective, args, x, topk_idx,
                                               topk_weights)
    if isinstance(deepep, tuple):
        module, theirs = deepep
        if (args.sweep or args.curve) and "error" not in report["deepep"]:
            report["deepep"]["num_sms_curve"] = {n: guarded(lambda n=n: measure_buffer(
                group, theirs, args, x, topk_idx, topk_weights, n, fp8=False, module=module)) for n in SWEEP_SMS}
        try:
            theirs.destroy()
        except Exception as error:  # noqa: BLE001 - e.g. its runtime refusing this rank count
            report["deepep"].setdefault("error", f"destroy: {type(error).__name__}: {error}")
        module.Buffer.set_num_sms(args.num_sms)
    tritonep.Buffer.set_num_sms(args.num_sms)
    return report
