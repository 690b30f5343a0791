"""Low-latency dispatch over NVLink: one kernel, no host synchronisation, CUDA-graph safe.

Send (``DO_SEND``): program p takes tokens p, p+P, ... It reads and casts a token's row once
(fp8, or keeps bf16) and stores the message into the receive slot of each of its top-k
experts' ranks, at the fixed block ``[local expert, source = us]``, message number = the
number of earlier (token, k) pairs routed to that expert. Fixed places mean no slot has to be
reserved with a remote atomic and rows keep token order. Each program also stages
``(use << 32) | count`` for experts p, p+P, ... in this rank's control block; after a system
fence, the last program to finish its rows (``last_program_done``) raises every expert's flag
at its rank with one vector of relaxed stores. Casting each row once (not once per expert)
cut the send's instructions; no program waits for another. A token is first read, cast and
addressed (``_read_token``), then stored (``_write_token``), so no load waits behind a store;
a program's first token is read before it waits for the slot.

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

from tritonep.backends.nvlink.low_latency import regions as layout
from tritonep.backends.nvlink.low_latency.control_words import (
    CONTROL_BYTES,
    DISPATCH,
    MAX_EXPERTS,
    MAX_RANKS,
    call_words,
)
from tritonep.device import nvshmem, signals
from tritonep.device.fp8_tiles import cast_row, pack_bytes
from tritonep.device.nvshmem import NVSHMEM
from tritonep.device.rows import copy_rows
from tritonep.device.status_codes import PHASE_LL_DISPATCH_DATA, PHASE_LL_DISPATCH_SLOT
from tritonep.runtime import kernel_names

SEQUENCE_SENT, SEQUENCE_RECEIVED, DONE_SEND, DONE_RECEIVE, SENT_USE = call_words(DISPATCH)
FREED = tl.constexpr(layout.DISPATCH_FREED)
FLAGS = tl.constexpr(layout.DISPATCH_FLAGS)
COUNTS = tl.constexpr(layout.DISPATCH_COUNTS)
ROWS_SENT = tl.constexpr(layout.DONE + 4)
SCRATCH = tl.constexpr(layout.DONE + 5)
LOW_32_BITS = tl.constexpr(0xFFFFFFFF)


@triton.jit
def _read_token(x_ptr, x_row_stride, token, num_tokens, topk_idx_ptr, experts, pairs, peer_base_ptrs, area, slot,
                slot_bytes, rank, block_words, experts_per_rank, NUM_RANKS: tl.constexpr, NUM_TOPK: tl.constexpr,
                TOPK_PAD: tl.constexpr, HIDDEN: tl.constexpr, HIDDEN_PAD: tl.constexpr, USE_FP8: tl.constexpr,
                ROUND_SCALE: tl.constexpr, GROUPS_PAD: tl.constexpr, DATA_WORDS: tl.constexpr,
                MESSAGE_WORDS: tl.constexpr, GPU: tl.constexpr):
    """What one token's send needs before it writes anything: its row, cast once (fp8 bytes and
    scale bits, or bf16 rows as int32 words and unused scales), and for each top-k pair the byte
    address of its message and the destination rank (address 0 where the expert is -1, and for a
    token past ``num_tokens``, whose loads are masked off).

    A message's number in its (expert, source) block is the count of earlier (token, k) pairs
    routed to the same expert, so rows keep token order, as the CPU backend orders them. The
    addresses are worked out as vectors here, with no store in between: computed inside the
    store loop, each pair's index and pointer-table loads waited behind the previous pair's
    stores (ncu: a fifth of the send's samples)."""
    present = token < num_tokens
    row = x_ptr + x_row_stride.to(tl.int64) * token
    if USE_FP8:
        data, scales = cast_row(row, present, HIDDEN, GROUPS_PAD, ROUND_SCALE, GPU)
        scale_bits = scales.to(tl.int32, bitcast=True)
    else:
        # bf16 rows travel as they are, two channels an int32 word (the row stride is even).
        words = tl.arange(0, HIDDEN_PAD // 2)
        data = tl.load(row.to(tl.pointer_type(tl.int32)) + words, mask=(words < DATA_WORDS) & present)
        scale_bits = tl.zeros([GROUPS_PAD], tl.int32)
    # All top-k message numbers in one reduction: [K, pairs] "same expert, earlier pair".
    ks = tl.arange(0, TOPK_PAD)
    my_pairs = token * NUM_TOPK + ks
    chosen = tl.load(topk_idx_ptr + my_pairs, mask=(ks < NUM_TOPK) & present, other=-1)
    earlier = (experts[None, :] == chosen[:, None]) & (pairs[None, :] < my_pairs[:, None])
    positions = tl.sum(earlier.to(tl.int32), axis=1)
    destinations = tl.maximum(chosen, 0) // experts_per_rank
    local_experts = chosen - destinations * experts_per_rank
    peer_areas = tl.load(peer_base_ptrs + destinations) + area
    # Messages start on 16-byte boundaries (4-word units in 4096-aligned slots).
    addresses = peer_areas + CONTROL_BYTES + slot * slot_bytes.to(tl.int64) \
        + ((local_experts * NUM_RANKS + rank) * block_words + positions.to(tl.int64) * MESSAGE_WORDS) * 4
    return data, scale_bits, tl.where(chosen >= 0, addresses, 0), destinations


@triton.jit
def _store_message(message, data, scale_bits, token, k, HIDDEN: tl.constexpr, HIDDEN_PAD: tl.constexpr,
                   USE_FP8: tl.constexpr, GROUPS_PAD: tl.constexpr, DATA_WORDS: tl.constexpr,
                   SCALE_WORDS: tl.constexpr):
    """A token's message at ``message`` (an int32 pointer, 16-byte aligned, so the stores are 16
    bytes wide): its row, then its header (token, k)."""
    if USE_FP8:
        columns = tl.arange(0, GROUPS_PAD)[:, None] * 128 + tl.arange(0, 128)[None, :]
        groups = tl.arange(0, GROUPS_PAD)
        tl.store(message.to(tl.pointer_type(tl.uint8)) + columns, data, mask=columns < HIDDEN)
        tl.store(message + DATA_WORDS + groups, scale_bits, mask=groups < SCALE_WORDS)
    else:
        words = tl.arange(0, HIDDEN_PAD // 2)
        tl.store(message + words, data, mask=words < DATA_WORDS)
    tl.store(message + DATA_WORDS + SCALE_WORDS, token)
    tl.store(message + DATA_WORDS + SCALE_WORDS + 1, k)


@triton.jit
def _write_token(data, scale_bits, addresses, destinations, token, masked, ranks, peer_base_ptrs, send_area, heap_base,
                 NUM_RANKS: tl.constexpr, NUM_TOPK: tl.constexpr, TOPK_PAD: tl.constexpr, HIDDEN: tl.constexpr,
                 HIDDEN_PAD: tl.constexpr, USE_FP8: tl.constexpr, GROUPS_PAD: tl.constexpr,
                 DATA_WORDS: tl.constexpr, SCALE_WORDS: tl.constexpr, MESSAGE_WORDS: tl.constexpr,
                 TRANSPORT: tl.constexpr, GPU: tl.constexpr):
    """Store a token read by ``_read_token`` into the receive slot of each of its top-k experts'
    ranks, skipping masked ranks: the same row top-k times, then its header (token, k).

    ``NVSHMEM``: a destination the peer table maps no address for (another node) gets the
    message by a put instead, from ``staged`` in this rank's heap (``heap_base``), where the
    message is written once (at ``send_area``, one message per token), its k rewritten before
    each put. A put returns once its source may
    be reused; the flags that follow wait for every put to arrive (``_raise_flags``)."""
    ks = tl.arange(0, TOPK_PAD)
    addresses = tl.where(signals.ranks_masked(masked, ranks, destinations), 0, addresses)
    if TRANSPORT == NVSHMEM:
        by_put = (tl.load(peer_base_ptrs + destinations) == 0) & (addresses != 0)
        pes = nvshmem.peer_pe(peer_base_ptrs, destinations, NUM_RANKS)
        staged = send_area + token.to(tl.int64) * (MESSAGE_WORDS * 4)
        staged_message = tl.multiple_of(staged.to(tl.pointer_type(tl.int32)), 16)
        if tl.sum(by_put.to(tl.int32), axis=0) > 0:
            _store_message(staged_message, data, scale_bits, token, 0, HIDDEN, HIDDEN_PAD, USE_FP8, GROUPS_PAD,
                           DATA_WORDS, SCALE_WORDS)
    for k in tl.static_range(NUM_TOPK):
        address = tl.sum(tl.where(ks == k, addresses, 0), axis=0)
        if address != 0:
            message = tl.multiple_of(address.to(tl.pointer_type(tl.int32)), 16)
            if TRANSPORT == NVSHMEM:
                if tl.sum(tl.where(ks == k, by_put.to(tl.int32), 0), axis=0) > 0:
                    tl.store(staged_message + DATA_WORDS + SCALE_WORDS + 1, k)
                    signals.fence_system(GPU)   # every thread's part of the message, before it is read
                    nvshmem.put_block(heap_base + address, staged, MESSAGE_WORDS * 4,
                                      tl.sum(tl.where(ks == k, pes, 0), axis=0))
                    tl.debug_barrier()   # the put read the message before its k changes
                else:
                    _store_message(message, data, scale_bits, token, k, HIDDEN, HIDDEN_PAD, USE_FP8, GROUPS_PAD,
                                   DATA_WORDS, SCALE_WORDS)
            else:
                _store_message(message, data, scale_bits, token, k, HIDDEN, HIDDEN_PAD, USE_FP8, GROUPS_PAD,
                               DATA_WORDS, SCALE_WORDS)


@triton.jit
def _raise_flags(staged, peer_base_ptrs, area, my_area, slot, rank, masked, ranks, num_experts, experts_per_rank,
                 NUM_RANKS: tl.constexpr, FLAG_BLOCK: tl.constexpr, TRANSPORT: tl.constexpr, GPU: tl.constexpr):
    """Write each expert's staged ``(use << 32) | rows`` into its flag at its rank; flags of
    masked ranks go to this rank's scratch word instead (one unconditional vector store).

    ``NVSHMEM``: first every put of the launch has arrived (``quiet``: the programs that made
    them finished before this one, ``last_program_done``); then the flags of ranks the peer table
    maps no address for are set by NVSHMEM signals, one per lane, and the other lanes' signals
    go to this rank's scratch word (a signal cannot be masked off)."""
    if TRANSPORT == NVSHMEM:
        nvshmem.quiet()
    for first in range(0, num_experts, FLAG_BLOCK):
        expert = first + tl.arange(0, FLAG_BLOCK)
        valid = expert < num_experts
        destination = tl.where(valid, expert // experts_per_rank, 0)
        wanted = valid & ~signals.ranks_masked(masked, ranks, destination)
        local_expert = expert - destination * experts_per_rank
        flag_address = tl.load(peer_base_ptrs + destination) + area \
            + (FLAGS + slot * MAX_EXPERTS + local_expert * NUM_RANKS + rank) * 8
        if TRANSPORT == NVSHMEM:
            # Flags of peers the table maps no address for (0: flag_address is the flag's offset
            # in the heap), named by their address in this rank's heap.
            by_put = wanted & (tl.load(peer_base_ptrs + destination) == 0)
            nvshmem.set_lanes(tl.where(by_put, my_area - area + flag_address, my_area + SCRATCH * 8),
                              tl.load(staged + expert, mask=valid, other=0),
                              nvshmem.peer_pe(peer_base_ptrs, tl.where(by_put, destination, rank), NUM_RANKS))
            wanted = wanted & ~by_put
        address = tl.where(wanted, flag_address, my_area + SCRATCH * 8)
        signals.store_relaxed(address.to(tl.pointer_type(tl.int64)), tl.load(staged + expert, mask=valid, other=0), GPU)


@triton.jit
def _load_scales(message_rows, row_ok, DATA_WORDS: tl.constexpr, SCALE_WORDS: tl.constexpr,
                 GROUPS_PAD: tl.constexpr):
    """The float32 scales of ``ROWS`` messages, as int32 bits [ROWS, GROUPS_PAD]."""
    groups = tl.arange(0, GROUPS_PAD)
    return tl.load(message_rows[:, None] + DATA_WORDS + groups[None, :],
                   mask=row_ok[:, None] & (groups < SCALE_WORDS)[None, :], other=0, cache_modifier=".cg")


@triton.jit
def _store_scales(bits, row_ok, out_scales_ptr, out_rows, slots_per_expert, USE_UE8M0: tl.constexpr,
                  SCALE_WORDS: tl.constexpr, GROUPS_PAD: tl.constexpr, ROWS: tl.constexpr):
    """Scales (``_load_scales``) into the column-major [groups (or words), rows] output of one
    expert (``out_scales_ptr`` points at its first element)."""
    groups = tl.arange(0, GROUPS_PAD)
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
@kernel_names.jit("tritonep::low_latency::dispatch",
                  do_not_specialize=["num_tokens", "area", "slot", "slot_bytes", "rank", "timeout_ns",
                                     "num_max_tokens", "experts_per_rank", "status_address", "send_area"])
def low_latency_dispatch_kernel(
    x_ptr, x_row_stride, topk_idx_ptr, num_tokens,
    out_x_ptr, out_scales_ptr, out_src_info_ptr, out_topk_slot_ptr, out_layout_range_ptr, out_count_ptr,
    recv_stats_ptr, wait_stats_ptr, mask_ptr, saved_mask_ptr,
    peer_base_ptrs, area, my_area, slot, slot_bytes, rank, status_address, timeout_ns, num_max_tokens,
    experts_per_rank, send_area, NUM_RANKS: tl.constexpr, HIDDEN: tl.constexpr, HIDDEN_PAD: tl.constexpr,
    NUM_TOPK: tl.constexpr, PAIRS_PAD: tl.constexpr, TOPK_PAD: tl.constexpr, USE_FP8: tl.constexpr,
    ROUND_SCALE: tl.constexpr,
    USE_UE8M0: tl.constexpr,
    HAS_RECV_STATS: tl.constexpr, HAS_WAIT_STATS: tl.constexpr, HAS_MASK: tl.constexpr, DO_SEND: tl.constexpr,
    DO_RECV: tl.constexpr, GROUPS_PAD: tl.constexpr, RANKS_PAD: tl.constexpr, RECV_ROWS: tl.constexpr,
    BLOCK: tl.constexpr, GPU: tl.constexpr, TRANSPORT: tl.constexpr,
):
    """``x_ptr`` is bf16 [N, H] (``x_row_stride`` even, in elements). ``out_x_ptr`` is the int32
    view of packed_recv_x; ``out_scales_ptr`` its scales
    (column-major per expert, ``SCALE_COLUMNS`` columns). ``status_address``: pinned host int64
    that a timed-out wait writes (phase, peer) into. ``mask_ptr``: this rank's int32 [R] mask
    (shrink mode); ``saved_mask_ptr``: int32 [R], the mask this dispatch used (in its handle).
    ``my_area``: ``peer_base_ptrs[rank] + area``, passed rather than loaded, since every address
    of the kernel's first steps depends on it. ``peer_base_ptrs``: the peer table (``area.py``);
    ``TRANSPORT`` (``device/nvshmem.py``): ``STORES``, every peer by stores through it, or
    ``NVSHMEM``, peers it maps no address for by puts from ``send_area`` (this slot's messages
    to be put, in this rank's heap; None with ``STORES``)."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    status_ptr = status_address.to(tl.pointer_type(tl.int64))
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
        masked = signals.load_rank_mask(mask_ptr, ranks, NUM_RANKS, HAS_MASK)
        signals.save_rank_mask(saved_mask_ptr, masked, ranks, NUM_RANKS, HAS_MASK)
    else:
        masked = signals.load_rank_mask(saved_mask_ptr, ranks, NUM_RANKS, HAS_MASK)
    if DO_SEND:
        pairs = tl.arange(0, PAIRS_PAD)
        experts = tl.load(topk_idx_ptr + pairs, mask=pairs < num_tokens * NUM_TOPK, other=-1)
        # This program's first token is read, cast and addressed before waiting for the slot to be
        # free, so those loads overlap the wait. (``sent_token``, ``send_*``: the receive loop below
        # gives ``token`` and ``scale_bits`` other shapes.)
        sent_token = pid
        send_data, send_scales, send_addresses, send_destinations = _read_token(
            x_ptr, x_row_stride, sent_token, num_tokens, topk_idx_ptr, experts, pairs, peer_base_ptrs, area, slot,
            slot_bytes, rank, block_words, experts_per_rank, NUM_RANKS, NUM_TOPK, TOPK_PAD, HIDDEN, HIDDEN_PAD,
            USE_FP8, ROUND_SCALE, GROUPS_PAD, DATA_WORDS, MESSAGE_WORDS, GPU)
        call, masked = signals.begin_low_latency_send(control, SEQUENCE_SENT, FREED, SENT_USE, slot, masked, mask_ptr,
                                                      saved_mask_ptr, status_ptr, timeout_ns, PHASE_LL_DISPATCH_SLOT,
                                                      NUM_RANKS, RANKS_PAD, MAX_RANKS, HAS_MASK, GPU)
        while sent_token < num_tokens:
            _write_token(send_data, send_scales, send_addresses, send_destinations, sent_token, masked, ranks,
                         peer_base_ptrs, send_area, my_area - area, NUM_RANKS, NUM_TOPK, TOPK_PAD, HIDDEN, HIDDEN_PAD,
                         USE_FP8, GROUPS_PAD, DATA_WORDS, SCALE_WORDS, MESSAGE_WORDS, TRANSPORT, GPU)
            sent_token += num_programs
            if sent_token < num_tokens:
                send_data, send_scales, send_addresses, send_destinations = _read_token(
                    x_ptr, x_row_stride, sent_token, num_tokens, topk_idx_ptr, experts, pairs, peer_base_ptrs,
                    area, slot, slot_bytes, rank, block_words, experts_per_rank, NUM_RANKS, NUM_TOPK, TOPK_PAD,
                    HIDDEN, HIDDEN_PAD, USE_FP8, ROUND_SCALE, GROUPS_PAD, DATA_WORDS, MESSAGE_WORDS, GPU)
        # Each expert's flag must follow every row sent to it, and those come from many programs:
        # the programs stage the flag values, and the last one to finish its rows raises them all
        # (no program waits for another, so this also runs under the interpreter).
        staged = control + COUNTS + slot * MAX_EXPERTS
        for expert in range(pid, num_experts, num_programs):
            count = tl.sum((experts == expert).to(tl.int32), axis=0)
            tl.store(staged + expert, (call << 32) | count.to(tl.int64))
        signals.fence_system(GPU)
        if signals.last_program_done(control + ROWS_SENT):
            signals.fence_system(GPU)
            _raise_flags(staged, peer_base_ptrs, area, my_area, slot, rank, masked, ranks, num_experts,
                         experts_per_rank, NUM_RANKS, 1024, TRANSPORT, GPU)

    if DO_RECV:
        call = signals.load_own_counter(control + SEQUENCE_RECEIVED + slot) + 1
        slots_per_expert = NUM_RANKS * num_max_tokens.to(tl.int64)
        receive_slot = (my_area + CONTROL_BYTES + slot * slot_bytes).to(tl.pointer_type(tl.int32))
        # One item per (local expert, source): every item waits for the expert's flags from the
        # unmasked sources (its rows start after the lower sources' rows), then copies its own
        # source's rows. Masked sources count as empty.
        heard = (ranks < NUM_RANKS) & (masked == 0)
        for item in range(pid, experts_per_rank * NUM_RANKS, num_programs):
            local_expert = item // NUM_RANKS
            source = item % NUM_RANKS
            started = signals.now_ns(GPU)
            target = (call << 32) + tl.zeros([RANKS_PAD], tl.int64)
            flags = signals.wait_all_at_least(
                control + FLAGS + slot * MAX_EXPERTS + local_expert * NUM_RANKS + real_ranks, target, heard,
                status_ptr, timeout_ns, PHASE_LL_DISPATCH_DATA, ranks, mask_ptr, saved_mask_ptr, NUM_RANKS, HAS_MASK,
                GPU)
            heard = heard & ~signals.gave_up(flags, target)   # shrink mode: a source that timed out sends nothing
            if HAS_WAIT_STATS:
                waited = tl.where(signals.rank_masked(masked, ranks, source), 0, signals.now_ns(GPU) - started)
                tl.atomic_add(wait_stats_ptr + source, waited, sem="relaxed")
            counts = tl.where(heard, tl.minimum(flags & LOW_32_BITS, num_max_tokens), 0).to(tl.int32)
            begin = tl.sum(tl.where(ranks < source, counts, 0), axis=0)
            count = tl.sum(tl.where(ranks == source, counts, 0), axis=0)
            total = tl.sum(counts, axis=0)
            out_base = local_expert * slots_per_expert
            tl.store(out_layout_range_ptr + item, (begin.to(tl.int64) << 32) | count)
            # 16-byte aligned, as the send wrote them: without saying so the row copy loaded 4-byte
            # words (ncu: 8 of each 32-byte sector used).
            messages = tl.multiple_of(receive_slot + item * block_words, 16)
            for first in range(0, count, RECV_ROWS):
                rows = first + tl.arange(0, RECV_ROWS)
                row_ok = rows < count
                out_rows = begin + rows
                message_rows = messages + rows.to(tl.int64) * MESSAGE_WORDS
                # The small loads first: stores may alias them as far as the compiler knows, so
                # issued after the row copy they would wait for it.
                header = message_rows + DATA_WORDS + SCALE_WORDS
                token = tl.load(header, mask=row_ok, cache_modifier=".cg")
                topk_slot = tl.load(header + 1, mask=row_ok, cache_modifier=".cg")
                if USE_FP8:
                    scale_bits = _load_scales(message_rows, row_ok, DATA_WORDS, SCALE_WORDS, GROUPS_PAD)
                copy_rows(messages, rows, MESSAGE_WORDS, 1, out_x_ptr + out_base * DATA_WORDS, out_rows, row_ok,
                          DATA_WORDS, BLOCK, True)
                tl.store(out_src_info_ptr + out_base + out_rows, token, mask=row_ok)
                tl.store(out_topk_slot_ptr + out_base + out_rows, topk_slot.to(tl.int8), mask=row_ok)
                if USE_FP8:
                    _store_scales(scale_bits, row_ok, out_scales_ptr + out_base * SCALE_COLUMNS, out_rows,
                                  slots_per_expert, USE_UE8M0, SCALE_WORDS, GROUPS_PAD, RECV_ROWS)
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

    signals.finish_low_latency_launch(
        control, peer_base_ptrs, area, slot, rank, masked, SEQUENCE_SENT, SEQUENCE_RECEIVED, SENT_USE, DONE_SEND,
        DONE_RECEIVE, FREED, my_area - area, NUM_RANKS, RANKS_PAD, MAX_RANKS, DO_SEND, DO_RECV, GPU, TRANSPORT)
