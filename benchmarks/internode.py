"""Internode rows (``--gpus-per-node N``): the normal-mode calls on the group split into nodes of
N ranks, beside the one-node rows of the same run, with the bytes each call moves per rank and
the time those bytes would take at a NIC's rate.

On GPUs the split group gets tritonep's internode backend (``TRITONEP_GPUS_PER_NODE=N``, a heap
of ``num_rdma_bytes``); on CPU ranks the collective backend, which serves split groups with the
one-node results, so the mode runs everywhere. Simulated nodes share one host: their traffic
crosses through the transport layer (NVSHMEM over NVLink, or plain stores), so the measured
time is the protocol's on this machine, and the projection says what the network bytes alone
would cost on a real cluster.

Bytes per rank come from the routing, as the internode backend moves rows: each token crosses
to a node at most once, to the rank with the same local index there (network rows: one per
token and *other* node), and is forwarded inside that node to every rank that takes it but the
one it landed at (NVLink rows). The combine runs the same paths backwards, with rows reduced
inside a node before they cross; its partial sums cross in float32. Each figure is the largest
over the ranks.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import tritonep

from . import inputs, timing
from .internals import internode_rdma_bytes
from .normal import make_buffer, measure_buffer


def row_bytes(hidden: int) -> dict[str, tuple[float, float]]:
    """Bytes of one row per call kind: (over the network, over NVLink). fp8: e4m3 and one
    float32 scale per 128 channels; the combine crosses nodes as float32 partial sums and reads
    bf16 rows inside a node."""
    fp8 = hidden + hidden // 128 * 4
    return {"dispatch": (2 * hidden, 2 * hidden), "cached_dispatch": (2 * hidden, 2 * hidden),
            "cached_dispatch_fp8": (fp8, fp8), "combine": (4 * hidden, 2 * hidden)}


def traffic_rows(in_rank: torch.Tensor, rank: int, ranks_per_node: int) -> tuple[int, int]:
    """(network rows, NVLink rows) of this rank's tokens: ``in_rank`` is [N, R] bool
    (``is_token_in_rank``). A token's row to node n lands at rank ``n * G + rank % G`` and is
    forwarded from there to the other ranks of n that take it."""
    num_tokens, num_ranks = in_rank.shape
    nodes = num_ranks // ranks_per_node
    by_node = in_rank.view(num_tokens, nodes, ranks_per_node)
    in_node = by_node.any(dim=2)
    my_node, local = rank // ranks_per_node, rank % ranks_per_node
    network = int(in_node.sum()) - int(in_node[:, my_node].sum())
    forwarded = int(by_node.sum()) - int(by_node[:, :, local].sum())
    return network, forwarded


def split_buffer(group: dist.ProcessGroup, args: argparse.Namespace, gpu: bool) -> tritonep.Buffer:
    """A Buffer on the group split into nodes of ``args.gpus_per_node`` ranks: on GPUs the
    internode backend, its heap sized for the normal-mode problem; on CPU ranks the collective
    backend."""
    env = {"TRITONEP_GPUS_PER_NODE": str(args.gpus_per_node)}
    if gpu:
        size = internode_rdma_bytes(args.tokens, args.hidden, args.topk, group.size(), args.gpus_per_node)
        return make_buffer(group, "nvlink", env, num_rdma_bytes=size, explicitly_destroy=True)
    return make_buffer(group, "collective", env, explicitly_destroy=True)


def run_rank(group: dist.ProcessGroup, args: argparse.Namespace) -> dict:
    """The internode report on the normal-mode rows' inputs (rank 0's copy is printed and
    saved): timings (``measure_buffer``), bytes per rank and projected times."""
    G, R, gpu = args.gpus_per_node, group.size(), timing.on_gpu(group)
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    x, topk_idx, topk_weights = inputs.routing(args.tokens, args.hidden, args.experts, args.topk, group.rank(), device)
    buffer = split_buffer(group, args, gpu)
    backend = type(buffer.backend).__name__
    heap = getattr(buffer.backend, "heap", None)
    measured = measure_buffer(group, buffer, args, x, topk_idx, topk_weights, args.num_sms, fp8=False,
                              fp8_cached=True)
    in_rank = buffer.get_dispatch_layout(topk_idx, args.experts)[3]
    buffer.destroy()
    rows = torch.tensor(traffic_rows(in_rank, group.rank(), G), dtype=torch.float64, device=x.device)
    dist.all_reduce(rows, op=dist.ReduceOp.MAX, group=group)
    network_rows, nvlink_rows = rows.tolist()
    calls = {}
    for call, (network_row, nvlink_row) in row_bytes(args.hidden).items():
        network = network_rows * network_row
        calls[call] = {"us": measured[f"{call}_us"], "network_bytes": network, "nvlink_bytes": nvlink_rows * nvlink_row,
                       "nic_us": network / (args.nic_gbps * 1e3)}
    calls["layout"] = {"us": measured["layout_us"], "network_bytes": 0.0, "nvlink_bytes": 0.0, "nic_us": 0.0}
    return {"gpus_per_node": G, "nodes": R // G, "backend": backend, "transport": heap.name if heap else None,
            "nic_gbps": args.nic_gbps, "network_rows": network_rows, "nvlink_rows": nvlink_rows, "calls": calls,
            "measured": measured}
