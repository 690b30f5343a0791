"""Normal-mode combine over NVLink: push rows home, reduce as they arrive.

The reverse of dispatch. The received block from source s sits in ``x`` at the rows
``rank_prefix_matrix`` gives; each of its rows goes back to s, into s's combine staging
area, grouped by the rank it comes from (the order of s's own send lists, so s finds the copy
of token t from rank r at ``offset[r] + send_pos[t, r]``).

* **Sender programs** split every returning block into ``NUM_SENDERS`` channels, push the
  rows (and top-k weights), one tile to each peer in turn, and publish progress counters like
  dispatch does.
* **Reducer programs** walk the tokens in stages; before a stage they wait until every
  channel holding one of the stage's rows has delivered it, then sum each token's copies in
  float32 (our own copy is read straight from ``x``), add the biases and write bf16. Stages
  let reduction overlap the transfer.

With ``NUM_SENDERS == 0`` the rows come from the copy engines instead
(``combine_copy_engine.py``): each peer's block arrives in pieces in token order, so the
reducers take stages interleaved (stage i on program i % P) to follow the arriving front. SM
senders fill all their channels at once, so there each reducer owns one contiguous range of
tokens, about one channel's worth.

Tail words: an SM sender publishes ``(epoch << 32) | rows so far`` in its channel's word, so
the words never go back. The copy engines' pieces publish plain ``rows so far`` in a word per
source of their own (``SignalLayout.combine_copy_tail``): the same values every call, so that a
call's copies and writes can be captured once as a CUDA graph and replayed. The receiver sets
those words back to 0 once all its reducers are past their last wait, before they release the
staging to the peers, and no peer writes the next call's values before that release
(``clear_copy_tails``).

As in dispatch, a sender waits for the destination's reducers to finish the previous call
before overwriting its staging rows (``combine_done`` reaching ``released_target``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tritonep.device.rows import block_count, block_start, channel_range, copy_rows
from tritonep.device.signals import add_release, last_program_done, publish, wait_at_least
from tritonep.device.status_codes import PHASE_COMBINE_DATA, PHASE_COMBINE_SLOT
from tritonep.runtime import kernel_names
from tritonep.runtime.launcher import FastLauncher


@triton.jit
def _rows_sent_to(prefix_ptr, source, ranks, NUM_RANKS: tl.constexpr):
    """Vector over ``ranks``: rows ``source`` sent to each rank (its send-list lengths)."""
    mask = ranks < NUM_RANKS
    end = tl.load(prefix_ptr + source * NUM_RANKS + ranks, mask=mask, other=0)
    begin = tl.load(prefix_ptr + (source - 1) * NUM_RANKS + ranks, mask=mask & (source > 0), other=0)
    return end - begin


@kernel_names.jit("tritonep::intranode::combine",
                  do_not_specialize=["rank", "epoch", "released_target", "num_tokens", "capacity", "timeout_ns"])
def combine_kernel(
    # Inputs: the rows to return (bf16, and the same memory as 4-byte words), their top-k weights
    # and the biases (x where absent: never read); with OWN_SLOTS the dispatch's global expert
    # ids of this rank's tokens and the experts per rank (x where absent).
    x_ptr, x_words_ptr, weights_ptr, bias0_ptr, bias1_ptr, hidden, topk_idx_ptr, experts_per_rank,
    # Send plan (the handle's): rank_prefix_matrix, which ranks each token went to, and its
    # position in each rank's send list.
    prefix_ptr, is_token_in_rank_ptr, send_pos_ptr,
    # Outputs: the combined tokens and their weights (out where absent).
    out_ptr, out_weights_ptr, num_tokens,
    # Staging area: every rank's allocation, this rank, the byte offsets of the combine regions
    # (memory.StagingLayout) and the rows they hold.
    peer_base_ptrs, rank, staging_x, staging_weights, capacity,
    # Call counters: this call's epoch, and the reducer programs all earlier calls counted.
    epoch, released_target,
    # Status: where a wait that gives up reports (pinned host memory), and after how long.
    status_ptr, timeout_ns,
    # Signal words, program roles, row fields, tile shape.
    TAIL_WORD: tl.constexpr, TAIL_STRIDE: tl.constexpr, DONE_WORD: tl.constexpr, FINISHED_WORD: tl.constexpr,
    NUM_RANKS: tl.constexpr, RANKS_PAD: tl.constexpr, NUM_SENDERS: tl.constexpr, NUM_REDUCERS: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr, OWN_SLOTS: tl.constexpr, NUM_TOPK: tl.constexpr, TOPK_PAD: tl.constexpr,
    HAS_BIAS0: tl.constexpr, HAS_BIAS1: tl.constexpr,
    NUM_CHANNELS: tl.constexpr, ROWS: tl.constexpr, COPY_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
    TOKENS: tl.constexpr, STAGE: tl.constexpr, SIGNAL_EVERY: tl.constexpr, GPU: tl.constexpr,
):
    pid = tl.program_id(0)
    my_base = tl.load(peer_base_ptrs + rank)
    my_signals = my_base.to(tl.pointer_type(tl.int64))
    stamp = epoch.to(tl.int64) << 32
    if NUM_SENDERS == 0:   # the copy engines' tail words hold plain row counts (module docstring)
        stamp = stamp * 0
    ranks = tl.arange(0, RANKS_PAD)
    if pid < NUM_SENDERS:
        # Sender pid moves channel pid of the block returning to every peer, one tile to each
        # peer in turn: a source's reducers need a token's rows from every expert rank, so
        # fronts that advance together let them reduce while rows arrive, not after the last
        # peer's rows came.
        longest = 0
        for step in range(0, NUM_RANKS - 1):
            source = (rank + 1 + step) % NUM_RANKS
            lo, hi = channel_range(block_count(prefix_ptr, source, rank, NUM_RANKS), pid, NUM_SENDERS)
            longest = tl.maximum(longest, hi - lo)
            if hi > lo:
                wait_at_least(my_signals + DONE_WORD + source, released_target.to(tl.int64),
                              status_ptr, timeout_ns, PHASE_COMBINE_SLOT, source, GPU)
        row_words = hidden // 2   # rows travel as 4-byte words (x_words_ptr aliases x)
        tiles = 0
        for tile0 in range(0, longest, ROWS):
            tiles += 1
            for step in range(0, NUM_RANKS - 1):
                source = (rank + 1 + step) % NUM_RANKS
                start = block_start(prefix_ptr, source, rank, NUM_RANKS)
                lo, hi = channel_range(block_count(prefix_ptr, source, rank, NUM_RANKS), pid, NUM_SENDERS)
                row0 = lo + tile0
                if row0 < hi:
                    # Where our rows start in the source's staging: after rows from lower ranks.
                    offset = tl.sum(tl.where(ranks < rank, _rows_sent_to(prefix_ptr, source, ranks, NUM_RANKS), 0),
                                    axis=0)
                    peer_base = tl.load(peer_base_ptrs + source)
                    dst_x = tl.multiple_of((peer_base + staging_x).to(tl.pointer_type(tl.int32)), 16)
                    rows = row0 + tl.arange(0, ROWS)
                    dst_rows = offset + rows
                    mask = (rows < hi) & (dst_rows < capacity)
                    copy_rows(x_words_ptr, start + rows, row_words, 1, dst_x, dst_rows, mask, row_words, COPY_BLOCK,
                              False)
                    if HAS_WEIGHTS:
                        dst_weights = (peer_base + staging_weights).to(tl.pointer_type(tl.float32))
                        copy_rows(weights_ptr, start + rows, NUM_TOPK, 1, dst_weights, dst_rows, mask, NUM_TOPK, 16,
                                  False)
                    if (tiles % SIGNAL_EVERY == 0) | (row0 + ROWS >= hi):
                        tail = peer_base.to(tl.pointer_type(tl.int64)) + TAIL_WORD + rank * TAIL_STRIDE + pid
                        publish(tail, stamp + tl.minimum(row0 + ROWS, hi) - lo)
    else:
        reducer = pid - NUM_SENDERS
        row_base = staging_row_base(prefix_ptr, rank, NUM_RANKS, RANKS_PAD)
        if NUM_SENDERS == 0:   # pieces from the copy engines, in token order
            t_lo, t_hi, stride = reducer * STAGE, num_tokens, NUM_REDUCERS * STAGE
        else:
            per_reducer = tl.cdiv(num_tokens, NUM_REDUCERS)
            t_lo = tl.minimum(reducer * per_reducer, num_tokens)
            t_hi, stride = tl.minimum(t_lo + per_reducer, num_tokens), STAGE
        for stage0 in range(t_lo, t_hi, stride):
            stage1 = tl.minimum(stage0 + STAGE, t_hi)
            _wait_for_stage(prefix_ptr, send_pos_ptr, my_signals, stage0, stage1, rank, stamp, status_ptr,
                            timeout_ns, TAIL_WORD, TAIL_STRIDE, NUM_RANKS, NUM_CHANNELS, GPU)
            reduce_tokens(x_ptr, weights_ptr, is_token_in_rank_ptr, send_pos_ptr, bias0_ptr, bias1_ptr, out_ptr,
                          out_weights_ptr, my_base + staging_x, my_base + staging_weights, row_base, capacity,
                          stage0, stage1, hidden, rank, topk_idx_ptr, experts_per_rank, NUM_RANKS, RANKS_PAD,
                          HAS_WEIGHTS, OWN_SLOTS, NUM_TOPK, TOPK_PAD, HAS_BIAS0, HAS_BIAS1, BLOCK, TOKENS)
        if NUM_SENDERS == 0:
            clear_copy_tails(my_signals, TAIL_WORD, FINISHED_WORD, NUM_RANKS, RANKS_PAD)
        release_staging(peer_base_ptrs, my_signals, rank, released_target + NUM_REDUCERS, reducer == NUM_REDUCERS - 1,
                        status_ptr, timeout_ns, DONE_WORD, NUM_RANKS, GPU)


@triton.jit
def staging_row_base(prefix_ptr, rank, NUM_RANKS: tl.constexpr, RANKS_PAD: tl.constexpr):
    """Vector over ranks r: where rank r's copies of our tokens start, as rows. Our own copies
    are rows of ``x`` (our block of it); the others' are rows of our combine staging, grouped
    by expert rank in rank order (the order of our dispatch send lists)."""
    ranks = tl.arange(0, RANKS_PAD)
    sent = _rows_sent_to(prefix_ptr, rank, ranks, NUM_RANKS)
    staging_offset = tl.cumsum(sent, axis=0) - sent
    own_start = block_start(prefix_ptr, rank, rank, NUM_RANKS)
    return tl.where(ranks == rank, own_start, staging_offset)


@triton.jit
def reduce_tokens(x_ptr, weights_ptr, is_token_in_rank_ptr, send_pos_ptr, bias0_ptr, bias1_ptr, out_ptr,
                  out_weights_ptr, staging_x_address, staging_weights_address, row_base, capacity, t_lo, t_hi,
                  hidden, rank, topk_idx_ptr, experts_per_rank, NUM_RANKS: tl.constexpr, RANKS_PAD: tl.constexpr,
                  HAS_WEIGHTS: tl.constexpr, OWN_SLOTS: tl.constexpr, NUM_TOPK: tl.constexpr, TOPK_PAD: tl.constexpr,
                  HAS_BIAS0: tl.constexpr, HAS_BIAS1: tl.constexpr, BLOCK: tl.constexpr, TOKENS: tl.constexpr):
    """out[t] = biases + sum of token t's copies, for tokens [t_lo, t_hi), whose copies have all
    arrived: our own copy from ``x``, every other rank's from staging (``row_base`` + its
    position in that rank's send list). Sums in float32, stores bf16; weights likewise, or,
    with ``OWN_SLOTS`` (V2), slot k's weight only from the rank of k's expert."""
    ranks = tl.arange(0, RANKS_PAD)
    rank_mask = ranks < NUM_RANKS
    # Staging regions start on 4096-byte boundaries of a symmetric allocation; saying so (and
    # leaving ``hidden`` specialised) lets the compiler move rows in 16-byte vectors instead of
    # one bf16 at a time, several times fewer memory instructions.
    staged_x = tl.multiple_of(staging_x_address.to(tl.pointer_type(tl.bfloat16)), 16)
    staged_weights = tl.multiple_of(staging_weights_address.to(tl.pointer_type(tl.float32)), 16)
    for t0 in range(t_lo, t_hi, TOKENS):
        tokens = t0 + tl.arange(0, TOKENS)
        token_mask = tokens < t_hi
        pair_offsets = tokens.to(tl.int64)[:, None] * NUM_RANKS + ranks[None, :]
        pair_mask = token_mask[:, None] & rank_mask[None, :]
        in_rank = tl.load(is_token_in_rank_ptr + pair_offsets, mask=pair_mask, other=0) != 0
        rows = (row_base[None, :] + tl.load(send_pos_ptr + pair_offsets, mask=pair_mask, other=0)).to(tl.int64)
        own = in_rank & (ranks == rank)[None, :]
        staged = in_rank & (ranks != rank)[None, :] & (rows < capacity)
        for c0 in range(0, hidden, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            out_offsets = tokens.to(tl.int64)[:, None] * hidden + cols[None, :]
            out_mask = token_mask[:, None] & (cols < hidden)[None, :]
            total = tl.zeros([TOKENS, BLOCK], dtype=tl.float32)
            if HAS_BIAS0:
                total += tl.load(bias0_ptr + out_offsets, mask=out_mask, other=0.0).to(tl.float32)
            if HAS_BIAS1:
                total += tl.load(bias1_ptr + out_offsets, mask=out_mask, other=0.0).to(tl.float32)
            # One [TOKENS, BLOCK] tile per source rank, summed in registers: reducing over a
            # rank axis of a 3-D tile would go through shared memory on every block. Each
            # lane's row comes from x (our own copy) or from staging: one load from the
            # selected base, predicated off where the token did not go to that rank.
            for lane in tl.static_range(NUM_RANKS):
                pick = ranks[None, :] == lane
                lane_row = tl.sum(tl.where(pick, rows, 0), axis=1) * hidden
                from_x = tl.sum(tl.where(pick & own, 1, 0), axis=1) > 0
                present = tl.sum(tl.where(pick & (own | staged), 1, 0), axis=1) > 0
                base = tl.where(from_x, x_ptr + lane_row, staged_x + lane_row)
                total += tl.load(base[:, None] + cols[None, :], mask=present[:, None] & out_mask, other=0.0,
                                 cache_modifier=".cg").to(tl.float32)
            tl.store(out_ptr + out_offsets, total.to(tl.bfloat16), mask=out_mask)
        if HAS_WEIGHTS:
            slots = tl.arange(0, TOPK_PAD)
            slot_mask = (slots < NUM_TOPK)[None, None, :]
            if OWN_SLOTS:
                # The rank of each slot's expert (-1 for none): the only rank whose weight counts.
                # Here rather than at the senders, where the weights would need a masked copy.
                ids = tl.load(topk_idx_ptr + tokens.to(tl.int64)[:, None] * NUM_TOPK + slots[None, :],
                              mask=token_mask[:, None] & (slots < NUM_TOPK)[None, :], other=-1)
                owner = tl.where(ids >= 0, ids // experts_per_rank, -1)
                slot_mask = slot_mask & (ranks[None, :, None] == owner[:, None, :])
            offsets = rows[:, :, None] * NUM_TOPK + slots[None, None, :]
            weights = tl.load(weights_ptr + offsets, mask=own[:, :, None] & slot_mask, other=0.0)
            weights += tl.load(staged_weights + offsets, mask=staged[:, :, None] & slot_mask, other=0.0,
                               cache_modifier=".cg")
            out_offsets = tokens.to(tl.int64)[:, None] * NUM_TOPK + slots[None, :]
            tl.store(out_weights_ptr + out_offsets, tl.sum(weights, axis=1),
                     mask=token_mask[:, None] & (slots < NUM_TOPK)[None, :])


@triton.jit
def clear_copy_tails(my_signals, TAIL_WORD: tl.constexpr, FINISHED_WORD: tl.constexpr, NUM_RANKS: tl.constexpr,
                     RANKS_PAD: tl.constexpr):
    """The last reducer past its waits (every program of a copy-engine combine is a reducer)
    sets the copy engines' tail words back to 0 for the next call.

    No reducer reads them after this: the others counted themselves in ``FINISHED_WORD`` after
    their last wait, and the acq_rel count orders their reads before the stores. No peer writes
    them again before this: a peer's next copies start after its own reduction of this call,
    whose last program waits in ``release_staging`` for every reducer of ours, this one
    included, and this one releases only after the stores. And every peer's last tail write of
    this call came first: some reducer of ours waited for each peer's full row count, which
    only the peer's last piece writes.
    """
    if last_program_done(my_signals + FINISHED_WORD):
        ranks = tl.arange(0, RANKS_PAD)
        tl.store(my_signals + TAIL_WORD + ranks, tl.zeros([RANKS_PAD], dtype=tl.int64), mask=ranks < NUM_RANKS)


@triton.jit
def release_staging(peer_base_ptrs, my_signals, rank, target, last_program, status_ptr, timeout_ns,
                    DONE_WORD: tl.constexpr, NUM_RANKS: tl.constexpr, GPU: tl.constexpr):
    """This program's reads of staging are done: count it at every expert rank. Then the last
    program (last also under the interpreter, which runs programs in order) waits until every
    peer's reducers finished this call (``target``): the next combine may then write into any
    peer's staging without a wait of its own, which the copy-engine path cannot do."""
    for step in range(0, NUM_RANKS - 1):
        peer = (rank + 1 + step) % NUM_RANKS
        peer_signals = tl.load(peer_base_ptrs + peer).to(tl.pointer_type(tl.int64))
        add_release(peer_signals + DONE_WORD + rank, 1)
    if last_program:
        for step in range(0, NUM_RANKS - 1):
            peer = (rank + 1 + step) % NUM_RANKS
            wait_at_least(my_signals + DONE_WORD + peer, target.to(tl.int64), status_ptr, timeout_ns,
                          PHASE_COMBINE_SLOT, peer, GPU)


