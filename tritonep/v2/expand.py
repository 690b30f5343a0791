"""V2's expanded rows, copied in plain torch from the engine's received rows.

The engines receive each token once per rank, with its local expert ids (``recv_topk_idx``).
V2's expanded layout instead gives each (token, local expert) pair a row of its own, grouped by
expert, each expert's block starting at a multiple of ``expert_alignment``; inside a block rows
keep the received order (source rank, then source token: V2's deterministic order). Where each
pair goes is the backend's ``expert_layout`` (``core/expert_layout.py``); here the rows are
copied there, and combine sums a token's expanded rows back into one row per rank before the
engine's combine.

Everything here is device-agnostic and free of host synchronisation (no boolean indexing, no
``.item()``), so it runs on every backend and inside CUDA-graph capture. An engine that wrote
rows straight to their expanded positions would save the extra copy of every received row (and
of the scales and weights) here, and the reduction pass before combine.
"""

from __future__ import annotations

import torch


def worst_expanded_rows(num_ranks: int, num_max_tokens_per_rank: int, num_topk: int, num_local_experts: int,
                        alignment: int) -> int:
    """Expanded rows a rank can need at most (V2's size without a CPU sync): every rank's T tokens
    each on min(K, E/R) local experts, plus each expert's alignment padding."""
    rows = num_ranks * num_max_tokens_per_rank * min(num_topk, num_local_experts) + (alignment - 1) * num_local_experts
    return (rows + alignment - 1) // alignment * alignment


def expand_rows(rows: torch.Tensor, source: torch.Tensor, zero_padding: bool) -> torch.Tensor:
    """[M, C] received rows (any dtype, any strides) -> [len(source), C] expanded rows, row i a
    copy of received row ``source[i]`` (``ExpertLayout.expanded_source``).

    Padding rows (source -1: alignment gaps, and past the pairs without a CPU sync) are zero
    with ``zero_padding``; otherwise they hold whatever row was at hand (V2 leaves them unset)."""
    columns = rows.shape[1]
    if rows.shape[0] == 0:
        return torch.zeros(source.shape[0], columns, dtype=rows.dtype, device=rows.device)
    if rows.element_size() > 1:
        out = rows.index_select(0, source.clamp(min=0))
    else:
        # fp8 rows are gathered as bytes (index_select has no float8 kernel on every device).
        out = rows.view(torch.uint8).index_select(0, source.clamp(min=0)).view(rows.dtype)
    if zero_padding:
        (out if rows.element_size() > 1 else out.view(torch.uint8)).masked_fill_((source < 0).view(-1, 1), 0)
    return out


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
