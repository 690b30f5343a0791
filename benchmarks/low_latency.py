"""Low-latency mode (decode): DeepEP's problem (128 tokens per rank, hidden 7168, top-8 of 288
experts, fp8 dispatch, bf16 combine) for tritonep's NVLink kernels, DeepEP V1 (``--vs-deepep``)
and the collective backend on NCCL (the all_to_all_single path), on the same inputs.

Per path, GPU time first (``timing`` says how each is taken):

* ``graph``: per-call time of calls replayed from one CUDA graph (not for the all_to_all_single
  path: NCCL calls do not capture here);
* ``profiled``: torch.profiler's device time per call, every kernel the call runs;
* ``pair``: dispatch and combine issued back to back, many pairs, total / pairs, as DeepEP's own
  harness times them;
* ``call``: one call on its own, its host path enqueued while the stream sleeps;
* ``send`` / ``recv``: the two halves of a call with ``return_recv_hook=True`` (recv: the hook);

then the host's CPU time per call, from an idle GPU and back to back, beside a torch ``add_``
timed the same way as a yardstick of the host's speed. "GB/s": the bytes every rank receives
(fp8 rows with their scales for dispatch, bf16 rows for combine, per (token, expert) pair) over
the time. With ``--sweep`` on GPUs, also the NVLink kernels' graph-replay times under other
launch shapes (``shape_sweep``).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

import tritonep

from . import inputs, timing
from .deepep import deepep_buffer, guarded
from .normal import make_buffer

CALLS = ("dispatch", "combine")

# Launch shapes of the low-latency kernels tried by ``--sweep``, one Tuning field changed at a
# time through its environment variable (each variant is a Buffer of its own, the variable set
# while it is made): programs per SM and warps per program of the dispatch and the combine, and
# the rows each step moves.
SWEEP_VARIANTS = ({}, {"TRITONEP_LL_PROGRAMS_PER_SM": "1"}, {"TRITONEP_LL_PROGRAMS_PER_SM": "4"},
                  {"TRITONEP_LL_WARPS": "4"}, {"TRITONEP_LL_WARPS": "16"}, {"TRITONEP_LL_RECV_ROWS": "2"},
                  {"TRITONEP_LL_RECV_ROWS": "8"}, {"TRITONEP_LL_ROWS": "8"},
                  {"TRITONEP_LL_COMBINE_PROGRAMS_PER_SM": "2"}, {"TRITONEP_LL_COMBINE_WARPS": "8"})


class WarmCalls(NamedTuple):
    """A Buffer's timed calls (``CALLS`` by name, and the pair), and what the combines take."""

    dispatch: Callable[[], object]
    combine: Callable[[], object]
    pair: Callable[[], object]
    handle: object             # the first dispatch's, which ``combine`` combines
    expert_out: torch.Tensor   # the experts' stand-in output that the combines send back


def _warm_calls(buffer: object, args: argparse.Namespace, x: torch.Tensor, topk_idx: torch.Tensor,
                weights: torch.Tensor, group: dist.ProcessGroup) -> WarmCalls:
    """The timed calls on ``buffer``, each made three times, so that they are compiled and on
    their repeat paths before any capture or timing."""
    T, E = args.ll_tokens, args.ll_experts
    packed, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=True)
    expert_out = inputs.expert_output(packed[0].shape, group.rank(), x.device)

    def pair() -> object:
        pair_handle = buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=True)[2]
        return buffer.low_latency_combine(expert_out, topk_idx, weights, pair_handle)

    warm = WarmCalls(lambda: buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=True),
                     lambda: buffer.low_latency_combine(expert_out, topk_idx, weights, handle), pair, handle,
                     expert_out)
    for _ in range(3):
        for call in (warm.dispatch, warm.combine, warm.pair):
            call()
    return warm


