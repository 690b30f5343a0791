"""Moving whole rows: the one copy loop every NVLink kernel shares.

A tile is ``ROWS`` rows by ``BLOCK`` columns; rows are addressed by index vectors so the same
loop serves a gather (sender: rows picked by ``token_list``) and a contiguous copy (receiver:
staging rows to output rows). Several rows per tile keep enough loads in flight per program
to stream at NVLink speed with few programs. ``lane_column`` reads one lane of a [rows, lanes]
tile (the ranks or nodes a row's copies sit at), for kernels that sum a row's copies.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def copy_rows(src_ptr, src_rows, src_row_stride, src_col_stride, dst_ptr, dst_rows, row_mask, width,
              BLOCK: tl.constexpr, STAGING_SOURCE: tl.constexpr):
    """dst[dst_rows[i], :width] = src[src_rows[i], :width] for rows where ``row_mask``.

    ``dst`` rows are contiguous with stride ``width``. ``STAGING_SOURCE`` reads through L2
    only (``.cg``): the rows were written by a peer GPU and must not come from a stale L1 line.
    """
    src_base = src_ptr + src_rows.to(tl.int64)[:, None] * src_row_stride
    dst_base = dst_ptr + dst_rows.to(tl.int64)[:, None] * width
    for c0 in range(0, width, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        mask = row_mask[:, None] & (cols < width)[None, :]
        if STAGING_SOURCE:
            values = tl.load(src_base + cols[None, :] * src_col_stride, mask=mask, cache_modifier=".cg")
        else:
            values = tl.load(src_base + cols[None, :] * src_col_stride, mask=mask)
        tl.store(dst_base + cols[None, :], values, mask=mask)


@triton.jit
def block_start(prefix_ptr, source, destination, NUM_RANKS: tl.constexpr):
    """First row of ``source``'s block at ``destination`` (from ``rank_prefix_matrix``)."""
    return tl.load(prefix_ptr + (source - 1) * NUM_RANKS + destination, mask=source > 0, other=0)


@triton.jit
def block_count(prefix_ptr, source, destination, NUM_RANKS: tl.constexpr):
    """Rows ``source`` sends to ``destination``."""
    end = tl.load(prefix_ptr + source * NUM_RANKS + destination)
    return end - block_start(prefix_ptr, source, destination, NUM_RANKS)


@triton.jit
def channel_range(count, channel, NUM_CHANNELS: tl.constexpr):
    """Rows [lo, hi) of a ``count``-row block that channel ``channel`` of ``NUM_CHANNELS`` moves."""
    chunk = tl.cdiv(count, NUM_CHANNELS)
    lo = tl.minimum(channel * chunk, count)
    hi = tl.minimum(lo + chunk, count)
    return lo, hi


@triton.jit
def lane_column(tile, present, lanes, lane):
    """Column ``lane`` of a [rows, lanes] int tile, as [rows], and whether each row's entry there
    is ``present`` (a [rows, lanes] bool tile). ``lanes``: the tile's lane indices. A tile has
    no column index, so the column is picked with a reduction over the lanes, in registers."""
    pick = lanes[None, :] == lane
    here = tl.sum(tl.where(pick & present, 1, 0), axis=1) > 0
    return tl.sum(tl.where(pick, tile, 0), axis=1), here
