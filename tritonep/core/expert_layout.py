"""Where a fresh dispatch's rows sit by expert, by source and by destination: DeepEP V2's
``EPHandle`` fields, defined once in plain torch.

A V1 dispatch returns the received rows by source rank (source token order inside), their
local expert ids and ``rank_prefix_matrix``; V2's handle describes the same routing in its own
terms. ``ExpertLayout`` names each field; the functions below define them from what the V1
dispatch produced, device-agnostic and without host synchronisation. The collective backend
computes them with these functions (the oracle); the NVLink backend computes the same values in
one kernel (``backends/nvlink/normal/expert_layout_kernel.py``), tested against them.

The expanded layout (``do_expand``) gives each (row, k) pair of a local expert a row of its
own, grouped by expert, each expert's block starting at a multiple of ``expert_alignment``;
inside a block pairs keep the received order (source rank, source token, then k: V2's
deterministic order).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from tritonep.core import routing
from tritonep.core.handles import DispatchHandle


@dataclass
class ExpertLayoutRequest:
    """A fresh dispatch's outputs, and what its V2 handle needs on top of them."""

    handle: DispatchHandle             # the dispatch's handle (rank_prefix_matrix, recv_src_idx, is_token_in_rank)
    topk_idx: torch.Tensor             # [N, K] int64: the dispatch's global expert ids, -1 for none
    recv_topk_idx: torch.Tensor        # [rows, K] int64: local expert ids of the received rows, -1 elsewhere
    recv_topk_weights: torch.Tensor    # [rows, K] float32, 0 where recv_topk_idx is -1
    experts_per_rank: int              # E/R
    expert_alignment: int
    num_max_tokens_per_rank: int       # T
    num_scaleup_ranks: int             # sources grouped by rank % num_scaleup_ranks (R: one scale-out rank)
    num_expanded: int | None           # rows of the expanded layout; None: not expanded
    copy_topk_idx: bool                # ExpertLayout.topk_idx is a copy (else the given tensor)
    stats: torch.Tensor | None         # int32 [E/R], incremented by the received counts


@dataclass
class HandleFieldsRequest:
    """Asks a fresh dispatch for the fields of a V2 handle that is not expanded, written by the
    dispatch itself where its backend can (``DispatchResult.layout``; else the caller asks
    ``Backend.expert_layout``). The rest of ``ExpertLayoutRequest`` comes from the dispatch."""

    num_scaleup_ranks: int
    copy_topk_idx: bool
    stats: torch.Tensor | None


class LayoutSizes(NamedTuple):
    """The shape of one layout; fixes where each field sits in its block (``offsets``)."""

    experts_per_rank: int
    num_scaleup_ranks: int
    num_rows: int
    num_topk: int
    num_tokens: int
    num_expanded: int | None   # None: not expanded

    def offsets(self) -> tuple[int, ...]:
        """Word offsets in the block of counts, psum_per_expert, psum_per_scaleup_rank,
        dst_buffer_slot_idx, recv_src_metadata, slots, expanded_source, expanded_weights, and
        the end. The fields placed before the metadata depend only on the call's shape, so a
        block sized for more rows holds every field where the received rows' count puts it.
        The kernels place them the same way (``handle_fields.field_pointers``)."""
        E, S, M, K, N = self.experts_per_rank, self.num_scaleup_ranks, self.num_rows, self.num_topk, self.num_tokens
        X = self.num_expanded or 0
        dst = 2 * E + S
        metadata = dst + N * K
        slots = metadata + M * (K + 2)
        expanded = self.num_expanded is not None
        source = slots + (M * K if expanded else 0)
        weights = source + X
        return 0, E, 2 * E, dst, metadata, slots, source, weights, weights + X

    def topk_copy_at(self) -> int:
        """Word offset of a topk_idx copy kept in the block after the fields, 16-byte aligned."""
        return (self.offsets()[-1] + 3) // 4 * 4

    def block_words(self, copy_topk_idx: bool) -> int:
        """Words of a block that holds the fields, and with ``copy_topk_idx`` the topk_idx copy
        (int64 [N, K] at ``topk_copy_at``)."""
        if not copy_topk_idx:
            return self.offsets()[-1]
        return self.topk_copy_at() + 2 * self.num_tokens * self.num_topk


