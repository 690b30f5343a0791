"""Normal-mode dispatch over NVLink: push rows straight to their final row index.

After the count exchange every rank knows ``rank_prefix_matrix``, so it knows exactly where
each of its rows lands at each destination: block start (rows from lower ranks) plus the
row's position in its send list. There is no ring buffer and no flow control inside a call.
A fresh dispatch runs the kernel as two launches (``SEND``, ``RECEIVE``), which the engine
puts on two streams:

* **The send half** (``NUM_SENDERS`` programs) splits each peer's send list into
  ``NUM_SENDERS`` channels, gathers the rows from ``x`` and stores them into the peer's
  staging area at their final index. Every ``SIGNAL_EVERY`` tiles it publishes the channel's
  progress, ``(epoch << 32) | rows``, into the peer's signal area. It writes no output, so a
  fresh dispatch launches it before the host has read the counts back: rows move while the
  host sizes and allocates the outputs.
* **The receive half** (``NUM_RECEIVERS`` programs) gathers our own rows from ``x`` into the
  outputs, then follows the peers' progress counters, channel by channel, and copies arrived
  rows from staging into the outputs, overlapping the transfer. A fresh dispatch launches it
  too before the host has the counts, into outputs of a guessed size (``guard_word``): it then
  stands down when the host will raise or relaunch instead (``_receive_goes_ahead``).

When the counts are on the GPU before the call starts (a cached dispatch; a ``num_worst_tokens``
dispatch, which never reads them back) nothing runs between the halves, so one launch runs
both: senders first, then receivers (``SEND`` and ``RECEIVE``). It does on the GPU what the two
launches do, and spares the host a launch and the side stream's event records and waits.

Staging is reused by the next call, so before writing to a peer a sender waits until all
receiver programs of that peer finished the previous call: each receiver program adds one to
``dispatch_done`` at every source when it is done, and the host passes the total all earlier
calls will have added (``released_target``; the receiver count varies with num_sms). A
copy-engine receive's release is owed until this rank's next launch with senders: its first
program adds it (``release_due``) before any sender waits.
Top-k ids are turned into the destination's local expert ids on the way (-1 elsewhere,
weight 0), so receivers copy every row field verbatim.

**Copy-engine receive** (``COPY_RECEIVE``: ``Tuning.copy_engine_dispatch``, from 4 ranks by
default, for a cached dispatch whose counts the host knows). Receiving is a local copy from staging into the
outputs (same row index in both), which a receiver program does at ~25 GB/s while a copy engine
does ~1.9 TB/s, and SM stores push more to the peers with more programs (measured on 4 x H200:
24 sender programs ~307 GB/s, 12 ~215 GB/s). So the launch has only senders, all num_sms of
them: each stores its channel's rows at every destination, then adds one to the destination's
``dispatch_arrived`` word for this rank (also when its channel was empty, so each call adds
exactly ``NUM_SENDERS``; no tail words), then copies its share of our own rows from ``x`` into
the outputs. A side stream waits for every source's arrived count and moves the arrived rows and
small fields with device-to-device copies (``dispatch_copy_engine.py``); the staging is released
by this rank's next launch with senders (``release_due``), which runs after those copies.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tritonep.backends.nvlink.normal.handle_fields import receiver_fields
from tritonep.device.rows import block_count, block_start, channel_range, copy_rows
from tritonep.device.signals import add_release, publish, wait_at_least
from tritonep.device.status_codes import PHASE_DISPATCH_DATA, PHASE_DISPATCH_SLOT
from tritonep.runtime import kernel_names
from tritonep.runtime.launcher import FastLauncher


@triton.jit
def _load_topk(topk_idx_ptr, topk_weights_ptr, tokens, row_mask, destination, experts_per_rank,
               NUM_TOPK: tl.constexpr, TOPK_PAD: tl.constexpr):
    """The tile's top-k ids as ``destination``'s local expert ids (-1 elsewhere, weight 0)."""
    slots = tl.arange(0, TOPK_PAD)
    mask = row_mask[:, None] & (slots < NUM_TOPK)[None, :]
    src = tokens.to(tl.int64)[:, None] * NUM_TOPK + slots[None, :]
    experts = tl.load(topk_idx_ptr + src, mask=mask, other=-1)
    weights = tl.load(topk_weights_ptr + src, mask=mask, other=0.0)
    local = experts - destination * experts_per_rank
    here = (experts >= 0) & (local >= 0) & (local < experts_per_rank)
    return tl.where(here, local, -1), tl.where(here, weights, 0.0)


@triton.jit
def _store_fields(values, dst_ptr, dst_rows, row_mask, width, PAD: tl.constexpr):
    """dst[dst_rows[i], :width] = values[i, :width] (rows of ``width`` elements, ``PAD`` >= width)."""
    cols = tl.arange(0, PAD)
    mask = row_mask[:, None] & (cols < width)[None, :]
    tl.store(dst_ptr + dst_rows.to(tl.int64)[:, None] * width + cols[None, :], values, mask=mask)


@triton.jit
def _store_row_fields(scales, experts, weights, src, dst_scales, dst_idx, dst_weights, dst_src, dst_rows, mask,
                      scale_words, HAS_SCALES: tl.constexpr, HAS_TOPK: tl.constexpr, NUM_TOPK: tl.constexpr,
                      TOPK_PAD: tl.constexpr, SCALE_PAD: tl.constexpr):
    """A tile's small fields into rows ``dst_rows`` of their arrays: the scales and the top-k ids
    and weights where the call has them (None where it does not), then each row's source token.
    Both halves store them right after the tile's row words; the send half publishes the tile
    only after them."""
    if HAS_SCALES:
        _store_fields(scales, dst_scales, dst_rows, mask, scale_words, SCALE_PAD)
    if HAS_TOPK:
        _store_fields(experts, dst_idx, dst_rows, mask, NUM_TOPK, TOPK_PAD)
        _store_fields(weights, dst_weights, dst_rows, mask, NUM_TOPK, TOPK_PAD)
    tl.store(dst_src + dst_rows, src, mask=mask)


@triton.jit
def _send_rows(x_ptr, x_words, scales_ptr, scale_words, scale_token_stride, scale_col_stride, topk_idx_ptr,
               topk_weights_ptr, send_list, lo, hi, start, row_limit, destination, experts_per_rank, dst_x, dst_scales,
               dst_idx, dst_weights, dst_src, tail, stamp, PUBLISH: tl.constexpr, HAS_SCALES: tl.constexpr,
               HAS_TOPK: tl.constexpr, NUM_TOPK: tl.constexpr, TOPK_PAD: tl.constexpr, SCALE_PAD: tl.constexpr,
               ROWS: tl.constexpr, BLOCK: tl.constexpr, SIGNAL_EVERY: tl.constexpr):
    """Rows [lo, hi) of a send list, gathered from ``x`` into rows ``start + lo ...`` of the
    destination arrays (a peer's staging, or our own outputs); with ``PUBLISH`` the progress
    goes to ``tail`` every ``SIGNAL_EVERY`` tiles and at the end."""
    tiles = 0
    # Token ids are fetched one tile ahead, so each tile waits for one load latency, not two.
    next_tokens = tl.load(send_list + lo + tl.arange(0, ROWS), mask=lo + tl.arange(0, ROWS) < hi, other=0)
    for row0 in range(lo, hi, ROWS):
        rows = row0 + tl.arange(0, ROWS)
        dst_rows = start + rows
        mask = (rows < hi) & (dst_rows < row_limit)
        tokens = next_tokens
        next_tokens = tl.load(send_list + rows + ROWS, mask=rows + ROWS < hi, other=0)
        # The small fields are loaded before the row moves and stored after it: their load
        # latency hides behind the row's instead of adding to it, tile after tile.
        scales = None
        experts = None
        weights = None
        if HAS_SCALES:
            scale_cols = tl.arange(0, SCALE_PAD)
            scales = tl.load(scales_ptr + tokens.to(tl.int64)[:, None] * scale_token_stride
                             + scale_cols[None, :] * scale_col_stride,
                             mask=mask[:, None] & (scale_cols < scale_words)[None, :])
        if HAS_TOPK:
            experts, weights = _load_topk(topk_idx_ptr, topk_weights_ptr, tokens, mask, destination,
                                          experts_per_rank, NUM_TOPK, TOPK_PAD)
        copy_rows(x_ptr, tokens, x_words, 1, dst_x, dst_rows, mask, x_words, BLOCK, False)
        _store_row_fields(scales, experts, weights, tokens, dst_scales, dst_idx, dst_weights, dst_src, dst_rows, mask,
                          scale_words, HAS_SCALES, HAS_TOPK, NUM_TOPK, TOPK_PAD, SCALE_PAD)
        tiles += 1
        if PUBLISH & (tiles % SIGNAL_EVERY == 0):
            publish(tail, stamp + tl.minimum(row0 + ROWS, hi) - lo)
    if PUBLISH & (hi > lo):
        publish(tail, stamp + hi - lo)


@triton.jit
def _copy_own_rows(x_ptr, x_words, scales_ptr, scale_words, scale_token_stride, scale_col_stride, topk_idx_ptr,
                   topk_weights_ptr, token_list_ptr, token_list_stride, prefix_ptr, out_x_ptr, out_scales_ptr,
                   out_idx_ptr, out_weights_ptr, out_src_ptr, num_out_rows, rank, experts_per_rank, my_signals, stamp,
                   channel, NUM_CHANNELS: tl.constexpr, NUM_RANKS: tl.constexpr, HAS_SCALES: tl.constexpr,
                   HAS_TOPK: tl.constexpr, NUM_TOPK: tl.constexpr, TOPK_PAD: tl.constexpr, SCALE_PAD: tl.constexpr,
                   ROWS: tl.constexpr, BLOCK: tl.constexpr, SIGNAL_EVERY: tl.constexpr):
    """Channel ``channel`` of ``NUM_CHANNELS``'s share of our own rows, straight from ``x`` into
    the outputs (no wait, no signal)."""
    start = block_start(prefix_ptr, rank, rank, NUM_RANKS)
    lo, hi = channel_range(block_count(prefix_ptr, rank, rank, NUM_RANKS), channel, NUM_CHANNELS)
    _send_rows(x_ptr, x_words, scales_ptr, scale_words, scale_token_stride, scale_col_stride, topk_idx_ptr,
               topk_weights_ptr, token_list_ptr + rank * token_list_stride, lo, hi, start, num_out_rows, rank,
               experts_per_rank, out_x_ptr, out_scales_ptr, out_idx_ptr, out_weights_ptr, out_src_ptr,
               my_signals, stamp, False, HAS_SCALES, HAS_TOPK, NUM_TOPK, TOPK_PAD, SCALE_PAD, ROWS, BLOCK,
               SIGNAL_EVERY)


@triton.jit
def _receive_goes_ahead(prefix_ptr, guard_word, num_out_rows, capacity, rank, NUM_RANKS: tl.constexpr):
    """Whether a receive launched before the host read the counts may run. ``guard_word`` (0:
    no guard) indexes, past ``rank_prefix_matrix`` in the exchange's result, its two check
    words (ranks that disagree, out-of-range ids). The host raises if either is set or if any
    rank receives more rows than staging holds, and relaunches if this rank receives more
    rows than the guessed outputs hold: in each case this launch copies and releases nothing,
    so the staging accounting (``released_target``) counts only the launch that runs."""
    go = guard_word == 0
    if guard_word > 0:
        received = prefix_ptr + (NUM_RANKS - 1) * NUM_RANKS   # the last row: rows each rank receives
        most = tl.load(received)
        for destination in tl.static_range(1, NUM_RANKS):
            most = tl.maximum(most, tl.load(received + destination))
        problems = tl.load(prefix_ptr + guard_word) + tl.load(prefix_ptr + guard_word + 1)
        go = (problems == 0) & (most <= capacity) & (tl.load(received + rank) <= num_out_rows)
    return go


@kernel_names.jit("tritonep::intranode::dispatch",
                  do_not_specialize=["rank", "epoch", "released_target", "release_due", "experts_per_rank",
                                     "num_out_rows", "guard_word", "capacity", "timeout_ns", "scale_words",
                                     "token_list_stride", "num_tokens", "num_max_tokens", "alignment", "has_stats",
                                     "copy_topk"])
def dispatch_kernel(
    # Inputs: the rows as 4-byte words, their scales (any strides; x where absent), the top-k ids
    # and weights (x where absent), and the experts per rank that turn ids into local ones.
    x_ptr, x_words, scales_ptr, scale_words, scale_token_stride, scale_col_stride, topk_idx_ptr, topk_weights_ptr,
    experts_per_rank,
    # Send plan: each rank's token list (notify_kernel.py) and rank_prefix_matrix.
    token_list_ptr, token_list_stride, prefix_ptr,
    # Outputs, ``num_out_rows`` rows of each (the send half gets placeholders), and the guard of a
    # receive launched before the host read the counts (``_receive_goes_ahead``).
    out_x_ptr, out_scales_ptr, out_idx_ptr, out_weights_ptr, out_src_ptr, num_out_rows, guard_word,
    # V2's handle fields, written by the receivers with ``LAYOUT`` (handle_fields.py): their block,
    # the copy of topk_idx, the caller's running stats, the send plan's positions, this rank's
    # tokens, T, the expert alignment and two flags (placeholders and zeros otherwise).
    fields_ptr, topk_copy_ptr, stats_ptr, send_pos_ptr, num_tokens, num_max_tokens, alignment, has_stats, copy_topk,
    # Staging area: every rank's allocation, this rank, the byte offsets of the regions of each row
    # field (memory.StagingLayout) and the rows they hold.
    peer_base_ptrs, rank, staging_x, staging_scales, staging_idx, staging_weights, staging_src, capacity,
    # Call counters: this call's epoch, the receiver programs all earlier calls counted, and the
    # copy-engine receives' releases this rank still owes every source (added by the senders).
    epoch, released_target, release_due,
    # Status: where a wait that gives up reports (pinned host memory), and after how long.
    status_ptr, timeout_ns,
    # Signal words, program roles, row fields, tile shape.
    TAIL_WORD: tl.constexpr, DONE_WORD: tl.constexpr, ARRIVED_WORD: tl.constexpr, MAX_CHANNELS: tl.constexpr,
    NUM_RANKS: tl.constexpr, NUM_SENDERS: tl.constexpr, NUM_RECEIVERS: tl.constexpr, SEND: tl.constexpr,
    RECEIVE: tl.constexpr, COPY_RECEIVE: tl.constexpr, HAS_SCALES: tl.constexpr, HAS_TOPK: tl.constexpr,
    NUM_TOPK: tl.constexpr, TOPK_PAD: tl.constexpr, SCALE_PAD: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
    SIGNAL_EVERY: tl.constexpr, GPU: tl.constexpr,
    # V2's handle fields (``LAYOUT``; ``PAD_ROWS``: worst-case outputs, whose rows past the received
    # ones the receivers fill with empty values) and their shapes.
    LAYOUT: tl.constexpr, PAD_ROWS: tl.constexpr, RANKS_PAD: tl.constexpr, SCALEUP_RANKS: tl.constexpr,
    SCALEUP_PAD: tl.constexpr, EXPERTS_PAD: tl.constexpr, META_PAD: tl.constexpr,
):
    """One launch of ``NUM_SENDERS`` programs (``SEND``), of ``NUM_RECEIVERS`` (``RECEIVE``), or
    of both, senders first (``SEND`` and ``RECEIVE``); with ``COPY_RECEIVE`` (and ``SEND`` alone)
    the senders also count themselves in ``ARRIVED_WORD`` and copy our own rows. With ``LAYOUT``
    the receivers also write V2's handle fields (``handle_fields.receiver_fields``)."""
    pid = tl.program_id(0)
    my_signals = tl.load(peer_base_ptrs + rank).to(tl.pointer_type(tl.int64))
    stamp = epoch.to(tl.int64) << 32
    if SEND and RECEIVE:   # (decided when compiling: each launch compiles only the roles it runs)
        sending = pid < NUM_SENDERS
        pid = tl.where(sending, pid, pid - NUM_SENDERS)
    else:
        sending = SEND
    if sending:
        if (tl.program_id(0) == 0) & (release_due > 0):
            # Before any wait of ours: a peer's senders may be waiting for it. (The copies that
            # read the staging came before this launch on the stream.)
            release_staging(peer_base_ptrs, rank, release_due, DONE_WORD, NUM_RANKS)
        for step in range(0, NUM_RANKS - 1):
            # Rotated, so that the programs of all ranks spread over the links.
            destination = (rank + 1 + step) % NUM_RANKS
            start = block_start(prefix_ptr, rank, destination, NUM_RANKS)
            lo, hi = channel_range(block_count(prefix_ptr, rank, destination, NUM_RANKS), pid, NUM_SENDERS)
            peer_base = tl.load(peer_base_ptrs + destination)
            if hi > lo:
                wait_at_least(my_signals + DONE_WORD + destination, released_target.to(tl.int64),
                              status_ptr, timeout_ns, PHASE_DISPATCH_SLOT, destination, GPU)
            # Staging starts on a 4096-byte boundary: rows move in 16-byte vectors.
            _send_rows(x_ptr, x_words, scales_ptr, scale_words, scale_token_stride, scale_col_stride, topk_idx_ptr,
                       topk_weights_ptr, token_list_ptr + destination * token_list_stride, lo, hi, start, capacity,
                       destination, experts_per_rank,
                       tl.multiple_of((peer_base + staging_x).to(tl.pointer_type(tl.int32)), 16),
                       (peer_base + staging_scales).to(tl.pointer_type(tl.int32)),
                       (peer_base + staging_idx).to(tl.pointer_type(tl.int64)),
                       (peer_base + staging_weights).to(tl.pointer_type(tl.float32)),
                       (peer_base + staging_src).to(tl.pointer_type(tl.int32)),
                       peer_base.to(tl.pointer_type(tl.int64)) + TAIL_WORD + rank * MAX_CHANNELS + pid, stamp,
                       not COPY_RECEIVE, HAS_SCALES, HAS_TOPK, NUM_TOPK, TOPK_PAD, SCALE_PAD, ROWS, BLOCK,
                       SIGNAL_EVERY)
            if COPY_RECEIVE:
                # Counted with or without rows: the peer's copy of our block waits for exactly
                # NUM_SENDERS of these per call.
                add_release(peer_base.to(tl.pointer_type(tl.int64)) + ARRIVED_WORD + rank, 1)
        if COPY_RECEIVE:   # (after the peers' rows: they are on the critical path, ours are not)
            _copy_own_rows(x_ptr, x_words, scales_ptr, scale_words, scale_token_stride, scale_col_stride,
                           topk_idx_ptr, topk_weights_ptr, token_list_ptr, token_list_stride, prefix_ptr, out_x_ptr,
                           out_scales_ptr, out_idx_ptr, out_weights_ptr, out_src_ptr, num_out_rows, rank,
                           experts_per_rank, my_signals, stamp, pid, NUM_SENDERS, NUM_RANKS, HAS_SCALES, HAS_TOPK,
                           NUM_TOPK, TOPK_PAD, SCALE_PAD, ROWS, BLOCK, SIGNAL_EVERY)
    elif _receive_goes_ahead(prefix_ptr, guard_word, num_out_rows, capacity, rank, NUM_RANKS):
        # Our own rows first (no wait: straight from x into the outputs), then the arrived rows.
        _copy_own_rows(x_ptr, x_words, scales_ptr, scale_words, scale_token_stride, scale_col_stride, topk_idx_ptr,
                       topk_weights_ptr, token_list_ptr, token_list_stride, prefix_ptr, out_x_ptr, out_scales_ptr,
                       out_idx_ptr, out_weights_ptr, out_src_ptr, num_out_rows, rank, experts_per_rank, my_signals,
                       stamp, pid, NUM_RECEIVERS, NUM_RANKS, HAS_SCALES, HAS_TOPK, NUM_TOPK, TOPK_PAD, SCALE_PAD,
                       ROWS, BLOCK, SIGNAL_EVERY)
        for channel in range(pid, (NUM_RANKS - 1) * NUM_SENDERS, NUM_RECEIVERS):
            source = (rank + 1 + channel // NUM_SENDERS) % NUM_RANKS
            sender = channel % NUM_SENDERS
            start = block_start(prefix_ptr, source, rank, NUM_RANKS)
            lo, hi = channel_range(block_count(prefix_ptr, source, rank, NUM_RANKS), sender, NUM_SENDERS)
            tail = my_signals + TAIL_WORD + source * MAX_CHANNELS + sender
            done = 0
            while done < hi - lo:
                # Wait for the next value the sender publishes (every SIGNAL_EVERY tiles, and at
                # the end), not for "whatever has arrived": every thread reads the counter for
                # itself, so bounds taken from what each one saw can differ between threads, and
                # this loop holds CTA barriers (the one ending every wait) that all threads must
                # pass equally often. With per-thread bounds a program could release the peer's
                # staging while some of its threads were still copying from it (rarely, wrong
                # scales in the output).
                arrived = tl.minimum(done + ROWS * SIGNAL_EVERY, hi - lo)
                seen = wait_at_least(tail, stamp + arrived, status_ptr, timeout_ns, PHASE_DISPATCH_DATA, source, GPU)
                # A timed-out wait returns far above any count: give up on the channel rather
                # than time out again at every step (the host raises at the next call).
                arrived = tl.where(seen - stamp > (1 << 55), hi - lo, arrived)
                for row0 in range(start + lo + done, start + lo + arrived, ROWS):
                    rows = row0 + tl.arange(0, ROWS)
                    mask = (rows < start + lo + arrived) & (rows < num_out_rows)
                    copy_staged_row_fields(my_signals, staging_x, staging_scales, staging_idx, staging_weights,
                                           staging_src, rows, mask, out_x_ptr, out_scales_ptr, out_idx_ptr,
                                           out_weights_ptr, out_src_ptr, x_words, scale_words,
                                           HAS_SCALES, HAS_TOPK, NUM_TOPK, TOPK_PAD, SCALE_PAD, BLOCK)
                done = arrived
        # Our reads of staging are done: let every source reuse it in its next call.
        release_staging(peer_base_ptrs, rank, 1, DONE_WORD, NUM_RANKS)
        if LAYOUT:
            receiver_fields(pid, prefix_ptr, send_pos_ptr, topk_idx_ptr, stats_ptr, fields_ptr, topk_copy_ptr,
                            out_idx_ptr, out_weights_ptr, out_src_ptr, num_out_rows, num_tokens, num_max_tokens, rank,
                            experts_per_rank, alignment, has_stats, copy_topk, NUM_SENDERS, NUM_RECEIVERS, NUM_RANKS,
                            RANKS_PAD, SCALEUP_RANKS, SCALEUP_PAD, EXPERTS_PAD, NUM_TOPK, TOPK_PAD, META_PAD, PAD_ROWS)


@triton.jit
def release_staging(peer_base_ptrs, rank, count, DONE_WORD: tl.constexpr, NUM_RANKS: tl.constexpr):
    """Add ``count`` receivers to this rank's done word at every source: a source writes into our
    staging again once all the receivers its senders wait for are counted."""
    for step in range(0, NUM_RANKS - 1):
        source = (rank + 1 + step) % NUM_RANKS
        peer_signals = tl.load(peer_base_ptrs + source).to(tl.pointer_type(tl.int64))
        add_release(peer_signals + DONE_WORD + rank, count)


@triton.jit
def _load_staged_fields(region, rows, mask, width, PAD: tl.constexpr):
    """Rows ``rows`` of a staging region of ``width``-element rows (through L2: a peer wrote them)."""
    cols = tl.arange(0, PAD)
    return tl.load(region + rows.to(tl.int64)[:, None] * width + cols[None, :],
                   mask=mask[:, None] & (cols < width)[None, :], cache_modifier=".cg")


@triton.jit
def copy_staged_row_fields(my_signals, staging_x, staging_scales, staging_idx, staging_weights, staging_src,
                           rows, mask, out_x_ptr, out_scales_ptr, out_idx_ptr, out_weights_ptr, out_src_ptr,
                           x_words, scale_words, HAS_SCALES: tl.constexpr, HAS_TOPK: tl.constexpr,
                           NUM_TOPK: tl.constexpr, TOPK_PAD: tl.constexpr, SCALE_PAD: tl.constexpr,
                           BLOCK: tl.constexpr):
    """Staging rows ``rows`` of this rank (``my_signals``: its allocation) into the same rows of
    the outputs."""
    base = my_signals.to(tl.int64)
    # As in ``_send_rows``: the small fields' loads go out before the row moves.
    scales = None
    experts = None
    weights = None
    if HAS_SCALES:
        scales = _load_staged_fields((base + staging_scales).to(tl.pointer_type(tl.int32)), rows, mask,
                                     scale_words, SCALE_PAD)
    if HAS_TOPK:
        experts = _load_staged_fields((base + staging_idx).to(tl.pointer_type(tl.int64)), rows, mask,
                                      NUM_TOPK, TOPK_PAD)
        weights = _load_staged_fields((base + staging_weights).to(tl.pointer_type(tl.float32)), rows, mask,
                                      NUM_TOPK, TOPK_PAD)
    src = tl.load((base + staging_src).to(tl.pointer_type(tl.int32)) + rows, mask=mask, cache_modifier=".cg")
    copy_rows(tl.multiple_of((base + staging_x).to(tl.pointer_type(tl.int32)), 16), rows, x_words, 1, out_x_ptr,
              rows, mask, x_words, BLOCK, True)
    _store_row_fields(scales, experts, weights, src, out_scales_ptr, out_idx_ptr, out_weights_ptr, out_src_ptr, rows,
                      mask, scale_words, HAS_SCALES, HAS_TOPK, NUM_TOPK, TOPK_PAD, SCALE_PAD)


# A launch converts only these arguments per call; the others are fixed per Buffer and tuning
# or by the call's shape, which the setup key stands for (``shape.DispatchShape``).
_CHANGING = ("x_ptr", "scales_ptr", "scale_token_stride", "scale_col_stride", "topk_idx_ptr", "topk_weights_ptr",
             "token_list_ptr", "token_list_stride", "prefix_ptr", "out_x_ptr", "out_scales_ptr", "out_idx_ptr",
             "out_weights_ptr", "out_src_ptr", "num_out_rows", "guard_word", "epoch", "released_target",
             "release_due")
DISPATCH = FastLauncher(dispatch_kernel, changing=_CHANGING)
# A V2 fresh dispatch's launches (``LAYOUT``): the handle fields' arguments change per call too
# (elsewhere they are placeholders, fixed per engine); T, the alignment and the two flags, fixed
# per setup, do not.
DISPATCH_WITH_FIELDS = FastLauncher(dispatch_kernel, changing=_CHANGING + (
    "fields_ptr", "topk_copy_ptr", "stats_ptr", "send_pos_ptr", "num_tokens"))
