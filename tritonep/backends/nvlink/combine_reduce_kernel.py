"""Normal-mode combine with the copy engines: rows cross NVLink without any SM, SMs only reduce.

In combine, the rows an expert rank returns to source s are one contiguous block of its
``x`` (dispatch laid them out by source), and they land in one contiguous range of s's
combine staging (grouped by expert rank). When the host knows the counts (every dispatch that
read them back), the backend moves each block with one ``cudaMemcpyAsync`` into the peer's
symmetric memory, one stream per peer, so the copy engines carry the bulk bytes at link speed
while the SMs stay free (the issue's design: SMs gather/scatter locally, copy engines cross
NVLink). This kernel then runs after those copies, in stream order:

1. For each peer, one program pushes the small top-k weight block (``count * K`` floats,
   contiguous on both sides) and publishes "everything from this rank has arrived" into the
   peer's tail word. The copies finished before the kernel started, so the release store
   orders them too.
2. Every program waits for that word from all peers, then reduces its range of tokens from
   local memory only (our own copies from ``x``, the rest from staging) at HBM speed.
3. ``release_staging`` counts the reads done and makes the last program wait for every peer's
   reducers, so the next combine's copies may start without a wait on the device.

The SM-only kernel (``combine_kernel.py``) stays for dispatches whose counts never reached
the host (``num_worst_tokens``): it shares the reduction and the release with this one.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .combine_kernel import _rows_sent_to, reduce_tokens, release_staging, staging_row_base
from .rows import block_count, block_start
from .sync import PHASE_COMBINE_DATA, publish, wait_at_least


@triton.jit(do_not_specialize=["rank", "epoch", "released_target", "num_tokens", "capacity", "timeout_ns"])
def combine_reduce_kernel(
    x_ptr, weights_ptr, prefix_ptr, is_token_in_rank_ptr, send_pos_ptr, bias0_ptr, bias1_ptr,
    out_ptr, out_weights_ptr, num_tokens, hidden,
    peer_base_ptrs, staging_x, staging_weights, capacity,
    rank, epoch, released_target, status_ptr, timeout_ns,
    TAIL_WORD: tl.constexpr, DONE_WORD: tl.constexpr, MAX_CHANNELS: tl.constexpr,
    NUM_RANKS: tl.constexpr, RANKS_PAD: tl.constexpr, NUM_REDUCERS: tl.constexpr, PUBLISHERS: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr, NUM_TOPK: tl.constexpr, TOPK_PAD: tl.constexpr,
    HAS_BIAS0: tl.constexpr, HAS_BIAS1: tl.constexpr, BLOCK: tl.constexpr, TOKENS: tl.constexpr,
    GPU: tl.constexpr,
):
    pid = tl.program_id(0)
    my_base = tl.load(peer_base_ptrs + rank)
    my_signals = my_base.to(tl.pointer_type(tl.int64))
    stamp = epoch.to(tl.int64) << 32
    ranks = tl.arange(0, RANKS_PAD)
    # 1. Weights, then "complete" (PUBLISHERS programs share the peers; one under the
    #    interpreter, where a later program cannot run while an earlier one waits).
    for step in range(pid, NUM_RANKS - 1, PUBLISHERS):
        peer = (rank + 1 + step) % NUM_RANKS
        peer_base = tl.load(peer_base_ptrs + peer)
        if HAS_WEIGHTS:
            start = block_start(prefix_ptr, peer, rank, NUM_RANKS)
            count = block_count(prefix_ptr, peer, rank, NUM_RANKS)
            offset = tl.sum(tl.where(ranks < rank, _rows_sent_to(prefix_ptr, peer, ranks, NUM_RANKS), 0), axis=0)
            count = tl.minimum(count, capacity - offset)
            src = weights_ptr + start.to(tl.int64) * NUM_TOPK
            dst = (peer_base + staging_weights).to(tl.pointer_type(tl.float32)) + offset.to(tl.int64) * NUM_TOPK
            for e0 in range(0, count * NUM_TOPK, 1024):
                elements = e0 + tl.arange(0, 1024)
                mask = elements < count * NUM_TOPK
                tl.store(dst + elements, tl.load(src + elements, mask=mask), mask=mask)
        publish(peer_base.to(tl.pointer_type(tl.int64)) + TAIL_WORD + rank * MAX_CHANNELS, stamp + 1)
    # 2. Every peer's rows are in our staging.
    for step in range(0, NUM_RANKS - 1):
        peer = (rank + 1 + step) % NUM_RANKS
        wait_at_least(my_signals + TAIL_WORD + peer * MAX_CHANNELS, stamp + 1, status_ptr, timeout_ns,
                      PHASE_COMBINE_DATA, peer, GPU)
    # 3. Reduce from local memory, 4. release staging.
    per_program = tl.cdiv(num_tokens, NUM_REDUCERS)
    t_lo = tl.minimum(pid * per_program, num_tokens)
    t_hi = tl.minimum(t_lo + per_program, num_tokens)
    reduce_tokens(x_ptr, weights_ptr, is_token_in_rank_ptr, send_pos_ptr, bias0_ptr, bias1_ptr, out_ptr,
                  out_weights_ptr, my_base + staging_x, my_base + staging_weights,
                  staging_row_base(prefix_ptr, rank, NUM_RANKS, RANKS_PAD), capacity, t_lo, t_hi, hidden, rank,
                  NUM_RANKS, RANKS_PAD, HAS_WEIGHTS, NUM_TOPK, TOPK_PAD, HAS_BIAS0, HAS_BIAS1, BLOCK, TOKENS)
    release_staging(peer_base_ptrs, my_signals, rank, released_target + NUM_REDUCERS, pid == NUM_REDUCERS - 1,
                    status_ptr, timeout_ns, DONE_WORD, NUM_RANKS, GPU)