@triton.jit
def _wait_for_stage(prefix_ptr, send_pos_ptr, my_signals, stage0, stage1, rank, stamp, status_ptr, timeout_ns,
                    TAIL_WORD: tl.constexpr, TAIL_STRIDE: tl.constexpr, NUM_RANKS: tl.constexpr,
                    NUM_CHANNELS: tl.constexpr, GPU: tl.constexpr):
    """Wait until every remote row that tokens [stage0, stage1) need has arrived.

    Those tokens' copies from rank r are rows [send_pos[stage0, r], send_pos[stage1, r]) of
    r's returning block (positions are monotone in the token index), so only the channels
    covering that range are polled, each up to the last row needed from it.
    """
    for step in range(0, NUM_RANKS - 1):
        peer = (rank + 1 + step) % NUM_RANKS
        first = tl.load(send_pos_ptr + stage0 * NUM_RANKS + peer)
        last = tl.load(send_pos_ptr + stage1 * NUM_RANKS + peer)
        count = block_count(prefix_ptr, rank, peer, NUM_RANKS)
        chunk = tl.maximum(tl.cdiv(count, NUM_CHANNELS), 1)
        if last > first:
            for channel in range(first // chunk, (last - 1) // chunk + 1):
                needed = tl.minimum(last, (channel + 1) * chunk) - channel * chunk
                wait_at_least(my_signals + TAIL_WORD + peer * TAIL_STRIDE + channel, stamp + needed, status_ptr,
                              timeout_ns, PHASE_COMBINE_DATA, peer, GPU)


# A launch converts only these arguments per call; the others are fixed per Buffer and tuning
# or by the call's shape and options, which the caller's setup key stands for.
COMBINE = FastLauncher(combine_kernel, changing=(
    "x_ptr", "x_words_ptr", "weights_ptr", "topk_idx_ptr", "prefix_ptr", "is_token_in_rank_ptr", "send_pos_ptr",
    "bias0_ptr", "bias1_ptr", "out_ptr", "out_weights_ptr", "num_tokens", "epoch", "released_target"))
