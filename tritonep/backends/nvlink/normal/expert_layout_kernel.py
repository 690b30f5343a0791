"""A fresh dispatch's layout by expert, source and destination (DeepEP V2's handle fields, as
``core/expert_layout.py`` defines them) in one launch, from what the dispatch left on the GPU.
A V2 dispatch that is not expanded has its receivers write these fields themselves
(``dispatch_kernel.py``, ``LAYOUT``); this launch serves the expanded layout, whose slots need
every row of a source in place, and any caller that asks for the fields apart.

The count exchange's result already holds ``rank_prefix_matrix``, the pairs each local expert
receives and, per source rank, where its pairs start in each expert's block; the send plan holds
each token's place among those sent to each rank. With them no field needs a pass over all the
rows before another can start, so the launch has four kinds of programs, each writing its own
elements and none waiting for another:

- program 0: the per-expert vectors (counts, their prefix sums, the caller's running stats) and
  the prefix sums per scale-up rank;
- row programs, a block of received rows each: the source metadata (and, expanded, -1 for the
  slots whose expert lives elsewhere); on the padding rows of worst-case outputs also the
  dispatch's own empty values, which it leaves to this launch (``DispatchRequest.pad_outputs``);
- token programs, a block of this rank's tokens each: the row each (token, k) lands on at its
  expert's rank, and the copy of ``topk_idx``;
- slot programs (expanded layout only), one per (source rank, group of local experts): they walk
  the source's block of received rows in order and give each pair of their experts the next row
  of the expert's expanded block, from where the lower sources' pairs end; the programs of
  source 0 also mark their experts' alignment gaps, and all of them share the rows past the last
  expert's block (worst-case outputs) between them.

The fields share one int32 block (``core.expert_layout.LayoutSizes`` places them; the kernel
finds them by the same arithmetic, ``handle_fields.field_pointers``). The host allocates it and launches
(``ExpertLayouts``: after a setup's first call, a learnt launch with the call's addresses);
nothing is read back, so a ``do_cpu_sync=False`` dispatch stays capturable in a CUDA graph.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from tritonep.backends.nvlink.normal.handle_fields import (
    aligned_counts,
    expert_vectors,
    field_pointers,
    first_local_k,
    token_fields,
)
from tritonep.backends.nvlink.normal.notify_kernel import source_expert_word
from tritonep.backends.nvlink.normal.shape import Placeholders
from tritonep.core.expert_layout import ExpertLayout, ExpertLayoutRequest, LayoutSizes
from tritonep.runtime import kernel_names
from tritonep.runtime.launcher import DeviceAddress, FastLauncher, aligned, current_stream, next_power_of_2


@triton.jit
def _row_fields(program, row_programs, exchange_ptr, recv_src_ptr, recv_idx_ptr, recv_weights_ptr, metadata_ptr,
                slots_ptr, num_rows, rank, num_max_tokens, NUM_RANKS: tl.constexpr, RANKS_PAD: tl.constexpr,
                NUM_TOPK: tl.constexpr, TOPK_PAD: tl.constexpr, BLOCK_ROWS: tl.constexpr, EXPAND: tl.constexpr):
    sources = tl.arange(0, RANKS_PAD)
    source_mask = sources < NUM_RANKS
    source_ends = tl.load(exchange_ptr + sources * NUM_RANKS + rank, mask=source_mask, other=0)
    received = tl.max(source_ends, axis=0)   # the last block's end: rows past it are padding
    ks = tl.arange(0, TOPK_PAD)
    for r0 in range(program * BLOCK_ROWS, num_rows, row_programs * BLOCK_ROWS):
        rows = r0 + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < num_rows
        real = rows < received
        pair_mask = row_mask[:, None] & (ks < NUM_TOPK)[None, :]
        pairs = rows.to(tl.int64)[:, None] * NUM_TOPK + ks[None, :]
        # The dispatch left the padding rows unwritten (``DispatchRequest.pad_outputs``): they
        # get their empty values here (source -1, expert -1, weight 0).
        padding = row_mask & ~real
        tl.store(recv_src_ptr + rows, -1, mask=padding)
        tl.store(recv_idx_ptr + pairs, -1, mask=padding[:, None] & pair_mask)
        tl.store(recv_weights_ptr + pairs, 0.0, mask=padding[:, None] & pair_mask)
        src_token = tl.load(recv_src_ptr + rows, mask=row_mask & real, other=-1)
        # Blocks come by source rank: the row's source is the number of blocks that end at or before it.
        src_rank = tl.sum(((source_ends[None, :] <= rows[:, None]) & source_mask[None, :]).to(tl.int32), axis=1)
        ids = tl.load(recv_idx_ptr + pairs, mask=pair_mask & real[:, None], other=-1)
        elsewhere = ids < 0
        first_k = first_local_k(ids, NUM_TOPK, TOPK_PAD)
        metadata = metadata_ptr + rows.to(tl.int64) * (NUM_TOPK + 2)
        tl.store(metadata, tl.where(real, src_rank * num_max_tokens + src_token, -1), mask=row_mask)
        tl.store(metadata + 1, tl.where(real, src_rank * NUM_TOPK + first_k, -1), mask=row_mask)
        if EXPAND:   # the slot programs write the pairs of local experts
            tl.store(metadata[:, None] + 2 + ks[None, :], -1, mask=pair_mask & elsewhere)
            tl.store(slots_ptr + pairs, -1, mask=pair_mask & elsewhere)
        else:
            tl.store(metadata[:, None] + 2 + ks[None, :], -1, mask=pair_mask)


@triton.jit
def _expanded_slots(program, exchange_ptr, recv_idx_ptr, recv_weights_ptr, metadata_ptr, slots_ptr, source_ptr,
                    expanded_weights_ptr, num_expanded, rank, experts_per_rank, alignment, source_expert_word,
                    NUM_RANKS: tl.constexpr, NUM_TOPK: tl.constexpr, EXPERTS_PAD: tl.constexpr,
                    EXPERT_GROUP: tl.constexpr, BLOCK_SLOTS: tl.constexpr):
    groups = tl.cdiv(experts_per_rank, EXPERT_GROUP)
    source = program // groups
    experts = (program % groups) * EXPERT_GROUP + tl.arange(0, EXPERT_GROUP)
    expert_mask = experts < experts_per_rank
    all_experts = tl.arange(0, EXPERTS_PAD)
    all_aligned = aligned_counts(tl.load(exchange_ptr + NUM_RANKS * NUM_RANKS + all_experts,
                                   mask=all_experts < experts_per_rank, other=0), alignment)
    # Each expert's block starts after the aligned blocks of the experts before it; this
    # source's pairs in it after those of the lower sources (the exchange's per-source prefix).
    starts = tl.sum(tl.where(all_experts[None, :] < experts[:, None], all_aligned[None, :], 0), axis=1)
    base = starts + tl.load(exchange_ptr + source_expert_word + (source - 1) * experts_per_rank + experts,
                            mask=expert_mask & (source > 0), other=0)
    first_row = tl.load(exchange_ptr + (source - 1) * NUM_RANKS + rank, mask=source > 0, other=0)
    end_row = tl.load(exchange_ptr + source * NUM_RANKS + rank)
    carry = tl.zeros([EXPERT_GROUP], dtype=tl.int32)   # pairs of each expert in the rows walked so far
    for r0 in range(first_row, end_row, BLOCK_SLOTS):
        rows = r0 + tl.arange(0, BLOCK_SLOTS)
        row_mask = rows < end_row
        pairs = rows.to(tl.int64) * NUM_TOPK
        hits = tl.zeros([BLOCK_SLOTS, EXPERT_GROUP], dtype=tl.int32)
        for k in tl.static_range(NUM_TOPK):
            ids = tl.load(recv_idx_ptr + pairs + k, mask=row_mask, other=-1)
            hits += (ids[:, None] == experts[None, :]).to(tl.int32)
        # A pair's place in its expert's block: pairs of the expert in earlier rows, then in
        # earlier slots of the same row (row-major order).
        earlier = base[None, :] + carry[None, :] + tl.cumsum(hits, axis=0) - hits
        for k in tl.static_range(NUM_TOPK):
            ids = tl.load(recv_idx_ptr + pairs + k, mask=row_mask, other=-1)
            match = ids[:, None] == experts[None, :]
            slot = tl.sum(tl.where(match, earlier, 0), axis=1)
            found = tl.max(match.to(tl.int32), axis=1) > 0
            tl.store(slots_ptr + pairs + k, slot, mask=found)
            tl.store(metadata_ptr + rows.to(tl.int64) * (NUM_TOPK + 2) + 2 + k, slot, mask=found)
            placed = found & (slot < num_expanded)   # (pairs past a too-small worst case are not placed)
            tl.store(source_ptr + slot, rows, mask=placed)
            weight = tl.load(recv_weights_ptr + pairs + k, mask=placed, other=0.0)
            tl.store(expanded_weights_ptr + slot, weight, mask=placed)
            earlier += match.to(tl.int32)
        carry += tl.sum(hits, axis=0)

    # Padding: source 0's programs mark their experts' alignment gaps (each shorter than the
    # alignment), and every slot program a share of the rows past the last block.
    if source == 0:
        counts = tl.load(exchange_ptr + NUM_RANKS * NUM_RANKS + experts, mask=expert_mask, other=0)
        gap_start = starts + counts
        gap = aligned_counts(counts, alignment) - counts
        for j0 in range(0, alignment - 1, BLOCK_SLOTS):
            j = j0 + tl.arange(0, BLOCK_SLOTS)
            position = gap_start[:, None] + j[None, :]
            mask = expert_mask[:, None] & (j[None, :] < gap[:, None]) & (position < num_expanded)
            tl.store(source_ptr + position, -1, mask=mask)
            tl.store(expanded_weights_ptr + position, 0.0, mask=mask)
    num_programs = NUM_RANKS * groups
    for j0 in range(tl.sum(all_aligned, axis=0) + program * BLOCK_SLOTS, num_expanded, num_programs * BLOCK_SLOTS):
        j = j0 + tl.arange(0, BLOCK_SLOTS)
        tl.store(source_ptr + j, -1, mask=j < num_expanded)
        tl.store(expanded_weights_ptr + j, 0.0, mask=j < num_expanded)


@kernel_names.jit("tritonep::intranode::expert_layout",
                  do_not_specialize=["num_rows", "num_tokens", "num_expanded", "alignment", "has_stats", "copy_topk",
                                     "rank", "experts_per_rank", "num_max_tokens", "row_programs", "token_programs",
                                     "source_expert_word"])
def expert_layout_kernel(
    # What the dispatch left: the exchange's result words, the send plan's positions, the received rows.
    exchange_ptr, send_pos_ptr, recv_src_ptr, recv_idx_ptr, recv_weights_ptr, topk_idx_ptr, stats_ptr,
    # The fields' block (core/expert_layout.py), the copy of topk_idx.
    fields_ptr, topk_copy_ptr,
    num_rows, num_tokens, num_expanded, alignment, has_stats, copy_topk,              # per call
    rank, experts_per_rank, num_max_tokens, row_programs, token_programs, source_expert_word,   # per shape
    NUM_RANKS: tl.constexpr, RANKS_PAD: tl.constexpr, SCALEUP_RANKS: tl.constexpr, SCALEUP_PAD: tl.constexpr,
    NUM_TOPK: tl.constexpr, TOPK_PAD: tl.constexpr, EXPERTS_PAD: tl.constexpr, EXPERT_GROUP: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_TOKENS: tl.constexpr, BLOCK_SLOTS: tl.constexpr, EXPAND: tl.constexpr,
):
    program = tl.program_id(0)
    counts_ptr, psum_expert_ptr, psum_scaleup_ptr, dst_ptr, metadata_ptr, slots_ptr, source_ptr, \
        expanded_weights_ptr = field_pointers(fields_ptr, num_rows, num_tokens, num_expanded, experts_per_rank,
                                              SCALEUP_RANKS, NUM_TOPK)
    if program == 0:
        expert_vectors(exchange_ptr, stats_ptr, counts_ptr, psum_expert_ptr, psum_scaleup_ptr, has_stats, rank,
                       experts_per_rank, alignment, NUM_RANKS, RANKS_PAD, SCALEUP_RANKS, SCALEUP_PAD, EXPERTS_PAD,
                       EXPAND)
    elif program <= row_programs:
        _row_fields(program - 1, row_programs, exchange_ptr, recv_src_ptr, recv_idx_ptr, recv_weights_ptr,
                    metadata_ptr, slots_ptr, num_rows, rank, num_max_tokens, NUM_RANKS, RANKS_PAD, NUM_TOPK, TOPK_PAD,
                    BLOCK_ROWS, EXPAND)
    elif program <= row_programs + token_programs:
        token_fields(program - 1 - row_programs, token_programs, exchange_ptr, send_pos_ptr, topk_idx_ptr, dst_ptr,
                     topk_copy_ptr, copy_topk, num_tokens, rank, experts_per_rank, NUM_RANKS, NUM_TOPK, TOPK_PAD,
                     BLOCK_TOKENS)
    elif EXPAND:
        _expanded_slots(program - 1 - row_programs - token_programs, exchange_ptr, recv_idx_ptr, recv_weights_ptr,
                        metadata_ptr, slots_ptr, source_ptr, expanded_weights_ptr, num_expanded, rank,
                        experts_per_rank, alignment, source_expert_word, NUM_RANKS, NUM_TOPK, EXPERTS_PAD,
                        EXPERT_GROUP, BLOCK_SLOTS)


# Per call the tensors and the sizes change; this rank and the shape (ranks, T, top-k, experts,
# options) are the setup, which fixes the grid.
_EXPERT_LAYOUT = FastLauncher(expert_layout_kernel, changing=(
    "exchange_ptr", "send_pos_ptr", "recv_src_ptr", "recv_idx_ptr", "recv_weights_ptr", "topk_idx_ptr", "stats_ptr",
    "fields_ptr", "topk_copy_ptr", "num_rows", "num_tokens", "num_expanded", "alignment", "has_stats", "copy_topk"))

BLOCK_ROWS = BLOCK_TOKENS = BLOCK_SLOTS = 256
EXPERT_GROUP = 8   # local experts per slot program: each walks its source's rows once for all of them


class _LayoutShape:
    """What every launch of one setup shares, worked out on its first call: the grid, the
    per-shape integer arguments and the constexprs."""

    __slots__ = ("grid", "fixed_args", "constants")

    def __init__(self, grid: int, fixed_args: tuple, constants: dict) -> None:
        self.grid, self.fixed_args, self.constants = grid, fixed_args, constants

    @staticmethod
    def make(rank: int, num_ranks: int, T: int, num_topk: int, experts_per_rank: int, num_scaleup: int,
             expand: bool) -> _LayoutShape:
        # The grid is fixed by the shape: a rank receives at most R * T rows (programs stride over
        # more, should there be); one slot program per (source, group of local experts).
        row_programs = max(-(-num_ranks * T // BLOCK_ROWS), 1)
        token_programs = max(-(-T // BLOCK_TOKENS), 1)
        group = min(EXPERT_GROUP, next_power_of_2(experts_per_rank))
        groups = -(-experts_per_rank // group)
        grid = 1 + row_programs + token_programs + (num_ranks * groups if expand else 0)
        fixed_args = (rank, experts_per_rank, T, row_programs, token_programs,
                      source_expert_word(num_ranks, experts_per_rank))
        constants = dict(NUM_RANKS=num_ranks, RANKS_PAD=next_power_of_2(num_ranks), SCALEUP_RANKS=num_scaleup,
                         SCALEUP_PAD=next_power_of_2(num_scaleup), NUM_TOPK=num_topk,
                         TOPK_PAD=next_power_of_2(num_topk), EXPERTS_PAD=next_power_of_2(experts_per_rank),
                         EXPERT_GROUP=group, BLOCK_ROWS=BLOCK_ROWS, BLOCK_TOKENS=BLOCK_TOKENS,
                         BLOCK_SLOTS=BLOCK_SLOTS, EXPAND=expand)
        return _LayoutShape(grid, fixed_args, constants)


class ExpertLayouts:
    """One engine's expert layouts (``core.expert_layout.expert_layout`` gives the same values),
    one launch each. The first call of a setup goes through the launcher, which binds every
    argument; the launch it returns is kept with its raw argument list, and later calls of the
    setup rewrite only the per-call arguments (the list's first 15 entries) and repeat it, as
    ``layout_kernel.DispatchLayout`` does: a fresh V2 dispatch pays for one plain launch.

    Arguments:
        rank, num_ranks: this rank and the group's size.
        placeholders: tensors passed for the outputs a call does not have.
    """

    def __init__(self, rank: int, num_ranks: int, placeholders: Placeholders) -> None:
        self.rank, self.num_ranks = rank, num_ranks
        self._no_stats, self._no_copy = placeholders(torch.int32), placeholders(torch.int64)
        self._device = self._no_stats.device   # (reading a tensor's device makes an object per call)
        self._shapes: dict[tuple, _LayoutShape] = {}
        self._learnt: dict[tuple, list] = {}   # setup -> [compiled launch, its raw argument list]

    def __call__(self, request: ExpertLayoutRequest, exchange: torch.Tensor, send_pos: torch.Tensor,
                 launch_generation: int) -> ExpertLayout:
        """``request``'s layout.

        Arguments:
            request: a fresh dispatch's outputs and the layout's options.
            exchange: int32, the dispatch's count-exchange result (``notify_kernel.notify_dispatch``).
            send_pos: int32 [N + 1, R], the dispatch's send plan: each token's place among those
                sent to each rank.
            launch_generation: stands for the kernel shapes in the setup key (``NormalState``).

        Returns:
            the ExpertLayout, its tensors filled in stream order (nothing waits for them).
        """
        recv_idx, topk_idx, stats, num_expanded = request.recv_topk_idx, request.topk_idx, request.stats, \
            request.num_expanded
        num_rows, num_topk = recv_idx.shape
        num_tokens = topk_idx.shape[0]
        sizes = LayoutSizes(request.experts_per_rank, request.num_scaleup_ranks, num_rows, num_topk, num_tokens,
                            num_expanded)
        copy_topk = request.copy_topk_idx
        block = torch.empty(sizes.block_words(copy_topk), dtype=torch.int32, device=self._device)
        copy_at = sizes.topk_copy_at() if copy_topk else None
        setup = (launch_generation, self.rank, self.num_ranks, request.num_max_tokens_per_rank, num_topk,
                 request.experts_per_rank, request.num_scaleup_ranks, num_expanded is not None)
        # The per-call arguments, in the kernel's order (``_EXPERT_LAYOUT``'s ``changing``).
        changing = (exchange.data_ptr(), send_pos.data_ptr(), request.handle.recv_src_idx.data_ptr(),
                    recv_idx.data_ptr(), request.recv_topk_weights.data_ptr(), topk_idx.data_ptr(),
                    (stats if stats is not None else self._no_stats).data_ptr(), block.data_ptr(),
                    block.data_ptr() + 4 * copy_at if copy_at is not None else self._no_copy.data_ptr(),
                    num_rows, num_tokens, num_expanded or 0, request.expert_alignment, int(stats is not None),
                    int(copy_topk))
        learnt = self._learnt.get(setup)
        if learnt is not None and _repeats(changing):
            learnt[1][:_CHANGING] = changing
            learnt[0](current_stream(), learnt[1])
        else:
            topk_copy = DeviceAddress(block, 4 * copy_at, torch.int64) if copy_at is not None else self._no_copy
            self._launch(setup, request, exchange, send_pos, block, topk_copy, changing)
        return ExpertLayout(block, sizes, topk_idx if copy_at is None else None, copy_at)

    def _launch(self, setup: tuple, request: ExpertLayoutRequest, exchange: torch.Tensor, send_pos: torch.Tensor,
                block: torch.Tensor, topk_copy: Any, changing: tuple) -> None:
        """The launch through the launcher (the first of a setup, or one a learnt launch may not
        repeat), kept for later calls when they may repeat it."""
        shape = self._shapes.get(setup)
        if shape is None:
            shape = self._shapes[setup] = _LayoutShape.make(
                self.rank, self.num_ranks, request.num_max_tokens_per_rank, request.recv_topk_idx.shape[1],
                request.experts_per_rank, request.num_scaleup_ranks, request.num_expanded is not None)
        stats = request.stats
        launch = _EXPERT_LAYOUT(
            shape.grid, setup,
            # The kernel's argument groups, in its order.
            (exchange, send_pos, request.handle.recv_src_idx, request.recv_topk_idx, request.recv_topk_weights,
             request.topk_idx, stats if stats is not None else self._no_stats,
             block, topk_copy, *changing[_TENSORS:], *shape.fixed_args),
            shape.constants, 4)
        if launch is not None and _repeats(changing) and launch.args[:_CHANGING] == list(changing):
            self._learnt[setup] = [launch, list(launch.args)]


# The per-call arguments: 9 tensors' addresses, then 6 ints.
_TENSORS, _CHANGING = 9, 15


def _repeats(changing: tuple) -> bool:
    """A learnt launch may take these per-call arguments: its pointers were 16-byte aligned
    (Triton specialises on it) and its ints, none specialised on, are 32-bit (Triton types
    larger ones as i64)."""
    return aligned(*changing[:_TENSORS]) and max(changing[_TENSORS:]) < 2**31
