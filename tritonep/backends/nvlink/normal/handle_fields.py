"""The device arithmetic of DeepEP V2's handle fields (``core/expert_layout.py`` defines them),
shared by the two launches that write them: a V2 fresh dispatch's own receivers
(``dispatch_kernel.py``, ``LAYOUT``: ``receiver_fields``) and, for the expanded layout, the
expert-layout kernel (``expert_layout_kernel.py``).

The fields share one int32 block, placed as ``LayoutSizes.offsets`` places them: the per-expert
and per-scale-up vectors, then each token's destination rows, then each received row's source
metadata, then the expanded layout's fields. Everything before the metadata depends only on the
call's shape, not on the rows received, so a dispatch launched before its host knows how many
rows arrive can write every field into a block sized for a guess.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tritonep.device.rows import block_count, block_start, channel_range


@triton.jit
def aligned_counts(counts, alignment):
    return (counts + alignment - 1) // alignment * alignment


@triton.jit
def field_pointers(fields_ptr, num_rows, num_tokens, num_expanded, experts_per_rank, SCALEUP_RANKS: tl.constexpr,
                   NUM_TOPK: tl.constexpr):
    """Each field's place in the block (``LayoutSizes.offsets``): counts, psum_per_expert,
    psum_per_scaleup_rank, dst_buffer_slot_idx, recv_src_metadata, then the expanded layout's
    slots, source rows and weights (used only when the block holds them)."""
    psum_expert_ptr = fields_ptr + experts_per_rank
    psum_scaleup_ptr = psum_expert_ptr + experts_per_rank
    dst_ptr = psum_scaleup_ptr + SCALEUP_RANKS
    metadata_ptr = dst_ptr + num_tokens.to(tl.int64) * NUM_TOPK
    slots_ptr = metadata_ptr + num_rows.to(tl.int64) * (NUM_TOPK + 2)
    source_ptr = slots_ptr + num_rows.to(tl.int64) * NUM_TOPK
    weights_ptr = (source_ptr + num_expanded).to(tl.pointer_type(tl.float32), bitcast=True)
    return fields_ptr, psum_expert_ptr, psum_scaleup_ptr, dst_ptr, metadata_ptr, slots_ptr, source_ptr, weights_ptr


@triton.jit
def expert_vectors(exchange_ptr, stats_ptr, counts_ptr, psum_expert_ptr, psum_scaleup_ptr, has_stats, rank,
                   experts_per_rank, alignment, NUM_RANKS: tl.constexpr, RANKS_PAD: tl.constexpr,
                   SCALEUP_RANKS: tl.constexpr, SCALEUP_PAD: tl.constexpr, EXPERTS_PAD: tl.constexpr,
                   EXPAND: tl.constexpr):
    """The per-expert vectors (and the caller's running stats) and the prefix sums per scale-up
    rank, from the count exchange's result alone. One program runs it: no other touches the stats."""
    experts = tl.arange(0, EXPERTS_PAD)
    expert_mask = experts < experts_per_rank
    counts = tl.load(exchange_ptr + NUM_RANKS * NUM_RANKS + experts, mask=expert_mask, other=0)
    tl.store(counts_ptr + experts, counts, mask=expert_mask)
    aligned = aligned_counts(counts, alignment)
    ends = tl.cumsum(aligned, axis=0)
    if EXPAND:   # the expert's aligned start plus its count
        tl.store(psum_expert_ptr + experts, ends - aligned + counts, mask=expert_mask)
    else:
        tl.store(psum_expert_ptr + experts, ends, mask=expert_mask)
    if has_stats:
        stats = tl.load(stats_ptr + experts, mask=expert_mask, other=0)
        tl.store(stats_ptr + experts, stats + counts, mask=expert_mask)
    # Rows from each source (rank_prefix_matrix's column), summed over the sources of each
    # scale-up index up to u.
    sources = tl.arange(0, RANKS_PAD)
    source_mask = sources < NUM_RANKS
    from_source = tl.load(exchange_ptr + sources * NUM_RANKS + rank, mask=source_mask, other=0) - tl.load(
        exchange_ptr + (sources - 1) * NUM_RANKS + rank, mask=source_mask & (sources > 0), other=0)
    units = tl.arange(0, SCALEUP_PAD)
    grouped = tl.where(((sources % SCALEUP_RANKS)[None, :] <= units[:, None]) & source_mask[None, :],
                       from_source[None, :], 0)
    tl.store(psum_scaleup_ptr + units, tl.sum(grouped, axis=1), mask=units < SCALEUP_RANKS)


@triton.jit
def first_local_k(experts, NUM_TOPK: tl.constexpr, TOPK_PAD: tl.constexpr):
    """Per row of local expert ids (-1 elsewhere; lanes past NUM_TOPK ignored), the first k
    whose expert is local, 0 if none (as argmax gives: V2's "master" lane)."""
    ks = tl.arange(0, TOPK_PAD)
    local = (experts >= 0) & (ks < NUM_TOPK)[None, :]
    first = tl.min(tl.where(local, ks[None, :], TOPK_PAD), axis=1)
    return tl.where(first < NUM_TOPK, first, 0)


@triton.jit
def store_metadata(metadata_ptr, rows, mask, source_rank, src_token, first_k, num_max_tokens, NUM_TOPK: tl.constexpr,
                   META_PAD: tl.constexpr):
    """``recv_src_metadata`` of received rows ``rows`` that came from ``source_rank`` (a scalar or
    one per row): source rank * T + source token, source rank * K + the first local k, then -1
    for each k (the non-expanded layout's)."""
    cols = tl.arange(0, META_PAD)
    first = (source_rank * num_max_tokens + src_token)[:, None]
    second = (source_rank * NUM_TOPK + first_k)[:, None]
    values = tl.where(cols[None, :] == 0, first, tl.where(cols[None, :] == 1, second, -1))
    tl.store(metadata_ptr + rows.to(tl.int64)[:, None] * (NUM_TOPK + 2) + cols[None, :], values,
             mask=mask[:, None] & (cols < NUM_TOPK + 2)[None, :])


@triton.jit
def token_fields(program, num_programs, exchange_ptr, send_pos_ptr, topk_idx_ptr, dst_ptr, topk_copy_ptr, copy_topk,
                 num_tokens, rank, experts_per_rank, NUM_RANKS: tl.constexpr, NUM_TOPK: tl.constexpr,
                 TOPK_PAD: tl.constexpr, BLOCK_TOKENS: tl.constexpr):
    """This rank's tokens, ``num_programs`` programs striding over them: the row each (token, k)
    lands on at its expert's rank, and the copy of ``topk_idx``."""
    ks = tl.arange(0, TOPK_PAD)
    for t0 in range(program * BLOCK_TOKENS, num_tokens, num_programs * BLOCK_TOKENS):
        tokens = t0 + tl.arange(0, BLOCK_TOKENS)
        mask = (tokens < num_tokens)[:, None] & (ks < NUM_TOPK)[None, :]
        offsets = tokens.to(tl.int64)[:, None] * NUM_TOPK + ks[None, :]
        ids = tl.load(topk_idx_ptr + offsets, mask=mask, other=-1)
        tl.store(topk_copy_ptr + offsets, ids, mask=mask & (copy_topk != 0))
        valid = ids >= 0
        dest = tl.where(valid, ids // experts_per_rank, 0)
        # Rows from lower ranks come first at dest (rank_prefix_matrix[rank - 1, dest]), then
        # this rank's in token order: the token's place among those sent to dest.
        before = tl.load(exchange_ptr + (rank - 1) * NUM_RANKS + dest, mask=mask & valid & (rank > 0), other=0)
        place = tl.load(send_pos_ptr + tokens.to(tl.int64)[:, None] * NUM_RANKS + dest, mask=mask & valid, other=0)
        tl.store(dst_ptr + offsets, tl.where(valid, before + place, -1), mask=mask)


@triton.jit
def padding_rows(program, num_programs, first_row, num_rows, recv_src_ptr, recv_idx_ptr, recv_weights_ptr,
                 metadata_ptr, NUM_TOPK: tl.constexpr, TOPK_PAD: tl.constexpr, META_PAD: tl.constexpr,
                 BLOCK_ROWS: tl.constexpr):
    """Rows ``first_row`` to ``num_rows`` of worst-case outputs, which no row arrives into: their
    empty values (source -1, expert -1, weight 0, metadata -1)."""
    ks = tl.arange(0, TOPK_PAD)
    cols = tl.arange(0, META_PAD)
    for r0 in range(first_row + program * BLOCK_ROWS, num_rows, num_programs * BLOCK_ROWS):
        rows = r0 + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < num_rows
        pairs = rows.to(tl.int64)[:, None] * NUM_TOPK + ks[None, :]
        pair_mask = row_mask[:, None] & (ks < NUM_TOPK)[None, :]
        tl.store(recv_src_ptr + rows, -1, mask=row_mask)
        tl.store(recv_idx_ptr + pairs, -1, mask=pair_mask)
        tl.store(recv_weights_ptr + pairs, 0.0, mask=pair_mask)
        tl.store(metadata_ptr + rows.to(tl.int64)[:, None] * (NUM_TOPK + 2) + cols[None, :], -1,
                 mask=row_mask[:, None] & (cols < NUM_TOPK + 2)[None, :])


# Rows (tokens) per step of the handle fields' loops.
FIELD_BLOCK = tl.constexpr(128)


@triton.jit
def _rows_metadata(first_row, last_row, source, out_idx_ptr, out_src_ptr, metadata_ptr, num_max_tokens,
                   NUM_TOPK: tl.constexpr, TOPK_PAD: tl.constexpr, META_PAD: tl.constexpr):
    """V2's source metadata of output rows [first_row, last_row), which this program wrote and
    which came from ``source``, read back from the outputs."""
    ks = tl.arange(0, TOPK_PAD)
    for r0 in range(first_row, last_row, FIELD_BLOCK):
        rows = r0 + tl.arange(0, FIELD_BLOCK)
        mask = rows < last_row
        ids = tl.load(out_idx_ptr + rows.to(tl.int64)[:, None] * NUM_TOPK + ks[None, :],
                      mask=mask[:, None] & (ks < NUM_TOPK)[None, :], other=-1)
        src = tl.load(out_src_ptr + rows, mask=mask, other=0)
        store_metadata(metadata_ptr, rows, mask, source, src, first_local_k(ids, NUM_TOPK, TOPK_PAD), num_max_tokens,
                       NUM_TOPK, META_PAD)


@triton.jit
def receiver_fields(pid, prefix_ptr, send_pos_ptr, topk_idx_ptr, stats_ptr, fields_ptr, topk_copy_ptr, out_idx_ptr,
                    out_weights_ptr, out_src_ptr, num_out_rows, num_tokens, num_max_tokens, rank, experts_per_rank,
                    alignment, has_stats, copy_topk, NUM_SENDERS: tl.constexpr, NUM_RECEIVERS: tl.constexpr,
                    NUM_RANKS: tl.constexpr, RANKS_PAD: tl.constexpr, SCALEUP_RANKS: tl.constexpr,
                    SCALEUP_PAD: tl.constexpr, EXPERTS_PAD: tl.constexpr, NUM_TOPK: tl.constexpr,
                    TOPK_PAD: tl.constexpr, META_PAD: tl.constexpr, PAD_ROWS: tl.constexpr):
    """V2's handle fields, by a receiver program of the dispatch kernel (``LAYOUT``) once its rows
    are in and its reads of staging released: the metadata of the rows it copied (its share of
    our own rows and its channels' rows, split as ``dispatch_kernel`` splits them, read back from
    the outputs), its share of our tokens' destination rows, of the copy of topk_idx and of the
    empty rows of worst-case outputs, and on receiver 0 the per-expert vectors. Apart from the
    copy loop, so that the rows' path keeps its registers. The count exchange's result starts with
    ``rank_prefix_matrix`` (``prefix_ptr``), then the per-expert counts."""
    counts_ptr, psum_expert_ptr, psum_scaleup_ptr, dst_ptr, metadata_ptr, _, _, _ = field_pointers(
        fields_ptr, num_out_rows, num_tokens, num_out_rows, experts_per_rank, SCALEUP_RANKS, NUM_TOPK)
    tl.debug_barrier()   # the program's other threads wrote some of the rows read back here
    start = block_start(prefix_ptr, rank, rank, NUM_RANKS)
    lo, hi = channel_range(block_count(prefix_ptr, rank, rank, NUM_RANKS), pid, NUM_RECEIVERS)
    _rows_metadata(start + lo, start + hi, rank, out_idx_ptr, out_src_ptr, metadata_ptr, num_max_tokens, NUM_TOPK,
                   TOPK_PAD, META_PAD)
    for channel in range(pid, (NUM_RANKS - 1) * NUM_SENDERS, NUM_RECEIVERS):
        source = (rank + 1 + channel // NUM_SENDERS) % NUM_RANKS
        start = block_start(prefix_ptr, source, rank, NUM_RANKS)
        lo, hi = channel_range(block_count(prefix_ptr, source, rank, NUM_RANKS), channel % NUM_SENDERS, NUM_SENDERS)
        _rows_metadata(start + lo, start + hi, source, out_idx_ptr, out_src_ptr, metadata_ptr, num_max_tokens,
                       NUM_TOPK, TOPK_PAD, META_PAD)
    if pid == 0:
        expert_vectors(prefix_ptr, stats_ptr, counts_ptr, psum_expert_ptr, psum_scaleup_ptr, has_stats, rank,
                       experts_per_rank, alignment, NUM_RANKS, RANKS_PAD, SCALEUP_RANKS, SCALEUP_PAD, EXPERTS_PAD,
                       False)
    token_fields(pid, NUM_RECEIVERS, prefix_ptr, send_pos_ptr, topk_idx_ptr, dst_ptr, topk_copy_ptr, copy_topk,
                 num_tokens, rank, experts_per_rank, NUM_RANKS, NUM_TOPK, TOPK_PAD, FIELD_BLOCK)
    if PAD_ROWS:
        received = tl.load(prefix_ptr + (NUM_RANKS - 1) * NUM_RANKS + rank)
        padding_rows(pid, NUM_RECEIVERS, received, num_out_rows, out_src_ptr, out_idx_ptr, out_weights_ptr,
                     metadata_ptr, NUM_TOPK, TOPK_PAD, META_PAD, FIELD_BLOCK)
