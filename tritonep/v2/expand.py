"""V2's expanded layout, built in plain torch on the engine's received rows.

The engines receive each token once per rank, with its local expert ids (``recv_topk_idx``).
V2's expanded layout instead gives each (token, local expert) pair a row of its own, grouped by
expert, each expert's block starting at a multiple of ``expert_alignment``; inside a block rows
keep the received order (source rank, then source token: V2's deterministic order). Combine
sums a token's expanded rows back into one row per rank before the engine's combine.

Everything here is device-agnostic and free of host synchronisation (no boolean indexing, no
``.item()``), so it runs on every backend and inside CUDA-graph capture. An engine that wrote
rows straight to their expanded positions would save the extra copy of every received row (and
of the scales and weights) here, and the reduction pass before combine.
"""

from __future__ import annotations

import torch


def expert_slots(recv_topk_idx: torch.Tensor, num_local_experts: int,
                 alignment: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each (row, k) pair goes in the expanded layout.

    Arguments:
        recv_topk_idx: [M, K] int64 local expert ids, -1 where the expert lives elsewhere.
        num_local_experts: E/R.
        alignment: expert_alignment.

    Returns:
        slots: int32 [M, K], the pair's expanded row, -1 for no pair.
        counts: int32 [E/R], pairs per local expert.
        starts: int64 [E/R], each expert's first expanded row (aligned).
    """
    num_rows, num_topk = recv_topk_idx.shape
    device = recv_topk_idx.device
    valid = recv_topk_idx >= 0
    # Pairs of no local expert sort last, under the key E/R.
    keys = torch.where(valid, recv_topk_idx, num_local_experts).reshape(-1)
    counts = torch.zeros(num_local_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, keys, torch.ones_like(keys))
    aligned = (counts + alignment - 1) // alignment * alignment
    starts = torch.cumsum(aligned, 0) - aligned
    # A stable sort by expert keeps row-major order, so pairs of one expert come by row (rows are
    # in source order; one token has at most one pair per expert).
    order = torch.sort(keys, stable=True).indices
    sorted_keys = keys.index_select(0, order)
    first_of_key = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(keys.numel(), dtype=torch.int64, device=device) - first_of_key.index_select(
        0, sorted_keys)
    sorted_slots = starts.index_select(0, sorted_keys) + rank_in_expert
    slots = torch.empty_like(keys).scatter_(0, order, sorted_slots).view(num_rows, num_topk)
    slots = torch.where(valid, slots, -1).to(torch.int32)
    return slots, counts[:num_local_experts].to(torch.int32), starts[:num_local_experts]


def worst_expanded_rows(num_ranks: int, num_max_tokens_per_rank: int, num_topk: int, num_local_experts: int,
                        alignment: int) -> int:
    """Expanded rows a rank can need at most (V2's size without a CPU sync): every rank's T tokens
    each on min(K, E/R) local experts, plus each expert's alignment padding."""
    rows = num_ranks * num_max_tokens_per_rank * min(num_topk, num_local_experts) + (alignment - 1) * num_local_experts
    return (rows + alignment - 1) // alignment * alignment


def _source_rows(slots: torch.Tensor, num_expanded: int) -> torch.Tensor:
    """int64 [num_expanded]: the received row each expanded row copies, -1 on padding."""
    num_rows, num_topk = slots.shape
    device = slots.device
    # Pairs of no expert write into one extra entry, which is dropped.
    targets = torch.where(slots >= 0, slots.to(torch.int64), num_expanded).reshape(-1)
    rows = torch.arange(num_rows, dtype=torch.int64, device=device).repeat_interleave(num_topk)
    source = torch.full((num_expanded + 1,), -1, dtype=torch.int64, device=device)
    return source.scatter_(0, targets, rows)[:num_expanded]


def expand_rows(rows: torch.Tensor, slots: torch.Tensor, num_expanded: int, zero_padding: bool) -> torch.Tensor:
    """[M, C] received rows (any dtype, any strides) -> [num_expanded, C] expanded rows.

    Padding rows (alignment gaps, and past the pairs without a CPU sync) are zero with
    ``zero_padding``; otherwise they hold whatever row was at hand (V2 leaves them unset)."""
    source = _source_rows(slots, num_expanded)
    columns = rows.shape[1]
    if rows.shape[0] == 0:
        return torch.zeros(num_expanded, columns, dtype=rows.dtype, device=rows.device)
    # Gathered as bytes (index_select has no float8 kernel on every device), from row-major
    # rows (a dtype view needs them; scales may come column-major).
    data = rows if rows.stride() == (columns, 1) else rows.clone(memory_format=torch.contiguous_format)
    out = data.view(torch.uint8).index_select(0, source.clamp(min=0)).view(rows.dtype)
    if zero_padding:
        out.view(torch.uint8).masked_fill_((source < 0).view(-1, 1), 0)
    return out


def expand_weights(recv_weights: torch.Tensor, slots: torch.Tensor, num_expanded: int) -> torch.Tensor:
    """[M, K] float32 received top-k weights -> float32 [num_expanded], the weight of each
    expanded row's (token, expert) pair; 0 on padding rows."""
    targets = torch.where(slots >= 0, slots.to(torch.int64), num_expanded).reshape(-1)
    out = torch.zeros(num_expanded + 1, dtype=torch.float32, device=recv_weights.device)
    return out.scatter_(0, targets, recv_weights.reshape(-1))[:num_expanded]


def reduce_rows(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """bf16 [num_expanded, H] expert outputs -> bf16 [M, H], each received row the float32 sum
    (in slot order k = 0, 1, ..) of its pairs' rows, rounded once; 0 for rows of no pair.
    Padding rows of ``x`` are never read (their values, NaN included, do not matter)."""
    num_rows = slots.shape[0]
    total = torch.zeros(num_rows, x.shape[1], dtype=torch.float32, device=x.device)
    if x.shape[0] == 0:
        return total.to(torch.bfloat16)
    for k in range(slots.shape[1]):
        slot = slots[:, k]
        picked = x.index_select(0, slot.clamp(min=0).to(torch.int64)).float()
        total += torch.where((slot >= 0).view(-1, 1), picked, 0.0)
    return total.to(torch.bfloat16)


def gather_weights(weights: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """float32 [num_expanded] per-pair weights -> float32 [M, K] per received row and slot, 0
    where the slot has no local expert."""
    if weights.shape[0] == 0:
        return torch.zeros(slots.shape, dtype=torch.float32, device=weights.device)
    picked = weights.index_select(0, slots.clamp(min=0).to(torch.int64).reshape(-1)).view(slots.shape)
    return torch.where(slots >= 0, picked, 0.0)