class ExpertLayout:
    """V2's handle fields (``tritonep/v2/handle.py`` says how EPHandle shows them).

    counts: int32 [E/R], the (row, k) pairs each local expert received (unaligned).
    psum_per_expert: int32 [E/R]. Not expanded: the inclusive prefix sum of the aligned counts.
        Expanded: expert e's aligned start plus its count.
    psum_per_scaleup_rank: int32 [num_scaleup_ranks], inclusive prefix sum of the rows received
        from the sources of each scale-up index (``rank_prefix_matrix``'s column when there is
        one scale-out rank).
    recv_src_metadata: int32 [rows, K + 2] per received row: source rank * T + source token,
        source rank * K + the first k whose expert is local (0 if none), then, expanded, each
        k's expanded row (-1 where k's expert lives elsewhere), else -1; -1 throughout on padding
        rows (source -1).
    dst_buffer_slot_idx: int32 [N, K], the row that holds token t on the rank of k's expert:
        after the rows of lower source ranks there (``rank_prefix_matrix[rank - 1, r]``), at
        the token's place among those this rank sends to r; -1 where topk_idx is -1.
    topk_idx: int64 [N, K], the dispatch's topk_idx (a copy with ``copy_topk_idx``).
    slots: int32 [rows, K], each pair's expanded row, -1 for none (None unless expanded).
    expanded_source: int32 [num_expanded], the received row each expanded row holds, -1 on
        padding (alignment gaps and, without a CPU sync, past the last pair) (None unless expanded).
    expanded_weights: float32 [num_expanded], each expanded row's top-k weight, 0 on padding
        (None unless expanded).

    The fields share one int32 allocation, ``block``, placed by ``LayoutSizes.offsets`` (the
    weights as float32 bits), and a copy of ``topk_idx`` may follow them (``topk_copy_at``): a
    fresh dispatch allocates once for all of them, and each field is a view made when first
    read, since a host call's cost is mostly its tensor objects.
    """

    def __init__(self, block: torch.Tensor, sizes: LayoutSizes, topk_idx: torch.Tensor | None = None,
                 topk_copy_at: int | None = None) -> None:
        """``topk_idx``: the tensor the layout's ``topk_idx`` is (the dispatch's own, or a copy
        made apart); else ``topk_copy_at``: where its copy sits in ``block`` (a word offset
        that ``sizes`` need not give: a block sized for more rows puts it further)."""
        self.block, self.sizes = block, sizes
        self._topk_idx, self._topk_copy_at = topk_idx, topk_copy_at

    @functools.cached_property
    def topk_idx(self) -> torch.Tensor:
        if self._topk_copy_at is None:
            return self._topk_idx
        at, num_tokens, num_topk = self._topk_copy_at, self.sizes.num_tokens, self.sizes.num_topk
        return self.block[at:at + 2 * num_tokens * num_topk].view(torch.int64).view(num_tokens, num_topk)

    def _field(self, index: int) -> torch.Tensor:
        start, end = self.sizes.offsets()[index:index + 2]
        return self.block[start:end]

    @functools.cached_property
    def counts(self) -> torch.Tensor:
        return self._field(0)

    @functools.cached_property
    def psum_per_expert(self) -> torch.Tensor:
        return self._field(1)

    @functools.cached_property
    def psum_per_scaleup_rank(self) -> torch.Tensor:
        return self._field(2)

    @functools.cached_property
    def dst_buffer_slot_idx(self) -> torch.Tensor:
        return self._field(3).view(self.sizes.num_tokens, self.sizes.num_topk)

    @functools.cached_property
    def recv_src_metadata(self) -> torch.Tensor:
        return self._field(4).view(self.sizes.num_rows, self.sizes.num_topk + 2)

    @functools.cached_property
    def slots(self) -> torch.Tensor | None:
        if self.sizes.num_expanded is None:
            return None
        return self._field(5).view(self.sizes.num_rows, self.sizes.num_topk)

    @functools.cached_property
    def expanded_source(self) -> torch.Tensor | None:
        return None if self.sizes.num_expanded is None else self._field(6)

    @functools.cached_property
    def expanded_weights(self) -> torch.Tensor | None:
        return None if self.sizes.num_expanded is None else self._field(7).view(torch.float32)


