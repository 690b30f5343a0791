"""The fields of an EPHandle, worked out from an engine's dispatch in plain torch.

An engine returns what V1's dispatch returns: the received rows by source rank (source token
order inside), their local expert ids, ``rank_prefix_matrix`` and each row's source token. V2's
handle describes the same routing in its own terms (prefix sums per scale-up rank and per
expert, source metadata per row, destination rows per token). Device-agnostic and free of host
synchronisation, like :mod:`tritonep.v2.expand`.
"""

from __future__ import annotations

import torch

from tritonep.core.handles import DispatchHandle


def expert_counts(recv_topk_idx: torch.Tensor, num_local_experts: int) -> torch.Tensor:
    """int32 [E/R]: (row, k) pairs per local expert (the real, unaligned counts)."""
    keys = torch.where(recv_topk_idx >= 0, recv_topk_idx, num_local_experts).reshape(-1)
    counts = torch.zeros(num_local_experts + 1, dtype=torch.int64, device=recv_topk_idx.device)
    counts.scatter_add_(0, keys, torch.ones_like(keys))
    return counts[:num_local_experts].to(torch.int32)


def expert_prefix(counts: torch.Tensor, starts: torch.Tensor | None, alignment: int) -> torch.Tensor:
    """V2's ``psum_num_recv_tokens_per_expert`` (int32 [E/R]): with ``starts`` (expanded) each
    expert's aligned start plus its count, else the inclusive prefix sum of aligned counts."""
    if starts is not None:
        return (starts + counts).to(torch.int32)
    aligned = (counts.to(torch.int64) + alignment - 1) // alignment * alignment
    return torch.cumsum(aligned, 0).to(torch.int32)


def rows_from_rank(engine_handle: DispatchHandle, rank: int) -> torch.Tensor:
    """int32 [R]: inclusive prefix sum over source ranks of the rows this rank received."""
    return engine_handle.rank_prefix_matrix[:, rank].contiguous().to(torch.int32)


def scaleup_prefix(per_source: torch.Tensor, num_scaleup_ranks: int) -> torch.Tensor:
    """``psum_num_recv_tokens_per_scaleup_rank`` (int32 [num_scaleup_ranks]) from the inclusive
    per-source-rank prefix: sources grouped by scale-up index (rank % num_scaleup_ranks), the
    peers V2's hybrid kernels forward through; the identity with one scale-out rank."""
    num_ranks = per_source.shape[0]
    if num_scaleup_ranks == num_ranks:
        return per_source
    counts = torch.diff(per_source.to(torch.int64), prepend=per_source.new_zeros(1, dtype=torch.int64))
    per_scaleup = counts.view(num_ranks // num_scaleup_ranks, num_scaleup_ranks).sum(0)
    return torch.cumsum(per_scaleup, 0).to(torch.int32)


def source_metadata(engine_handle: DispatchHandle, per_source: torch.Tensor, recv_topk_idx: torch.Tensor,
                    slots: torch.Tensor | None, num_max_tokens_per_rank: int) -> torch.Tensor:
    """V2's ``recv_src_metadata`` (int32 [rows, K + 2]; see EPHandle)."""
    num_rows, num_topk = recv_topk_idx.shape
    device = recv_topk_idx.device
    src_token = engine_handle.recv_src_idx.to(torch.int64)
    real = src_token >= 0   # padding rows (no CPU sync) have source -1
    row = torch.arange(num_rows, dtype=torch.int64, device=device)
    src_rank = torch.searchsorted(per_source.to(torch.int64), row, right=True)
    local = recv_topk_idx >= 0
    # The first slot k of a local expert: argmax finds the first True (V2's "master" lane).
    first_k = local.to(torch.int32).argmax(dim=1) if num_topk else torch.zeros_like(row)
    metadata = torch.full((num_rows, num_topk + 2), -1, dtype=torch.int32, device=device)
    metadata[:, 0] = torch.where(real, src_rank * num_max_tokens_per_rank + src_token, -1).to(torch.int32)
    metadata[:, 1] = torch.where(real, src_rank * num_topk + first_k, -1).to(torch.int32)
    if slots is not None:
        metadata[:, 2:] = slots
    return metadata


def destination_rows(topk_idx: torch.Tensor, engine_handle: DispatchHandle, rank: int,
                     experts_per_rank: int) -> torch.Tensor:
    """V2's ``dst_buffer_slot_idx`` (int32 [N, K]): the row that holds token t on the rank of
    slot k's expert, -1 where topk_idx is -1. Rows from this rank start on rank r after those
    from ranks before it (``rank_prefix_matrix[rank - 1, r]``), in token order."""
    in_rank = engine_handle.is_token_in_rank
    prefix = engine_handle.rank_prefix_matrix.to(torch.int64)
    before = prefix[rank - 1] if rank > 0 else torch.zeros_like(prefix[0])
    position = torch.cumsum(in_rank.to(torch.int64), 0) - 1   # [N, R]: the token's place among those sent to r
    valid = topk_idx >= 0
    dest = torch.where(valid, topk_idx // experts_per_rank, 0)
    rows = before.index_select(0, dest.reshape(-1)).view(dest.shape) + position.gather(1, dest)
    return torch.where(valid, rows, -1).to(torch.int32)
