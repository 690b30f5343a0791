"""The checks of DeepEP V1's calls: each turns a call's arguments into a backend request, or raises.

Every check runs before any communication, on the rank that made the call, so a bad call raises
there instead of leaving its peers waiting. Messages say what was expected and what was given
(``core/checks.py`` holds the shared pieces). Low-latency calls repeat one shape at decode time,
so the Buffer runs their full checks once per option set and then only ``fits`` per call.
"""

from __future__ import annotations

import torch

from tritonep.backends.base import (
    CombineRequest,
    DispatchRequest,
    LowLatencyCombineRequest,
    LowLatencyDispatchRequest,
)
from tritonep.core import checks
from tritonep.core.checks import require
from tritonep.core.config import Config
from tritonep.core.handles import DispatchHandle, LowLatencyHandle


def check_handle(handle: object, kind: type, buffer_id: int) -> None:
    """``kind``: DispatchHandle for dispatch/combine, LowLatencyHandle for the low-latency calls."""
    source = "low_latency_dispatch" if kind is LowLatencyHandle else "dispatch"
    require(isinstance(handle, kind), f"handle must come from this Buffer's {source}, got {type(handle).__name__}")
    require(handle.buffer_id == buffer_id,  # type: ignore[union-attr]
            "this handle was made by another Buffer; pass it only to the Buffer that dispatched")


def check_tokens_per_node(num_tokens_per_rdma_rank: torch.Tensor | None, cached: bool, num_ranks: int,
                          num_nodes: int, ranks_per_node: int, device: torch.device) -> None:
    """dispatch's ``num_tokens_per_rdma_rank``: int32 [num_nodes] for a fresh dispatch over
    several nodes, else None. Checked even where a backend does not need the counts, so that
    code written for DeepEP's internode path runs unchanged on every backend."""
    if num_nodes == 1:
        require(num_tokens_per_rdma_rank is None,
                f"num_tokens_per_rdma_rank must be None: all {num_ranks} ranks of this Buffer are in one node")
    elif cached:
        require(num_tokens_per_rdma_rank is None,
                "num_tokens_per_rdma_rank must be None in cached dispatch (handle given): the handle holds the layout")
    else:
        require(num_tokens_per_rdma_rank is not None,
                f"dispatch without a handle needs num_tokens_per_rdma_rank (from get_dispatch_layout): this "
                f"Buffer's {num_ranks} ranks span {num_nodes} nodes of {ranks_per_node}")
        checks.check_tensor("num_tokens_per_rdma_rank", num_tokens_per_rdma_rank, dtype=torch.int32,
                            shape=(num_nodes,), device=device)