def shape_sweep(group: dist.ProcessGroup, args: argparse.Namespace, x: torch.Tensor, topk_idx: torch.Tensor,
                weights: torch.Tensor, size: int) -> list[dict]:
    """Per ``SWEEP_VARIANTS`` entry, the NVLink dispatch's and combine's graph-replay time per
    call (a variant that fails reports its error and the others go on)."""
    results = []
    for env in SWEEP_VARIANTS:
        def graph_times(env: dict = env) -> dict:
            buffer = make_buffer(group, "nvlink", env, num_rdma_bytes=size, low_latency_mode=True,
                                 explicitly_destroy=True)
            try:
                warm = _warm_calls(buffer, args, x, topk_idx, weights, group)
                return {f"{name}_graph_us": timing.graph_us(group, getattr(warm, name), args.iters)
                        for name in CALLS}
            finally:
                buffer.destroy()
        results.append({"change": env or "defaults", **guarded(graph_times)})
    return results


def measure(group: dist.ProcessGroup, buffer: object, args: argparse.Namespace, x: torch.Tensor,
            topk_idx: torch.Tensor, weights: torch.Tensor, graphs: bool) -> dict:
    """``buffer``: a tritonep or DeepEP Buffer in low-latency mode (the same API)."""
    T, E, iters = args.ll_tokens, args.ll_experts, args.iters
    dispatch, combine, pair, handle, expert_out = _warm_calls(buffer, args, x, topk_idx, weights, group)
    pending: list = []

    def dispatch_send() -> None:
        pending.append(buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=True, return_recv_hook=True)[4])

    def combine_send() -> None:
        pending.append(buffer.low_latency_combine(expert_out, topk_idx, weights, handle, return_recv_hook=True)[2])

    def run_hook() -> None:
        pending.pop(0)()

    calls = {"dispatch": dispatch, "combine": combine}
    result: dict = {}
    if graphs:
        for name, call in calls.items():
            result[f"{name}_graph_us"] = timing.graph_us(group, call, iters)
    for name, call in calls.items():
        try:
            result[f"{name}_profiled_us"] = timing.profiled_gpu_us(group, call, iters)
        except Exception as error:  # noqa: BLE001 - a profiler problem must not cost the run
            result[f"{name}_profiled_error"] = f"{type(error).__name__}: {error}"
    result["pair_us"] = timing.back_to_back_us(group, pair, iters)
    for name, call in calls.items():
        result[f"{name}_us"] = timing.median_us(group, call, iters)
    for name, send in (("dispatch", dispatch_send), ("combine", combine_send)):
        sends, hooks = timing.call_times_us(group, [send, run_hook], iters)
        result[f"{name}_send_us"] = timing.slowest(group, statistics.median(sends))
        result[f"{name}_recv_us"] = timing.slowest(group, statistics.median(hooks))
    for name, call in calls.items():
        result[f"{name}_host_us"] = timing.idle_host_us(group, call, iters)
        result[f"{name}_host_back_to_back_us"] = timing.slowest(group, timing.back_to_back_host_us(call))
    return result


