"""Normal-mode dispatch and combine with plain ``torch.distributed`` collectives.

This is what a user would write with ``all_to_all_single``: gather the counts, send each token
once per destination rank (rows grouped by destination, token order inside), and send them
back for the combine. It is the CPU backend and the benchmark's NCCL baseline, so every tensor
stays on the input's device; only the small count tables visit the host (for split sizes).

Collectives per fresh dispatch: one all_gather of a fixed-size header (counts plus the call's
shape, so mismatched calls fail cleanly on every rank instead of corrupting or hanging), one
all_gather of the per-expert counts (skipped when every rank pads with num_worst_tokens), and
one all_to_all_single each for the rows and for the packed per-row metadata. A cached dispatch
and a combine exchange no counts (the handle has them) but still gather a tiny fixed-size
header, for the same reason, before their all_to_all_single calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from tritonep.backends.base import DispatchRequest, DispatchResult
from tritonep.backends.collective import packing
from tritonep.core import routing
from tritonep.core.checks import InputError
from tritonep.core.handles import DispatchHandle, NodeDispatchHandle

_HEADER_NAMES = ["hidden", "top-k", "num_experts", "x dtype (bf16/fp8)", "scales dtype (none/float32/int32)",
                 "number of scale columns", "num_max_tokens_per_rank"]
_CACHED_HEADER_NAMES = ["hidden", "x dtype (bf16/fp8)", "scales dtype (none/float32/int32)", "number of scale columns"]
_COMBINE_HEADER_NAMES = ["hidden", "topk_weights (given or not)", "topk_weights columns"]


@dataclass
class NormalLayout:
    """What a dispatch leaves in the handle for the combine and the cached dispatch."""

    send_token_index: torch.Tensor  # [S] int64: token of each sent row, in send order
    send_splits: list[int]          # rows sent to each rank
    recv_splits: list[int]          # rows received from each rank
    num_real_rows: int              # received rows (<= handle.num_recv_rows when padded)


def get_dispatch_layout(topk_idx: torch.Tensor, num_experts: int,
                        num_ranks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-rank and per-expert counts and the token-to-rank mask (local, no communication)."""
    return routing.dispatch_layout(topk_idx, num_experts, num_ranks)