def dispatch_request(x: object, handle: object, num_tokens_per_rank: object, is_token_in_rank: object,
                     num_tokens_per_expert: object, topk_idx: object, topk_weights: object, expert_alignment: object,
                     num_worst_tokens: object, config: Config, num_ranks: int, buffer_id: int,
                     device: torch.device) -> DispatchRequest:
    """A fresh dispatch (layout arguments given) or a cached one (``handle`` given), checked."""
    data, scales = checks.split_x(x, device)
    num_tokens = data.shape[0]
    require(isinstance(num_worst_tokens, int) and num_worst_tokens >= 0,
            f"num_worst_tokens must be an int >= 0, got {num_worst_tokens!r}")
    require(isinstance(expert_alignment, int) and expert_alignment >= 1,
            f"expert_alignment must be an int >= 1, got {expert_alignment!r}")
    if handle is not None:
        check_handle(handle, DispatchHandle, buffer_id)
        require(topk_idx is None and topk_weights is None and num_tokens_per_rank is None
                and is_token_in_rank is None and num_tokens_per_expert is None,
                "cached dispatch (handle given) takes no layout, topk_idx or topk_weights")
        require(num_tokens == handle.is_token_in_rank.shape[0],  # type: ignore[union-attr]
                f"cached dispatch: x has {num_tokens} tokens but the handle was made for "
                f"{handle.is_token_in_rank.shape[0]}")  # type: ignore[union-attr]
        return DispatchRequest(
            x=data, x_scales=scales, topk_idx=None, topk_weights=None,
            is_token_in_rank=handle.is_token_in_rank, num_tokens_per_rank=None,  # type: ignore[union-attr]
            num_tokens_per_expert=None, num_experts=0, expert_alignment=expert_alignment,
            num_worst_tokens=num_worst_tokens, cached_handle=handle, config=config)  # type: ignore[arg-type]
    require(num_tokens_per_rank is not None and is_token_in_rank is not None,
            "dispatch without a handle needs num_tokens_per_rank and is_token_in_rank (from get_dispatch_layout)")
    require(num_tokens_per_expert is not None, "dispatch without a handle needs num_tokens_per_expert")
    checks.check_tensor("num_tokens_per_rank", num_tokens_per_rank, dtype=torch.int32, shape=(num_ranks,),
                        device=device)
    checks.check_tensor("is_token_in_rank", is_token_in_rank, dtype=torch.bool, shape=(num_tokens, num_ranks),
                        device=device)
    checks.check_tensor("num_tokens_per_expert", num_tokens_per_expert, dtype=torch.int32, shape=(None,),
                        device=device)
    num_experts = num_tokens_per_expert.shape[0]  # type: ignore[union-attr]
    checks.check_num_experts(num_experts, num_ranks)
    if topk_idx is not None:
        checks.check_tensor("topk_idx", topk_idx, dtype=torch.int64, shape=(num_tokens, None), device=device)
        checks.check_expert_ids("topk_idx", topk_idx, num_experts)  # type: ignore[arg-type]
        require(topk_weights is not None, "topk_idx was given without topk_weights")
        checks.check_tensor("topk_weights", topk_weights, dtype=torch.float32,
                            shape=tuple(topk_idx.shape), device=device)  # type: ignore[union-attr]
    else:
        require(topk_weights is None, "topk_weights was given without topk_idx")
    return DispatchRequest(
        x=data, x_scales=scales, topk_idx=topk_idx, topk_weights=topk_weights,  # type: ignore[arg-type]
        is_token_in_rank=is_token_in_rank, num_tokens_per_rank=num_tokens_per_rank,  # type: ignore[arg-type]
        num_tokens_per_expert=num_tokens_per_expert, num_experts=num_experts,  # type: ignore[arg-type]
        expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens, cached_handle=None, config=config)


def combine_request(x: object, handle: object, topk_weights: object, bias: object, config: Config, buffer_id: int,
                    device: torch.device) -> CombineRequest:
    check_handle(handle, DispatchHandle, buffer_id)
    rows = handle.num_recv_rows  # type: ignore[union-attr]
    checks.check_tensor("x", x, dtype=torch.bfloat16, shape=(rows, None), device=device)
    if topk_weights is not None:
        checks.check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=(rows, None), device=device)
    num_tokens = handle.is_token_in_rank.shape[0]  # type: ignore[union-attr]
    biases = bias if isinstance(bias, tuple) else (bias, None)
    require(len(biases) == 2, f"bias must be a tensor or a 2-tuple, got {len(biases)} elements")
    for index, item in enumerate(biases):
        if item is not None:
            checks.check_tensor(f"bias[{index}]", item, dtype=torch.bfloat16,
                                shape=(num_tokens, x.shape[1]), device=device)  # type: ignore[union-attr]
    return CombineRequest(x, handle, topk_weights, biases, config)  # type: ignore[arg-type]