def expert_counts(recv_topk_idx: torch.Tensor, num_local_experts: int) -> torch.Tensor:
    """int32 [E/R]: (row, k) pairs per local expert (the real, unaligned counts)."""
    keys = torch.where(recv_topk_idx >= 0, recv_topk_idx, num_local_experts).reshape(-1)
    counts = torch.zeros(num_local_experts + 1, dtype=torch.int64, device=recv_topk_idx.device)
    counts.scatter_add_(0, keys, torch.ones_like(keys))
    return counts[:num_local_experts].to(torch.int32)


def expert_slots(recv_topk_idx: torch.Tensor, num_local_experts: int,
                 alignment: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each (row, k) pair goes in the expanded layout.

    Returns:
        slots: int32 [rows, K], the pair's expanded row, -1 for no pair.
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
    # A stable sort by expert keeps row-major order: pairs of one expert come by row (rows are
    # in source order), then by k.
    order = torch.sort(keys, stable=True).indices
    sorted_keys = keys.index_select(0, order)
    first_of_key = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(keys.numel(), dtype=torch.int64, device=device) - first_of_key.index_select(
        0, sorted_keys)
    sorted_slots = starts.index_select(0, sorted_keys) + rank_in_expert
    slots = torch.empty_like(keys).scatter_(0, order, sorted_slots).view(num_rows, num_topk)
    slots = torch.where(valid, slots, -1).to(torch.int32)
    return slots, counts[:num_local_experts].to(torch.int32), starts[:num_local_experts]


def expert_prefix(counts: torch.Tensor, starts: torch.Tensor | None, alignment: int) -> torch.Tensor:
    """``psum_per_expert`` (int32 [E/R]): with ``starts`` (expanded) each expert's aligned start
    plus its count, else the inclusive prefix sum of aligned counts."""
    if starts is not None:
        return (starts + counts).to(torch.int32)
    aligned = (counts.to(torch.int64) + alignment - 1) // alignment * alignment
    return torch.cumsum(aligned, 0).to(torch.int32)


def rows_from_rank(engine_handle: DispatchHandle, rank: int) -> torch.Tensor:
    """int32 [R]: inclusive prefix sum over source ranks of the rows this rank received."""
    return engine_handle.rank_prefix_matrix[:, rank].contiguous().to(torch.int32)


def scaleup_prefix(per_source: torch.Tensor, num_scaleup_ranks: int) -> torch.Tensor:
    """``psum_per_scaleup_rank`` (int32 [num_scaleup_ranks]) from the inclusive per-source-rank
    prefix: sources grouped by scale-up index (rank % num_scaleup_ranks), the peers V2's hybrid
    kernels forward through; the identity with one scale-out rank."""
    num_ranks = per_source.shape[0]
    if num_scaleup_ranks == num_ranks:
        return per_source
    counts = torch.diff(per_source.to(torch.int64), prepend=per_source.new_zeros(1, dtype=torch.int64))
    per_scaleup = counts.view(num_ranks // num_scaleup_ranks, num_scaleup_ranks).sum(0)
    return torch.cumsum(per_scaleup, 0).to(torch.int32)


def source_metadata(engine_handle: DispatchHandle, per_source: torch.Tensor, recv_topk_idx: torch.Tensor,
                    slots: torch.Tensor | None, num_max_tokens_per_rank: int) -> torch.Tensor:
    """``recv_src_metadata`` (int32 [rows, K + 2]; see ExpertLayout)."""
    num_rows, num_topk = recv_topk_idx.shape
    device = recv_topk_idx.device
    src_token = engine_handle.recv_src_idx.to(torch.int64)
    real = src_token >= 0   # padding rows (no CPU sync) have source -1
    row = torch.arange(num_rows, dtype=torch.int64, device=device)
    src_rank = torch.searchsorted(per_source.to(torch.int64), row, right=True)
    local = recv_topk_idx >= 0
    # The first k of a local expert: argmax finds the first True (V2's "master" lane).
    first_k = local.to(torch.int32).argmax(dim=1) if num_topk else torch.zeros_like(row)
    metadata = torch.full((num_rows, num_topk + 2), -1, dtype=torch.int32, device=device)
    metadata[:, 0] = torch.where(real, src_rank * num_max_tokens_per_rank + src_token, -1).to(torch.int32)
    metadata[:, 1] = torch.where(real, src_rank * num_topk + first_k, -1).to(torch.int32)
    if slots is not None:
        metadata[:, 2:] = slots
    return metadata


def destination_rows(topk_idx: torch.Tensor, engine_handle: DispatchHandle, rank: int,
                     experts_per_rank: int) -> torch.Tensor:
    """``dst_buffer_slot_idx`` (int32 [N, K]; see ExpertLayout)."""
    in_rank = engine_handle.is_token_in_rank
    prefix = engine_handle.rank_prefix_matrix.to(torch.int64)
    before = prefix[rank - 1] if rank > 0 else torch.zeros_like(prefix[0])
    position = routing.column_positions(in_rank).to(torch.int64)   # [N, R]: the token's place among those sent to r
    valid = topk_idx >= 0
    dest = torch.where(valid, topk_idx // experts_per_rank, 0)
    rows = before.index_select(0, dest.reshape(-1)).view(dest.shape) + position.gather(1, dest)
    return torch.where(valid, rows, -1).to(torch.int32)


def _targets(slots: torch.Tensor, num_expanded: int) -> torch.Tensor:
    """int64 [rows * K]: each pair's expanded row; pairs of no expert, and pairs past
    ``num_expanded`` (a worst case too small, with an expert twice in a token's top-k), go to
    one extra entry, which is dropped."""
    placed = (slots >= 0) & (slots < num_expanded)
    return torch.where(placed, slots.to(torch.int64), num_expanded).reshape(-1)


def expanded_source(slots: torch.Tensor, num_expanded: int) -> torch.Tensor:
    """``expanded_source`` (int32 [num_expanded]): the received row of each expanded row, -1 on padding."""
    num_rows, num_topk = slots.shape
    device = slots.device
    rows = torch.arange(num_rows, dtype=torch.int32, device=device).repeat_interleave(num_topk)
    source = torch.full((num_expanded + 1,), -1, dtype=torch.int32, device=device)
    return source.scatter_(0, _targets(slots, num_expanded), rows)[:num_expanded]


def expand_weights(recv_weights: torch.Tensor, slots: torch.Tensor, num_expanded: int) -> torch.Tensor:
    """[rows, K] float32 received top-k weights -> float32 [num_expanded], the weight of each
    expanded row's (token, expert) pair; 0 on padding rows."""
    out = torch.zeros(num_expanded + 1, dtype=torch.float32, device=recv_weights.device)
    return out.scatter_(0, _targets(slots, num_expanded), recv_weights.reshape(-1))[:num_expanded]


def expert_layout(request: ExpertLayoutRequest, rank: int) -> ExpertLayout:
    """Every field of ``request``'s layout at ``rank``, in plain torch (the definition)."""
    handle, recv_idx = request.handle, request.recv_topk_idx
    slots = starts = source = weights = None
    if request.num_expanded is not None:
        slots, counts, starts = expert_slots(recv_idx, request.experts_per_rank, request.expert_alignment)
        source = expanded_source(slots, request.num_expanded)
        weights = expand_weights(request.recv_topk_weights, slots, request.num_expanded)
    else:
        counts = expert_counts(recv_idx, request.experts_per_rank)
    if request.stats is not None:
        request.stats.add_(counts)
    per_source = rows_from_rank(handle, rank)
    num_rows, num_topk = recv_idx.shape
    sizes = LayoutSizes(request.experts_per_rank, request.num_scaleup_ranks, num_rows, num_topk,
                        request.topk_idx.shape[0], request.num_expanded)
    fields = [counts, expert_prefix(counts, starts, request.expert_alignment),
              scaleup_prefix(per_source, request.num_scaleup_ranks),
              destination_rows(request.topk_idx, handle, rank, request.experts_per_rank),
              source_metadata(handle, per_source, recv_idx, slots, request.num_max_tokens_per_rank)]
    if slots is not None:
        fields += [slots, source, weights.view(torch.int32)]
    block = torch.cat([field.reshape(-1).to(torch.int32) for field in fields])
    return ExpertLayout(block, sizes, request.topk_idx.clone() if request.copy_topk_idx else request.topk_idx)