def _gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[index]`` for any dtype (index_select has no float8 kernels on every device)."""
    return packing.compact(x).view(torch.uint8).index_select(0, index).view(x.dtype)


def _scale_code(scales: torch.Tensor | None) -> tuple[int, int]:
    if scales is None:
        return 0, 0
    return (1 if scales.dtype == torch.float32 else 2), scales.shape[1]


def dispatch(group: dist.ProcessGroup, buffer_id: int, request: DispatchRequest,
             ranks_per_node: int | None = None) -> DispatchResult:
    """Fresh or cached dispatch (see the module doc and SPEC "dispatch"). ``ranks_per_node``:
    on a group that spans nodes, the handle is placed like DeepEP's internode one."""
    if request.cached_handle is not None:
        return _cached_dispatch(group, request)
    rank, num_ranks = group.rank(), group.size()
    x, scales, topk_idx = request.x, request.x_scales, request.topk_idx
    num_tokens, hidden = x.shape
    device = x.device
    num_experts = request.num_experts
    experts_per_rank = num_experts // num_ranks
    num_topk = topk_idx.shape[1] if topk_idx is not None else 0
    scale_code, scale_cols = _scale_code(scales)
    in_rank = request.is_token_in_rank
    # What is sent is decided by is_token_in_rank itself; counting it here keeps the splits
    # consistent with the rows even if num_tokens_per_rank was computed differently.
    send_counts = in_rank.sum(0).to(torch.int64)
    header = torch.tensor([hidden, num_topk, num_experts, int(x.dtype != torch.bfloat16), scale_code, scale_cols,
                           request.num_max_tokens_per_rank, request.num_worst_tokens], dtype=torch.int64, device=device)
    table = packing.all_gather_rows(group, torch.cat([send_counts, header]))
    count_matrix, metas = table[:, :num_ranks], table[:, num_ranks:]
    packing.check_same_on_all_ranks(metas[:, :len(_HEADER_NAMES)], _HEADER_NAMES, "dispatch")
    recv_totals = count_matrix.sum(0).tolist()
    worst = metas[:, len(_HEADER_NAMES)].tolist()
    for target in range(num_ranks):
        if 0 < worst[target] < recv_totals[target]:
            raise InputError(f"dispatch: rank {target} receives {recv_totals[target]} tokens but passed "
                             f"num_worst_tokens={worst[target]}; num_worst_tokens must be an upper bound")
    send_splits = count_matrix[rank].tolist()
    recv_splits = count_matrix[:, rank].tolist()
    num_real = recv_totals[rank]
    num_rows = request.num_worst_tokens if request.num_worst_tokens > 0 else num_real

    token_index, _ = routing.send_order(in_rank)
    # Metadata rows: global top-k ids, weights, scales, source token index, as one byte payload.
    parts, specs = [token_index.view(-1, 1)], [(torch.int64, 1)]
    if topk_idx is not None:
        parts += [topk_idx.index_select(0, token_index), request.topk_weights.index_select(0, token_index)]
        specs += [(torch.int64, num_topk), (torch.float32, num_topk)]
    if scales is not None:
        parts.append(scales.index_select(0, token_index))
        specs.append((scales.dtype, scale_cols))
    recv_x = torch.empty(num_rows, hidden, dtype=x.dtype, device=device)
    _, x_work = packing.all_to_all_rows(group, _gather_rows(x, token_index), send_splits, recv_splits,
                                out=recv_x[:num_real], async_op=True)
    meta, meta_work = packing.all_to_all_rows(group, packing.pack_rows(parts), send_splits, recv_splits, async_op=True)

    expert_list = None
    if any(w == 0 for w in worst):  # every rank agrees on whether this gather happens
        per_expert = packing.all_gather_rows(group, request.num_tokens_per_expert)
        if request.num_worst_tokens == 0:
            local = per_expert[:, rank * experts_per_rank:(rank + 1) * experts_per_rank].sum(0).tolist()
            expert_list = routing.round_up_counts(local, request.expert_alignment)
    if request.num_worst_tokens > 0:
        expert_list = []
    x_work.wait()
    meta_work.wait()
    if num_rows > num_real:
        recv_x[num_real:].view(torch.uint8).zero_()

    unpacked = packing.unpack_rows(meta, specs)
    recv_src_idx = torch.full((num_rows,), -1, dtype=torch.int32, device=device)
    recv_src_idx[:num_real] = unpacked[0].view(-1).to(torch.int32)
    recv_topk_idx = recv_topk_weights = recv_scales = None
    if topk_idx is not None:
        local_ids = routing.to_local_expert_ids(unpacked[1], rank, experts_per_rank)
        recv_topk_idx = torch.full((num_rows, num_topk), -1, dtype=torch.int64, device=device)
        recv_topk_idx[:num_real] = local_ids
        recv_topk_weights = torch.zeros(num_rows, num_topk, dtype=torch.float32, device=device)
        recv_topk_weights[:num_real] = torch.where(local_ids >= 0, unpacked[2], 0.0)
    if scales is not None:
        recv_scales = torch.zeros(num_rows, scale_cols, dtype=scales.dtype, device=device)
        recv_scales[:num_real] = unpacked[-1]

    layout = NormalLayout(token_index, send_splits, recv_splits, num_real)
    prefix = routing.rank_prefix_matrix(count_matrix).to(device)
    if ranks_per_node is None:
        handle = DispatchHandle(prefix, in_rank, recv_src_idx, num_rows, hidden, buffer_id, layout)
    else:
        handle = NodeDispatchHandle(prefix, in_rank, recv_src_idx, num_rows, hidden, buffer_id, layout, rank=rank,
                                    ranks_per_node=ranks_per_node)
    return DispatchResult(recv_x, recv_scales, recv_topk_idx, recv_topk_weights, expert_list, handle)