def check_low_latency_dispatch(request: LowLatencyDispatchRequest, low_latency_mode: bool, async_finish: bool,
                               num_ranks: int, device: torch.device) -> None:
    """Every check of low_latency_dispatch but the expert ids' values and the buffer size."""
    require(low_latency_mode, "low_latency_dispatch needs a Buffer made with low_latency_mode=True")
    x, topk_idx, T, num_experts = request.x, request.topk_idx, request.num_max_dispatch_tokens_per_rank, \
        request.num_experts
    checks.check_num_experts(num_experts, num_ranks)
    require(isinstance(T, int) and T > 0, f"num_max_dispatch_tokens_per_rank must be a positive int, got {T!r}")
    checks.check_tensor("x", x, dtype=torch.bfloat16, shape=(None, None), device=device)
    num_tokens, hidden = x.shape
    require(num_tokens <= T, f"x has {num_tokens} tokens, more than num_max_dispatch_tokens_per_rank={T}")
    checks.check_tensor("topk_idx", topk_idx, dtype=torch.int64, shape=(num_tokens, None), device=device)
    require(topk_idx.shape[1] <= 11, f"low-latency mode supports top-k <= 11, got {topk_idx.shape[1]}")
    if request.use_fp8:
        require(hidden % 128 == 0, f"fp8 low-latency dispatch needs hidden to be a multiple of 128, got {hidden}")
    require(not request.use_ue8m0 or (request.use_fp8 and request.round_scale),
            "use_ue8m0 needs use_fp8=True and round_scale=True")
    if request.use_ue8m0:
        require(hidden % 512 == 0,
                f"use_ue8m0 packs 4 scales per int32: hidden must be a multiple of 512, got {hidden}")
    require(not (async_finish and request.return_recv_hook), "async_finish and return_recv_hook cannot both be set")
    if request.cumulative_local_expert_recv_stats is not None:
        checks.check_tensor("cumulative_local_expert_recv_stats", request.cumulative_local_expert_recv_stats,
                            dtype=torch.int32, shape=(num_experts // num_ranks,), device=device)
    if request.dispatch_wait_recv_cost_stats is not None:
        checks.check_tensor("dispatch_wait_recv_cost_stats", request.dispatch_wait_recv_cost_stats,
                            dtype=torch.int64, shape=(num_ranks,), device=device)


def low_latency_combine_fits(request: LowLatencyCombineRequest, async_finish: bool, buffer_id: int, num_ranks: int,
                             on_gpu: bool) -> bool:
    """A known handle and tensors that fit it: the per-call fast path of the combine's checks."""
    handle, topk_idx, out, wait_stats = request.handle, request.topk_idx, request.out, request.wait_stats
    if not (type(handle) is LowLatencyHandle and handle.buffer_id == buffer_id  # noqa: E721
            and not (async_finish and request.return_recv_hook) and isinstance(topk_idx, torch.Tensor)
            and topk_idx.dim() == 2):
        return False
    T, hidden, num_experts = handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts
    return (topk_idx.shape[0] <= T
            and checks.fits(request.x, torch.bfloat16, (num_experts // num_ranks, num_ranks * T, hidden), on_gpu)
            and checks.fits(topk_idx, torch.int64, topk_idx.shape, on_gpu)
            and checks.fits(request.topk_weights, torch.float32, topk_idx.shape, on_gpu)
            and (out is None or checks.fits(out, torch.bfloat16, (topk_idx.shape[0], hidden), on_gpu))
            and (wait_stats is None or checks.fits(wait_stats, torch.int64, (num_ranks,), on_gpu)))


def check_low_latency_combine(request: LowLatencyCombineRequest, low_latency_mode: bool, async_finish: bool,
                              num_ranks: int, buffer_id: int, device: torch.device) -> None:
    """Every check of low_latency_combine but the expert ids' values."""
    require(low_latency_mode, "low_latency_combine needs a Buffer made with low_latency_mode=True")
    handle = request.handle
    require(isinstance(handle, LowLatencyHandle),
            f"handle must come from low_latency_dispatch, got {type(handle).__name__}")
    check_handle(handle, LowLatencyHandle, buffer_id)
    require(not (async_finish and request.return_recv_hook), "async_finish and return_recv_hook cannot both be set")
    T, hidden = handle.num_max_dispatch_tokens_per_rank, handle.hidden
    checks.check_tensor("x", request.x, dtype=torch.bfloat16,
                        shape=(handle.num_experts // num_ranks, num_ranks * T, hidden), device=device)
    topk_idx = request.topk_idx
    checks.check_tensor("topk_idx", topk_idx, dtype=torch.int64, shape=(None, None), device=device)
    checks.check_tensor("topk_weights", request.topk_weights, dtype=torch.float32, shape=tuple(topk_idx.shape),
                        device=device)
    require(topk_idx.shape[0] <= T, f"topk_idx has {topk_idx.shape[0]} tokens, more than T={T}")
    if request.out is not None:
        checks.check_tensor("out", request.out, dtype=torch.bfloat16, shape=(topk_idx.shape[0], hidden),
                            device=device)
    if request.wait_stats is not None:
        checks.check_tensor("combine_wait_recv_cost_stats", request.wait_stats, dtype=torch.int64,
                            shape=(num_ranks,), device=device)