def run_rank(group: dist.ProcessGroup, args: argparse.Namespace, backends: list[str]) -> dict:
    """Each of ``backends`` ("nvlink", "collective", "internode": the group split into nodes of
    ``--gpus-per-node``), and DeepEP with ``--vs-deepep``, on the same inputs."""
    rank, num_ranks = group.rank(), group.size()
    gpu = timing.on_gpu(group)
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    T, E, K, H = args.ll_tokens, args.ll_experts, args.topk, args.hidden
    x, topk_idx, weights = inputs.decode_batch(T, H, E, K, rank, device)
    pairs = torch.tensor([topk_idx.numel()], dtype=torch.float64, device=device)
    dist.all_reduce(pairs, group=group)   # pairs sent by all ranks = pairs received by all ranks
    received_pairs = float(pairs) / num_ranks
    report = {"ranks": num_ranks, "tokens": T, "hidden": H, "experts": E, "topk": K,
              "dispatch_bytes": received_pairs * (H + H // 128 * 4), "combine_bytes": received_pairs * H * 2}
    yardstick = torch.zeros(16, dtype=torch.float32, device=device)
    report["torch_add_host_back_to_back_us"] = timing.slowest(
        group, timing.back_to_back_host_us(lambda: yardstick.add_(1)))
    size = tritonep.Buffer.get_low_latency_rdma_size_hint(T, H, num_ranks, E)
    for backend in backends:
        if backend == "internode":   # the group split into nodes: the internode backend, on CPUs the collective one
            env = {"TRITONEP_GPUS_PER_NODE": str(args.gpus_per_node), "TRITONEP_TRANSPORT": "stores"}
            buffer = make_buffer(group, "nvlink" if gpu else "collective", env, num_rdma_bytes=size,
                                 low_latency_mode=True, explicitly_destroy=True)
            report["internode_traffic"] = traffic(group, args, topk_idx)
        else:
            buffer = make_buffer(group, backend, num_rdma_bytes=size, low_latency_mode=True, explicitly_destroy=True)
        report[backend] = measure(group, buffer, args, x, topk_idx, weights,
                                  graphs=gpu and backend in ("nvlink", "internode"))
        buffer.destroy()
    if args.vs_deepep:
        report["deepep"] = _deepep(group, args, x, topk_idx, weights, gpu)
    if args.sweep and gpu and "nvlink" in backends:
        report["nvlink_shape_sweep"] = shape_sweep(group, args, x, topk_idx, weights, size)
    return report


def traffic(group: dist.ProcessGroup, args: argparse.Namespace, topk_idx: torch.Tensor) -> dict:
    """Rows per rank of a low-latency call on nodes of ``--gpus-per-node`` ranks: every (token,
    expert) pair is one row straight to the expert's rank, over the network when that rank is in
    another node, over NVLink when it is another rank of this one. The largest rank's counts, the
    bytes (fp8 rows with their scales out, bf16 rows back) and the network bytes' time at
    ``--nic-gbps``."""
    rank, num_ranks, G = group.rank(), group.size(), args.gpus_per_node
    owners = topk_idx[topk_idx >= 0] // (args.ll_experts // num_ranks)
    network = int((owners // G != rank // G).sum())
    nvlink = int(((owners // G == rank // G) & (owners != rank)).sum())
    rows = torch.tensor([network, nvlink], dtype=torch.float64, device=topk_idx.device)
    dist.all_reduce(rows, op=dist.ReduceOp.MAX, group=group)
    network, nvlink = rows.tolist()
    H = args.hidden
    row_bytes = {"dispatch": H + H // 128 * 4, "combine": 2 * H}
    return {"gpus_per_node": G, "nic_gbps": args.nic_gbps, "network_rows": network, "nvlink_rows": nvlink,
            **{f"{kind}_{path}_bytes": rows_ * size for kind, size in row_bytes.items()
               for path, rows_ in (("network", network), ("nvlink", nvlink))},
            **{f"{kind}_nic_us": network * size / (args.nic_gbps * 1e3) for kind, size in row_bytes.items()}}


def _deepep(group: dist.ProcessGroup, args: argparse.Namespace, x: torch.Tensor, topk_idx: torch.Tensor,
            weights: torch.Tensor, gpu: bool) -> dict:
    """DeepEP V1's low-latency calls on the same inputs, or why not."""
    deepep = deepep_buffer(group, gpu, low_latency_shape=(args.ll_tokens, args.hidden, group.size(), args.ll_experts))
    if isinstance(deepep, dict):
        return deepep
    buffer = deepep[1]

    def measure_then_destroy() -> dict:
        try:
            return measure(group, buffer, args, x, topk_idx, weights, graphs=True)
        finally:
            buffer.destroy()
    return guarded(measure_then_destroy)
