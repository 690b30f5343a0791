"""Routing arithmetic shared by every backend, written once in plain torch.

Everything here is local to one rank (no communication) and device-agnostic: the CPU
backend uses it directly, the NVLink backend uses it where a Triton kernel would not pay,
and the tests use it as the reference for the Triton versions.
"""

from __future__ import annotations

import torch


def dispatch_layout(
    topk_idx: torch.Tensor, num_experts: int, num_ranks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Counts and the token-to-rank mask for ``topk_idx`` [N, K] (entries in [0, E) or -1).

    Returns ``(num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32,
    is_token_in_rank [N, R] bool)``. A token counts once per rank however many of its experts
    live there, and once per expert.
    """
    num_tokens = topk_idx.shape[0]
    experts_per_rank = num_experts // num_ranks
    valid = topk_idx >= 0
    experts = topk_idx[valid]
    num_tokens_per_expert = torch.bincount(experts, minlength=num_experts).to(torch.int32)
    is_token_in_rank = torch.zeros(num_tokens, num_ranks + 1, dtype=torch.bool, device=topk_idx.device)
    # -1 entries land in the extra column num_ranks, which is dropped.
    target_rank = torch.where(valid, topk_idx // experts_per_rank, num_ranks)
    is_token_in_rank.scatter_(1, target_rank, True)
    is_token_in_rank = is_token_in_rank[:, :num_ranks].contiguous()
    num_tokens_per_rank = is_token_in_rank.sum(0, dtype=torch.int32)
    return num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank


def tokens_per_node(is_token_in_rank: torch.Tensor, ranks_per_node: int) -> torch.Tensor:
    """DeepEP's ``num_tokens_per_rdma_rank``: int32 [nodes], the tokens that go to at least one
    rank of each node (node n = ranks n * ranks_per_node ..), a token counted once per node.

    ``is_token_in_rank``: [N, R] bool with R a multiple of ``ranks_per_node``. No host sync.
    """
    num_tokens, num_ranks = is_token_in_rank.shape
    in_node = is_token_in_rank.reshape(num_tokens, num_ranks // ranks_per_node, ranks_per_node).any(dim=2)
    return in_node.sum(0, dtype=torch.int32)


def to_local_expert_ids(topk_idx: torch.Tensor, rank: int, experts_per_rank: int) -> torch.Tensor:
    """Global expert ids -> ids local to ``rank``; -1 where the expert lives elsewhere."""
    local = topk_idx - rank * experts_per_rank
    return torch.where((topk_idx >= 0) & (local >= 0) & (local < experts_per_rank), local, -1)


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple``."""
    return (value + multiple - 1) // multiple * multiple


def round_up_counts(counts: list[int], alignment: int) -> list[int]:
    """Round each count up to a multiple of ``alignment`` (the per-expert list of dispatch)."""
    if alignment == 1:
        return list(counts)
    return [(c + alignment - 1) // alignment * alignment for c in counts]


def rank_prefix_matrix(count_matrix: torch.Tensor) -> torch.Tensor:
    """``count_matrix[s, r]`` = rows rank s sends to rank r -> DeepEP's ``rank_prefix_matrix``,
    ``[i, j]`` = rows rank j receives from ranks 0..i."""
    return count_matrix.cumsum(0, dtype=torch.int32)


def column_positions(mask: torch.Tensor) -> torch.Tensor:
    """int32, ``mask``'s shape [N, C]: each True entry's index among the Trues of its column (the
    token's row among those sent to that rank or node), -1 elsewhere. The scan runs along the
    inner dimension of the transposed mask: on GPUs torch's scan along dim 0 of a narrow matrix
    walks each column with one thread block, many times slower."""
    running = mask.t().to(torch.int32).cumsum(1, dtype=torch.int32).t()
    return torch.where(mask, running - 1, -1)


def count_rows_from_prefix(prefix: list[int], num_ranks: int) -> list[list[int]]:
    """Inverse of :func:`rank_prefix_matrix`, on a flat host list (row-major, R x R):
    ``[s][d]`` = rows rank s sends to rank d."""
    rows = [prefix[s * num_ranks: (s + 1) * num_ranks] for s in range(num_ranks)]
    return [rows[0]] + [[b - a for a, b in zip(rows[s - 1], rows[s])] for s in range(1, num_ranks)]


def send_order(is_token_in_rank: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows a rank sends, grouped by destination rank, source-token order inside a group.

    Returns ``(token_index [S] int64, destination_rank [S] int64)`` with S = is_token_in_rank.sum().
    This is exactly the order in which every receiver lays out its block from this rank.
    """
    destination_rank, token_index = is_token_in_rank.t().nonzero(as_tuple=True)
    return token_index, destination_rank


def low_latency_send_plan(
    topk_idx: torch.Tensor, num_experts: int, num_ranks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token, expert) pairs of a low-latency dispatch, in the order they are sent.

    Pairs are sorted by global expert id (so by destination rank, then local expert), and by
    token inside one expert. Returns ``(token_index [P], slot_k [P], expert [P], counts [R, E_local])``
    where ``counts[r, e]`` is the number of pairs for local expert e of rank r.
    """
    num_tokens, num_topk = topk_idx.shape
    experts_per_rank = num_experts // num_ranks
    flat = topk_idx.reshape(-1)
    valid = flat >= 0
    # Stable sort on expert id keeps token order inside each expert.
    keys = torch.where(valid, flat, num_experts)
    order = torch.sort(keys, stable=True).indices[: int(valid.sum())]
    token_index = order // num_topk
    slot_k = order % num_topk
    expert = flat[order]
    counts = torch.bincount(expert, minlength=num_experts).reshape(num_ranks, experts_per_rank)
    return token_index, slot_k, expert, counts
