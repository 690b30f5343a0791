"""Low-latency combine over NVLink: expert outputs go back to their tokens, weighted and summed.

Send (``DO_SEND``): program p takes (local expert, source rank) items p, p+P, ... For source s
it walks the rows the dispatch placed in ``[begin, begin + count)`` (from ``layout_range``) and writes
row j of expert e to s's combine slot at ``[token, k]``: the dispatch recorded both the
token (``src_info``) and which of its top-k entries chose this expert (``topk_slot``), so
every (token, k) has its own row and nothing is summed remotely. After all its rows, one
fence, then the program writes the call's use number into each source's flag for its experts.

Receive (``DO_RECV``): program p takes (token, column block) items p, p+P, ... It waits for
the flags of the token's experts (all at once), loads their K rows at once and writes
``sum_k weight[t, k] * row_k`` (float32 accumulation, bf16 out). Slots, their use counters on
the GPU and the wait for the slot's previous use work as in the dispatch kernel.

Shrink mode (``HAS_MASK``): the combine skips a rank that is masked now (``mask_ptr``) or was
masked at its dispatch (``dispatch_mask_ptr``, saved in the handle). Requiring both keeps a
mask update between a dispatch and its combine safe: a rank masked since the dispatch is not
waited for, and a rank unmasked since then, which exchanged no rows with this one, is not
read from (its slot holds nothing for this call). The send half saves that mask
(``combine_mask_ptr``) for a receive half launched by the hook. Masked experts count as 0.

``HAS_WAIT_STATS``: the receive first waits for each global expert's flag (program p takes
experts p, p+P, ...), adding the nanoseconds to the expert's rank in ``wait_stats_ptr``
(``combine_wait_recv_cost_stats``), as the dispatch does per (expert, source).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tritonep.backends.nvlink.low_latency import regions as layout
from tritonep.backends.nvlink.low_latency.control_words import COMBINE, MAX_EXPERTS, MAX_RANKS, MAX_TOPK, call_words
from tritonep.device import nvshmem, signals
from tritonep.device.nvshmem import NVSHMEM
from tritonep.device.rows import copy_rows
from tritonep.device.status_codes import PHASE_LL_COMBINE_DATA, PHASE_LL_COMBINE_SLOT
from tritonep.runtime import kernel_names

SEQUENCE_SENT, SEQUENCE_RECEIVED, DONE_SEND, DONE_RECEIVE, SENT_USE = call_words(COMBINE)
FREED = tl.constexpr(layout.COMBINE_FREED)
FLAGS = tl.constexpr(layout.COMBINE_FLAGS)


@triton.jit
def _store_rows(receive_slot, x_words, local_expert, expert_stride, row_stride, src_info_ptr, topk_slot_ptr,
                expert_rows, begin, count, WORDS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Rows ``[begin, begin + count)`` of one expert's outputs (``x_words``: all experts' as int32
    words; strides in bf16 elements) into a source's combine slot (``receive_slot``: its address,
    mapped here), row j at ``[token, k]`` from ``src_info`` and ``topk_slot`` (the expert's rows
    start at ``expert_rows``)."""
    slot_words = receive_slot.to(tl.pointer_type(tl.int32))
    for first in range(0, count, ROWS):
        rows = begin + first + tl.arange(0, ROWS)
        row_ok = first + tl.arange(0, ROWS) < count
        token = tl.load(src_info_ptr + expert_rows + rows, mask=row_ok, other=0)
        topk_slot = tl.load(topk_slot_ptr + expert_rows + rows, mask=row_ok, other=0).to(tl.int32)
        copy_rows(x_words + local_expert * (expert_stride // 2).to(tl.int64), rows, row_stride // 2, 1, slot_words,
                  token * MAX_TOPK + topk_slot, row_ok, WORDS, BLOCK, False)


@triton.jit
def _put_rows(expert_x, row_stride, src_info_ptr, topk_slot_ptr, begin, count, staged, receive_slot, pe,
              WORDS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, GPU: tl.constexpr):
    """``_store_rows`` to a source of another node, by NVSHMEM: the rows first go to ``staged``
    (this expert's rows of a zero-copy buffer, in this rank's heap, where a put's source must
    lie; nothing to copy when the expert outputs are that buffer: a zero-copy combine), then one
    put per row to ``receive_slot`` as this rank's heap names it, on ``pe``."""
    staged_words = staged.to(tl.pointer_type(tl.int32))
    if expert_x.to(tl.int64) != staged:
        for first in range(0, count, ROWS):
            rows = begin + first + tl.arange(0, ROWS)
            copy_rows(expert_x, rows, row_stride // 2, 1, staged_words, rows, first + tl.arange(0, ROWS) < count,
                      WORDS, BLOCK, False)
        signals.fence_system(GPU)   # every thread's rows written, before the puts read them
    for row in range(begin, begin + count):
        token = tl.load(src_info_ptr + row)
        topk_slot = tl.load(topk_slot_ptr + row).to(tl.int32)
        nvshmem.put_block(receive_slot + (token * MAX_TOPK + topk_slot).to(tl.int64) * (WORDS * 4),
                          staged + row.to(tl.int64) * (WORDS * 4), WORDS * 4, pe)


@kernel_names.jit("tritonep::low_latency::combine",
                  do_not_specialize=["expert_stride", "row_stride", "num_tokens", "out_row_stride", "area", "slot",
                                     "combine_offset", "slot_bytes", "rank", "timeout_ns", "num_max_tokens",
                                     "experts_per_rank", "status_address", "send_area"])
def low_latency_combine_kernel(
    x_ptr, expert_stride, row_stride, src_info_ptr, topk_slot_ptr, layout_range_ptr,
    topk_idx_ptr, topk_weights_ptr, num_tokens, out_ptr, out_row_stride, wait_stats_ptr,
    mask_ptr, dispatch_mask_ptr, combine_mask_ptr,
    peer_base_ptrs, area, my_area, slot, combine_offset, slot_bytes, rank, status_address, timeout_ns,
    num_max_tokens, experts_per_rank, send_area,
    NUM_RANKS: tl.constexpr, RANKS_PAD: tl.constexpr, HIDDEN: tl.constexpr, NUM_TOPK: tl.constexpr,
    TOPK_PAD: tl.constexpr, HAS_WAIT_STATS: tl.constexpr, HAS_MASK: tl.constexpr,
    DO_SEND: tl.constexpr, DO_RECV: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
    REDUCE_BLOCK: tl.constexpr, GPU: tl.constexpr, TRANSPORT: tl.constexpr,
):
    """``x_ptr``: the bf16 expert outputs [E/R, R*T, H] (even strides, in elements; rows move as
    int32 words);
    ``out_ptr``: bf16 [N, H]. ``status_address``: pinned host int64 for timeouts. Masks
    (shrink mode): int32 [R] each, this rank's now, its dispatch's, and this combine's (written
    by the send half). ``my_area``: ``peer_base_ptrs[rank] + area`` (passed: the first steps'
    addresses depend on it). ``peer_base_ptrs``: the peer table (``area.py``); ``TRANSPORT``
    (``device/nvshmem.py``): ``STORES``, every source by stores through it, or ``NVSHMEM``,
    sources it maps no address for by puts from ``send_area`` (the zero-copy buffer this combine
    sends from or stages in, DeepEP's choice; None with ``STORES``)."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    status_ptr = status_address.to(tl.pointer_type(tl.int64))
    control = my_area.to(tl.pointer_type(tl.int64))
    WORDS: tl.constexpr = HIDDEN // 2
    x_words = x_ptr.to(tl.pointer_type(tl.int32))
    ranks = tl.arange(0, RANKS_PAD)
    # The ranks this combine skips: masked now or at the dispatch (the receive half reuses them).
    if DO_SEND:
        masked = signals.load_rank_mask(mask_ptr, ranks, NUM_RANKS, HAS_MASK) \
            | signals.load_rank_mask(dispatch_mask_ptr, ranks, NUM_RANKS, HAS_MASK)
        signals.save_rank_mask(combine_mask_ptr, masked, ranks, NUM_RANKS, HAS_MASK)
    else:
        masked = signals.load_rank_mask(combine_mask_ptr, ranks, NUM_RANKS, HAS_MASK)

    if DO_SEND:
        call, masked = signals.begin_low_latency_send(control, SEQUENCE_SENT, FREED, SENT_USE, slot, masked, mask_ptr,
                                                      combine_mask_ptr, status_ptr, timeout_ns, PHASE_LL_COMBINE_SLOT,
                                                      NUM_RANKS, RANKS_PAD, MAX_RANKS, HAS_MASK, GPU)
        slots_per_expert = NUM_RANKS * num_max_tokens.to(tl.int64)
        # One item per (local expert, source rank); sources rotated so programs spread over links.
        for item in range(pid, experts_per_rank * NUM_RANKS, num_programs):
            local_expert = item // NUM_RANKS
            source = (rank + 1 + item % NUM_RANKS) % NUM_RANKS
            expert_rows = local_expert * slots_per_expert
            placed = tl.load(layout_range_ptr + local_expert * NUM_RANKS + source)
            begin = (placed >> 32).to(tl.int32)
            count = tl.where(signals.rank_masked(masked, ranks, source), 0, (placed & 0xFFFFFFFF).to(tl.int32))
            peer_base = tl.load(peer_base_ptrs + source)
            if TRANSPORT == NVSHMEM:
                if peer_base == 0:
                    _put_rows(x_words + local_expert * (expert_stride // 2).to(tl.int64), row_stride,
                              src_info_ptr + expert_rows, topk_slot_ptr + expert_rows, begin, count,
                              send_area + expert_rows * (WORDS * 4), my_area + combine_offset + slot * slot_bytes,
                              nvshmem.peer_pe(peer_base_ptrs, source, NUM_RANKS), WORDS, ROWS, BLOCK, GPU)
                else:
                    _store_rows(peer_base + area + combine_offset + slot * slot_bytes, x_words, local_expert,
                                expert_stride, row_stride, src_info_ptr, topk_slot_ptr, expert_rows, begin, count,
                                WORDS, ROWS, BLOCK)
            else:
                _store_rows(peer_base + area + combine_offset + slot * slot_bytes, x_words, local_expert, expert_stride,
                            row_stride, src_info_ptr, topk_slot_ptr, expert_rows, begin, count, WORDS, ROWS, BLOCK)
        # One fence for all of this program's rows, then the flags: no round trip per item. With
        # NVSHMEM the puts must have arrived too (quiet: a fence orders puts to one PE, but this
        # program's puts may go over other queues than its flags' signals).
        signals.fence_system(GPU)
        if TRANSPORT == NVSHMEM:
            nvshmem.quiet()
        for item in range(pid, experts_per_rank * NUM_RANKS, num_programs):
            local_expert = item // NUM_RANKS
            source = (rank + 1 + item % NUM_RANKS) % NUM_RANKS
            if not signals.rank_masked(masked, ranks, source):
                flag = (tl.load(peer_base_ptrs + source) + area).to(tl.pointer_type(tl.int64)) + FLAGS \
                    + slot * MAX_EXPERTS + rank * experts_per_rank + local_expert
                signals.write_peer_word(flag, peer_base_ptrs, source, call, my_area - area, NUM_RANKS, TRANSPORT, GPU)

    if DO_RECV:
        call = signals.load_own_counter(control + SEQUENCE_RECEIVED + slot) + 1
        received = (my_area + combine_offset + slot * slot_bytes).to(tl.pointer_type(tl.bfloat16))
        if HAS_WAIT_STATS:
            for expert in range(pid, experts_per_rank * NUM_RANKS, num_programs):
                owner = expert // experts_per_rank
                if not signals.rank_masked(masked, ranks, owner):
                    started = signals.now_ns(GPU)
                    one = ranks == 0
                    signals.wait_all_at_least(
                        control + FLAGS + slot * MAX_EXPERTS + expert + ranks * 0,
                        call + tl.zeros([RANKS_PAD], tl.int64), one, status_ptr, timeout_ns, PHASE_LL_COMBINE_DATA,
                        owner + ranks * 0, mask_ptr, combine_mask_ptr, NUM_RANKS, HAS_MASK, GPU)
                    tl.atomic_add(wait_stats_ptr + owner, signals.now_ns(GPU) - started, sem="relaxed")
        column_blocks = tl.cdiv(HIDDEN, REDUCE_BLOCK)
        ks = tl.arange(0, TOPK_PAD)
        for item in range(pid, num_tokens * column_blocks, num_programs):
            token = item // column_blocks
            columns = (item % column_blocks) * REDUCE_BLOCK + tl.arange(0, REDUCE_BLOCK)
            experts = tl.load(topk_idx_ptr + token * NUM_TOPK + ks, mask=ks < NUM_TOPK, other=-1)
            weights = tl.load(topk_weights_ptr + token * NUM_TOPK + ks, mask=ks < NUM_TOPK, other=0.0)
            # Experts of masked ranks count as absent: not waited for, not added.
            present = (experts >= 0) & ~signals.ranks_masked(masked, ranks, tl.maximum(experts, 0) // experts_per_rank)
            # The flags of all of the token's experts at once. Shrink mode: an expert whose rank
            # timed out (now or in an earlier wait of this call) counts as absent too.
            target = call + tl.zeros([TOPK_PAD], tl.int64)
            flags = signals.wait_all_at_least(control + FLAGS + slot * MAX_EXPERTS + tl.maximum(experts, 0), target,
                                              present, status_ptr, timeout_ns, PHASE_LL_COMBINE_DATA,
                                              (tl.maximum(experts, 0) // experts_per_rank).to(tl.int32), mask_ptr,
                                              combine_mask_ptr, NUM_RANKS, HAS_MASK, GPU)
            present = present & ~signals.gave_up(flags, target)
            rows = tl.load(received + (token * MAX_TOPK + ks).to(tl.int64)[:, None] * HIDDEN + columns[None, :],
                           mask=present[:, None] & (columns < HIDDEN)[None, :], other=0.0, cache_modifier=".cg")
            total = tl.sum(rows.to(tl.float32) * weights[:, None], axis=0)
            tl.store(out_ptr + token.to(tl.int64) * out_row_stride + columns, total.to(tl.bfloat16),
                     mask=columns < HIDDEN)

    signals.finish_low_latency_launch(
        control, peer_base_ptrs, area, slot, rank, masked, SEQUENCE_SENT, SEQUENCE_RECEIVED, SENT_USE, DONE_SEND,
        DONE_RECEIVE, FREED, my_area - area, NUM_RANKS, RANKS_PAD, MAX_RANKS, DO_SEND, DO_RECV, GPU, TRANSPORT)
