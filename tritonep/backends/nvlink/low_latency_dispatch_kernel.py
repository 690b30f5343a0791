"""Low-latency dispatch over NVLink: one kernel, no host synchronisation, CUDA-graph safe.

Send (``DO_SEND``): program p takes global experts p, p+P, ... For expert g it picks, from
``topk_idx``, the (token, k) pairs routed to g in token order, casts those rows to fp8 on the
fly (or keeps bf16) and writes them as messages into g's rank, at the fixed block
``[local expert, source = us, 0..count)`` of the current receive slot. Fixed blocks mean no
slot has to be reserved with a remote atomic: a sender knows where every row goes. After all
its experts, one system fence, then ``(use << 32) | count`` into each expert's flag at its
rank (relaxed stores: no round trip per expert).

Receive (``DO_RECV``): program p takes (local expert e, source s) items p, p+P, ... It waits
for the R flags of e at once, and copies s's messages into the packed outputs right after
the lower sources' rows (so rows are ordered by source rank, then token, like the CPU
backend), writing ``src_info``, ``layout_range``, the count, and the stats.

Calls alternate between two receive slots (the host picks one per call) and the GPU counts
the uses of each slot (``SEQUENCE`` words, bumped by the launch's last program), so replaying
a captured graph keeps counting and hooks may run in any order. A sender starting use n of a
slot first waits until every destination has finished receiving the last use in which this
rank wrote into it, use n-1 unless masks skipped it (``DISPATCH_FREED``, ``SENT_USE``).
With ``return_recv_hook`` the two halves are two launches; otherwise one launch does both
(all programs are resident, so receivers may wait for senders of the same launch).

Shrink mode (``HAS_MASK``): the send reads this rank's mask (``mask_ptr``) and program 0
copies it into the handle (``saved_mask_ptr``); the receive uses that copy, so a dispatch
whose hook runs after a mask update still uses one mask, and so does its combine. Nothing is
written into a masked rank (no rows, no flags, no "slot freed" word) and nothing is awaited
from it: its layout_range entries and counts are 0.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import low_latency_layout as layout
from .fp8_tiles import cast_rows_to_messages, pack_bytes
from .rows import copy_rows
from .sync import (
    PHASE_LL_DISPATCH_DATA,
    PHASE_LL_DISPATCH_SLOT,
    begin_low_latency_send,
    fence_system,
    finish_low_latency_launch,
    gave_up,
    load_acquire,
    load_rank_mask,
    now_ns,
    rank_masked,
    save_rank_mask,
    store_relaxed,
    wait_all_at_least,
)

SEQUENCE_SENT = tl.constexpr(layout.SEQUENCE + 0)
SEQUENCE_RECEIVED = tl.constexpr(layout.SEQUENCE + 2)
DONE_SEND = tl.constexpr(layout.DONE + 0)
DONE_RECEIVE = tl.constexpr(layout.DONE + 1)
MAX_RANKS = tl.constexpr(layout.MAX_RANKS)
MAX_EXPERTS = tl.constexpr(layout.MAX_EXPERTS)  # flag slots are this far apart, whatever E a call has
FREED = tl.constexpr(layout.DISPATCH_FREED)
FLAGS = tl.constexpr(layout.DISPATCH_FLAGS)
SENT_USE = tl.constexpr(layout.SENT_USE + 0)
LOW_32_BITS = tl.constexpr(0xFFFFFFFF)
CONTROL_BYTES = tl.constexpr(layout.CONTROL_BYTES)


@triton.jit
def _send_expert(x_ptr, x_row_stride, pairs, routed, position, count, message_block,
                 NUM_TOPK: tl.constexpr, HIDDEN: tl.constexpr, HIDDEN_PAD: tl.constexpr, USE_FP8: tl.constexpr,
                 ROUND_SCALE: tl.constexpr, DATA_WORDS: tl.constexpr, SCALE_WORDS: tl.constexpr,
                 MESSAGE_WORDS: tl.constexpr, ROWS: tl.constexpr, CAST_GROUPS: tl.constexpr, GPU: tl.constexpr):
    """Write the ``count`` rows routed to one expert as messages 0..count-1 of ``message_block``."""
    for first in range(0, count, ROWS):
        wanted = first + tl.arange(0, ROWS)
        # The pair whose position among the routed pairs is ``wanted`` (a compaction by matching).
        match = routed[None, :] & (position[None, :] == wanted[:, None])
        pair = tl.sum(tl.where(match, pairs[None, :], 0), axis=1)
        row_ok = wanted < count
        token = pair // NUM_TOPK
        # Messages start on 16-byte boundaries (4-word units in 4096-aligned slots): wide stores.
        message_rows = tl.multiple_of(message_block + wanted.to(tl.int64) * MESSAGE_WORDS, 16)
        message = message_rows[:, None]
        if USE_FP8:
            cast_rows_to_messages(x_ptr, token, x_row_stride, row_ok, message_rows, HIDDEN, DATA_WORDS, ROUND_SCALE,
                                  CAST_GROUPS, GPU)
        else:
            # bf16 rows travel as they are, two channels an int32 word (the row stride is even).
            words = tl.arange(0, HIDDEN_PAD // 2)
            word_mask = row_ok[:, None] & (words < DATA_WORDS)[None, :]
            x_words = x_ptr.to(tl.pointer_type(tl.int32))
            values = tl.load(x_words + token.to(tl.int64)[:, None] * (x_row_stride // 2) + words[None, :],
                             mask=word_mask)
            tl.store(message + words[None, :], values, mask=word_mask)
        header = message + DATA_WORDS + SCALE_WORDS
        tl.store(header, token[:, None], mask=row_ok[:, None])
        tl.store(header + 1, (pair % NUM_TOPK)[:, None], mask=row_ok[:, None])


@triton.jit
def _receive_scales(message_rows, row_ok, out_scales_ptr, out_rows, slots_per_expert,
                    USE_UE8M0: tl.constexpr, DATA_WORDS: tl.constexpr, SCALE_WORDS: tl.constexpr,
                    GROUPS_PAD: tl.constexpr, ROWS: tl.constexpr):
    """Scales of ``ROWS`` messages into the column-major [groups (or words), rows] output of one
    expert (``out_scales_ptr`` points at its first element)."""
    groups = tl.arange(0, GROUPS_PAD)
    bits = tl.load(message_rows[:, None] + DATA_WORDS + groups[None, :],
                   mask=row_ok[:, None] & (groups < SCALE_WORDS)[None, :], other=0, cache_modifier=".cg")
    if USE_UE8M0:
        # Power-of-two scales: the float's exponent byte is the UE8M0 code; four per int32.
        packed = pack_bytes((bits >> 23) & 0xFF, ROWS, GROUPS_PAD)
        columns = tl.arange(0, GROUPS_PAD // 4)
        tl.store(out_scales_ptr + columns[None, :].to(tl.int64) * slots_per_expert + out_rows[:, None], packed,
                 mask=row_ok[:, None] & (columns < SCALE_WORDS // 4)[None, :])
    else:
        tl.store(out_scales_ptr + groups[None, :].to(tl.int64) * slots_per_expert + out_rows[:, None],
                 bits.to(tl.float32, bitcast=True), mask=row_ok[:, None] & (groups < SCALE_WORDS)[None, :])


# x_row_stride stays specialised: a stride divisible by 16 lets the row loads be 16 bytes wide.
@triton.jit(do_not_specialize=["num_tokens", "area", "slot", "slot_bytes", "rank", "timeout_ns",
                               "num_max_tokens", "experts_per_rank", "status_address"])
def low_latency_dispatch_kernel(
    x_ptr, x_row_stride, topk_idx_ptr, num_tokens,
    out_x_ptr, out_scales_ptr, out_src_info_ptr, out_topk_slot_ptr, out_layout_range_ptr, out_count_ptr,
    recv_stats_ptr, wait_stats_ptr, mask_ptr, saved_mask_ptr,
    peer_base_ptrs, area, slot, slot_bytes, rank, status_address, timeout_ns, num_max_tokens, experts_per_rank,
    NUM_RANKS: tl.constexpr, HIDDEN: tl.constexpr, HIDDEN_PAD: tl.constexpr, NUM_TOPK: tl.constexpr,
    PAIRS_PAD: tl.constexpr, USE_FP8: tl.constexpr, ROUND_SCALE: tl.constexpr, USE_UE8M0: tl.constexpr,
    HAS_RECV_STATS: tl.constexpr, HAS_WAIT_STATS: tl.constexpr, HAS_MASK: tl.constexpr, DO_SEND: tl.constexpr,
    DO_RECV: tl.constexpr, GROUPS_PAD: tl.constexpr, RANKS_PAD: tl.constexpr, ROWS: tl.constexpr,
    CAST_GROUPS: tl.constexpr, BLOCK: tl.constexpr, GPU: tl.constexpr,
):
    """``x_ptr`` is bf16 [N, H] (``x_row_stride`` even, in elements). ``out_x_ptr`` is the int32
    view of packed_recv_x; ``out_scales_ptr`` its scales
    (column-major per expert, ``SCALE_COLUMNS`` columns). ``status_address``: pinned host int64
    that a timed-out wait writes (phase, peer) into. ``mask_ptr``: this rank's int32 [R] mask
    (shrink mode); ``saved_mask_ptr``: int32 [R], the mask this dispatch used (in its handle)."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    status_ptr = status_address.to(tl.pointer_type(tl.int64))
    my_area = tl.load(peer_base_ptrs + rank) + area
    control = my_area.to(tl.pointer_type(tl.int64))
    DATA_WORDS: tl.constexpr = HIDDEN // 4 if USE_FP8 else HIDDEN // 2
    SCALE_WORDS: tl.constexpr = HIDDEN // 128 if USE_FP8 else 0
    MESSAGE_WORDS: tl.constexpr = (DATA_WORDS + SCALE_WORDS + 2 + 3) // 4 * 4
    SCALE_COLUMNS: tl.constexpr = SCALE_WORDS // 4 if USE_UE8M0 else SCALE_WORDS
    num_experts = experts_per_rank * NUM_RANKS
    block_words = num_max_tokens.to(tl.int64) * MESSAGE_WORDS        # one (expert, source) block

    ranks = tl.arange(0, RANKS_PAD)
    real_ranks = tl.minimum(ranks, NUM_RANKS - 1)   # pad lanes point at a real word, masked off
    # The ranks this dispatch skips: the send reads the mask, the receive what the send saw.
    if DO_SEND:
        masked = load_rank_mask(mask_ptr, ranks, NUM_RANKS, HAS_MASK)
        save_rank_mask(saved_mask_ptr, masked, ranks, NUM_RANKS, HAS_MASK)
    else:
        masked = load_rank_mask(saved_mask_ptr, ranks, NUM_RANKS, HAS_MASK)
    if DO_SEND:
        call, masked = begin_low_latency_send(control, SEQUENCE_SENT, FREED, SENT_USE, slot, masked, mask_ptr,
                                              saved_mask_ptr, status_ptr, timeout_ns, PHASE_LL_DISPATCH_SLOT,
                                              NUM_RANKS, RANKS_PAD, MAX_RANKS, HAS_MASK, GPU)
        pairs = tl.arange(0, PAIRS_PAD)
        experts = tl.load(topk_idx_ptr + pairs, mask=pairs < num_tokens * NUM_TOPK, other=-1)
        for expert in range(pid, num_experts, num_programs):
            routed = experts == expert
            destination = expert // experts_per_rank
            count = tl.where(rank_masked(masked, ranks, destination), 0, tl.sum(routed.to(tl.int32), axis=0))
            position = tl.cumsum(routed.to(tl.int32), axis=0) - 1
            local_expert = expert - destination * experts_per_rank
            peer_area = tl.load(peer_base_ptrs + destination) + area
            receive_slot = (peer_area + CONTROL_BYTES + slot * slot_bytes).to(tl.pointer_type(tl.int32))
            message_block = receive_slot + (local_expert * NUM_RANKS + rank) * block_words
            _send_expert(x_ptr, x_row_stride, pairs, routed, position, count, message_block, NUM_TOPK, HIDDEN,
                         HIDDEN_PAD, USE_FP8, ROUND_SCALE, DATA_WORDS, SCALE_WORDS, MESSAGE_WORDS, ROWS, CAST_GROUPS,
                         GPU)
        # One fence for all of this program's rows, then the flags: no round trip per expert.
        fence_system(GPU)
        for expert in range(pid, num_experts, num_programs):
            count = tl.sum((experts == expert).to(tl.int32), axis=0)
            destination = expert // experts_per_rank
            local_expert = expert - destination * experts_per_rank
            if not rank_masked(masked, ranks, destination):
                flag = (tl.load(peer_base_ptrs + destination) + area).to(tl.pointer_type(tl.int64)) + FLAGS \
                    + slot * MAX_EXPERTS + local_expert * NUM_RANKS + rank
                store_relaxed(flag, (call << 32) | count.to(tl.int64), GPU)

    if DO_RECV:
        call = load_acquire(control + SEQUENCE_RECEIVED + slot, GPU) + 1
        slots_per_expert = NUM_RANKS * num_max_tokens.to(tl.int64)
        receive_slot = (my_area + CONTROL_BYTES + slot * slot_bytes).to(tl.pointer_type(tl.int32))
        # One item per (local expert, source): every item waits for the expert's flags from the
        # unmasked sources (its rows start after the lower sources' rows), then copies its own
        # source's rows. Masked sources count as empty.
        heard = (ranks < NUM_RANKS) & (masked == 0)
        for item in range(pid, experts_per_rank * NUM_RANKS, num_programs):
            local_expert = item // NUM_RANKS
            source = item % NUM_RANKS
            started = now_ns(GPU)
            target = (call << 32) + tl.zeros([RANKS_PAD], tl.int64)
            flags = wait_all_at_least(control + FLAGS + slot * MAX_EXPERTS + local_expert * NUM_RANKS + real_ranks,
                                      target, heard, status_ptr, timeout_ns, PHASE_LL_DISPATCH_DATA, ranks, mask_ptr,
                                      saved_mask_ptr, NUM_RANKS, HAS_MASK, GPU)
            heard = heard & ~gave_up(flags, target)   # shrink mode: a source that timed out sends nothing
            if HAS_WAIT_STATS:
                waited = tl.where(rank_masked(masked, ranks, source), 0, now_ns(GPU) - started)
                tl.atomic_add(wait_stats_ptr + source, waited, sem="relaxed")
            counts = tl.where(heard, tl.minimum(flags & LOW_32_BITS, num_max_tokens), 0).to(tl.int32)
            begin = tl.sum(tl.where(ranks < source, counts, 0), axis=0)
            count = tl.sum(tl.where(ranks == source, counts, 0), axis=0)
            total = tl.sum(counts, axis=0)
            out_base = local_expert * slots_per_expert
            tl.store(out_layout_range_ptr + item, (begin.to(tl.int64) << 32) | count)
            messages = receive_slot + item * block_words
            for first in range(0, count, ROWS):
                rows = first + tl.arange(0, ROWS)
                row_ok = rows < count
                out_rows = begin + rows
                copy_rows(messages, rows, MESSAGE_WORDS, 1, out_x_ptr + out_base * DATA_WORDS, out_rows, row_ok,
                          DATA_WORDS, BLOCK, True)
                message_rows = messages + rows.to(tl.int64) * MESSAGE_WORDS
                header = message_rows + DATA_WORDS + SCALE_WORDS
                token = tl.load(header, mask=row_ok, cache_modifier=".cg")
                topk_slot = tl.load(header + 1, mask=row_ok, cache_modifier=".cg")
                tl.store(out_src_info_ptr + out_base + out_rows, token, mask=row_ok)
                tl.store(out_topk_slot_ptr + out_base + out_rows, topk_slot.to(tl.int8), mask=row_ok)
                if USE_FP8:
                    _receive_scales(message_rows, row_ok, out_scales_ptr + out_base * SCALE_COLUMNS, out_rows,
                                    slots_per_expert, USE_UE8M0, DATA_WORDS, SCALE_WORDS, GROUPS_PAD, ROWS)
            if source == 0:
                tl.store(out_count_ptr + local_expert, total)
                if HAS_RECV_STATS:
                    tl.store(recv_stats_ptr + local_expert, tl.load(recv_stats_ptr + local_expert) + total)
            if source == NUM_RANKS - 1:
                # Rows past the count carry no token: -1, as the CPU backend leaves them.
                for unused_row in range(total, slots_per_expert, BLOCK):
                    rows = unused_row + tl.arange(0, BLOCK)
                    tl.store(out_src_info_ptr + out_base + rows, tl.full([BLOCK], -1, tl.int32),
                             mask=rows < slots_per_expert)

    finish_low_latency_launch(control, peer_base_ptrs, area, slot, rank, masked, SEQUENCE_SENT, SEQUENCE_RECEIVED,
                              SENT_USE, DONE_SEND, DONE_RECEIVE, FREED, NUM_RANKS, RANKS_PAD, MAX_RANKS, DO_SEND,
                              DO_RECV, GPU)