def _cached_dispatch(group: dist.ProcessGroup, request: DispatchRequest) -> DispatchResult:
    """Reuse an earlier dispatch's layout: no count exchange, only x (and scales) travel."""
    handle = request.cached_handle
    assert handle is not None
    layout: NormalLayout = handle.backend_state
    x, scales = request.x, request.x_scales
    hidden = x.shape[1]
    scale_code, scale_cols = _scale_code(scales)
    # The layout needs no exchange, but ranks that disagree on the row size would corrupt or
    # crash the all_to_all: one tiny fixed-size gather lets all of them raise instead.
    header = torch.tensor([hidden, int(x.dtype != torch.bfloat16), scale_code, scale_cols], dtype=torch.int64,
                          device=x.device)
    packing.check_same_on_all_ranks(packing.all_gather_rows(group, header), _CACHED_HEADER_NAMES, "cached dispatch")
    num_rows, num_real = handle.num_recv_rows, layout.num_real_rows
    index = layout.send_token_index
    recv_x = torch.zeros(num_rows, hidden, dtype=x.dtype, device=x.device) if num_rows > num_real else \
        torch.empty(num_rows, hidden, dtype=x.dtype, device=x.device)
    _, work = packing.all_to_all_rows(group, _gather_rows(x, index), layout.send_splits, layout.recv_splits,
                              out=recv_x[:num_real], async_op=True)
    recv_scales = None
    if scales is not None:
        recv_scales = torch.zeros(num_rows, scales.shape[1], dtype=scales.dtype, device=x.device)
        packing.all_to_all_rows(group, scales.index_select(0, index), layout.send_splits, layout.recv_splits,
                        out=recv_scales[:num_real])
    work.wait()
    return DispatchResult(recv_x, recv_scales, None, None, None, handle)


# float32 bytes the CPU combine converts at a time: a few MiB stay in cache and in memory the
# allocator already holds, where converting every row at once first faults in a fresh float32
# copy twice the size of the rows received.
_CPU_CHUNK_BYTES = 4 << 20


def _add_rows(out: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    """``out.index_add_(0, index, rows.float())``; on the CPU in chunks of rows, in order:
    index_add_ adds rows in index order, so every sum is made in the same order, to the same
    bits. Other devices take every row in one call (one launch)."""
    if rows.device.type != "cpu":
        out.index_add_(0, index, rows.float())
        return
    num_rows, width = rows.shape
    chunk_rows = max(1, _CPU_CHUNK_BYTES // max(1, 4 * width))
    scratch = torch.empty(min(chunk_rows, num_rows), width, dtype=torch.float32, device=rows.device)
    for start in range(0, num_rows, chunk_rows):
        end = min(start + chunk_rows, num_rows)
        chunk = scratch[:end - start]
        chunk.copy_(rows[start:end])
        out.index_add_(0, index[start:end], chunk)


def combine(group: dist.ProcessGroup, x: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor | None,
            bias: tuple[torch.Tensor | None, torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Send every received row back to its source and sum the copies per token in float32.

    The rows come back in the source's send order, so ``send_token_index`` says which token each
    belongs to; ``index_add_`` then sums the copies (unweighted, as in DeepEP).
    """
    layout: NormalLayout = handle.backend_state
    num_tokens = handle.is_token_in_rank.shape[0]
    num_real = layout.num_real_rows
    num_topk = topk_weights.shape[1] if topk_weights is not None else 0
    header = torch.tensor([x.shape[1], int(topk_weights is not None), num_topk], dtype=torch.int64, device=x.device)
    packing.check_same_on_all_ranks(packing.all_gather_rows(group, header), _COMBINE_HEADER_NAMES, "combine")
    back_x, x_work = packing.all_to_all_rows(group, x[:num_real], layout.recv_splits, layout.send_splits, async_op=True)
    back_w = None
    if topk_weights is not None:
        back_w, _ = packing.all_to_all_rows(group, topk_weights[:num_real], layout.recv_splits, layout.send_splits)
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    for item in bias:
        if item is not None:
            out += item.float()
    x_work.wait()
    _add_rows(out, layout.send_token_index, back_x)
    combined_w = None
    if back_w is not None:
        combined_w = torch.zeros(num_tokens, topk_weights.shape[1], dtype=torch.float32, device=x.device)
        combined_w.index_add_(0, layout.send_token_index, back_w)
    return out.to(torch.bfloat16), combined_w
