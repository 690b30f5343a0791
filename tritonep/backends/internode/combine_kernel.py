"""The internode combine's kernels: reduce inside the node, send one row per token and node.

1. ``stage_kernel``: once the ranks of its node finished reading the previous combine's rows,
   a rank copies its combine input (rows as received by the dispatch, and their top-k weights)
   into its heap's staging area; the last program tells the ranks of its node, over the node's
   pointers.
2. ``node_reduce_kernel``: the rank that a source's rows landed at in the dispatch sums, for
   each of them, the copies the ranks of its node hold (their positions were kept by the
   dispatch), in float32, and puts the sums back to that source over the transport, one row per
   token and node, with a signal per chunk.
3. ``final_reduce_kernel``: a source adds its tokens' sums from every node (and the biases) and
   rounds once to bf16; then tells every node, over the transport, that its area is free.

The sums travel in float32: a token's result is then the float32 sum of its terms rounded
once, as in one node (bf16 sums would halve the bytes and round twice).
"""

from __future__ import annotations

import triton.language as tl

from tritonep.backends.internode.transport import put_signal, signal_add, wait_signal
from tritonep.device.rows import channel_range, lane_column
from tritonep.device.signals import add_release, fence_system, last_program_done, publish, wait_at_least
from tritonep.device.status_codes import PHASE_NET_COMBINE_DATA, PHASE_NET_COMBINE_SLOT, PHASE_NODE_COMBINE_DATA
from tritonep.runtime import kernel_names


@kernel_names.jit("tritonep::internode::stage_rows",
                  do_not_specialize=["rank", "epoch", "num_rows", "released_target"])
def stage_kernel(x_ptr, weights_ptr, num_rows, hidden_words, node_peer_ptrs, heap_base, rank, staging_x,
                 staging_weights, epoch, released_target, status_ptr, timeout_ns,
                 STAGED: tl.constexpr, STAGING_FREE: tl.constexpr, DONE: tl.constexpr,
                 RANKS_PER_NODE: tl.constexpr, NUM_TOPK: tl.constexpr, WEIGHTS_PAD: tl.constexpr,
                 HAS_WEIGHTS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, GPU: tl.constexpr):
    my_node = rank // RANKS_PER_NODE
    for peer in range(0, RANKS_PER_NODE):
        wait_at_least((heap_base + STAGING_FREE + peer * 8).to(tl.pointer_type(tl.int64)),
                      tl.zeros((), tl.int64) + released_target,
                      status_ptr, timeout_ns, PHASE_NODE_COMBINE_DATA, my_node * RANKS_PER_NODE + peer, GPU)
    out_x = (heap_base + staging_x).to(tl.pointer_type(tl.int32))
    out_weights = (heap_base + staging_weights).to(tl.pointer_type(tl.float32))
    for row0 in range(tl.program_id(0) * ROWS, num_rows, tl.num_programs(0) * ROWS):
        rows = (row0 + tl.arange(0, ROWS)).to(tl.int64)
        for c0 in range(0, hidden_words, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            mask = (rows < num_rows)[:, None] & (cols < hidden_words)[None, :]
            offsets = rows[:, None] * hidden_words + cols[None, :]
            tl.store(out_x + offsets, tl.load(x_ptr + offsets, mask=mask), mask=mask)
        if HAS_WEIGHTS:
            slots = tl.arange(0, WEIGHTS_PAD)
            mask = (rows < num_rows)[:, None] & (slots < NUM_TOPK)[None, :]
            values = tl.load(weights_ptr + rows[:, None] * NUM_TOPK + slots[None, :], mask=mask)
            tl.store(out_weights + rows[:, None] * WEIGHTS_PAD + slots[None, :], values, mask=mask)
    if last_program_done((heap_base + DONE).to(tl.pointer_type(tl.int64))):
        fence_system(GPU)
        for peer in range(0, RANKS_PER_NODE):
            peer_base = tl.load(node_peer_ptrs + my_node * RANKS_PER_NODE + peer)
            publish((peer_base + STAGED + (rank % RANKS_PER_NODE) * 8).to(tl.pointer_type(tl.int64)),
                    epoch.to(tl.int64))


@kernel_names.jit("tritonep::internode::combine",
                  do_not_specialize=["rank", "epoch", "cap", "kept_rows", "released_target"])
def node_reduce_kernel(
    node_peer_ptrs, transport_table, heap_base, rank, prefix_ptr, landing_rows_ptr, kept_pos_ptr, kept_rows,
    hidden, staging_x, staging_weights, partial_send, partial_landing, cap, epoch, released_target,
    status_ptr, timeout_ns,
    STAGED: tl.constexpr, STAGING_FREE: tl.constexpr, TAIL: tl.constexpr, FREE: tl.constexpr, DONE: tl.constexpr,
    RANKS_PER_NODE: tl.constexpr, NUM_NODES: tl.constexpr, NUM_RANKS: tl.constexpr, CHANNELS: tl.constexpr,
    WEIGHTS_PAD: tl.constexpr, HAS_WEIGHTS: tl.constexpr, NODE_PAD: tl.constexpr, ROWS: tl.constexpr,
    BLOCK: tl.constexpr, GPU: tl.constexpr, TRANSPORT: tl.constexpr,
):
    my_node = rank // RANKS_PER_NODE
    my_local = rank % RANKS_PER_NODE
    for peer in range(0, RANKS_PER_NODE):
        wait_at_least((heap_base + STAGED + peer * 8).to(tl.pointer_type(tl.int64)), tl.zeros((), tl.int64) + epoch,
                      status_ptr,
                      timeout_ns, PHASE_NODE_COMBINE_DATA, my_node * RANKS_PER_NODE + peer, GPU)
    row_width = hidden + WEIGHTS_PAD      # float32 words of a partial row
    # The node's ranks are the lanes of [ROWS, NODE_PAD] tiles: where each row's copy sits in
    # each lane's staging is worked out once per tile of rows, not once per column block, so
    # the column loop waits on data loads only, and the lanes' loads are independent.
    lanes = tl.arange(0, NODE_PAD)
    lane_mask = lanes < RANKS_PER_NODE
    node_ranks = my_node * RANKS_PER_NODE + lanes
    peer_bases = tl.load(node_peer_ptrs + node_ranks, mask=lane_mask, other=0)
    for item in range(tl.program_id(0), NUM_NODES * CHANNELS, tl.num_programs(0)):
        source_node = item // CHANNELS
        chunk = item % CHANNELS
        source = source_node * RANKS_PER_NODE + my_local
        lo, hi = channel_range(tl.load(landing_rows_ptr + my_local * NUM_NODES + source_node), chunk, CHANNELS)
        wait_signal(heap_base, FREE + source_node * 8, released_target, status_ptr, timeout_ns,
                    PHASE_NET_COMBINE_SLOT, source, GPU)
        # First row of the source's block in each node rank's staging (rank_prefix_matrix).
        starts = tl.load(prefix_ptr + (source - 1) * NUM_RANKS + node_ranks, mask=lane_mask & (source > 0), other=0)
        sums = (heap_base + partial_send).to(tl.pointer_type(tl.float32)) + source_node.to(tl.int64) * cap * row_width
        for row0 in range(lo, hi, ROWS):
            rows = row0 + tl.arange(0, ROWS)
            mask = rows < hi
            pair_mask = mask[:, None] & lane_mask[None, :]
            pos = tl.load(kept_pos_ptr + (source_node * kept_rows + rows).to(tl.int64)[:, None] * RANKS_PER_NODE
                          + lanes[None, :], mask=pair_mask, other=-1)
            present = pair_mask & (pos >= 0)
            staged = (starts[None, :] + pos).to(tl.int64)          # row in each lane's staging
            x_rows = peer_bases[None, :] + staging_x + staged * (2 * hidden)     # byte addresses
            out_rows = sums + rows.to(tl.int64)[:, None] * row_width
            for c0 in range(0, hidden, BLOCK):
                cols = c0 + tl.arange(0, BLOCK)
                col_mask = (cols < hidden)[None, :]
                acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
                for lane in tl.static_range(RANKS_PER_NODE):
                    row_x, here = lane_column(x_rows, present, lanes, lane)
                    acc += tl.load(row_x.to(tl.pointer_type(tl.bfloat16))[:, None] + cols[None, :],
                                   mask=here[:, None] & col_mask, other=0.0, cache_modifier=".cg").to(tl.float32)
                tl.store(out_rows + cols[None, :], acc, mask=mask[:, None] & col_mask)
            if HAS_WEIGHTS:
                slots = tl.arange(0, WEIGHTS_PAD)
                w_rows = peer_bases[None, :] + staging_weights + staged * (4 * WEIGHTS_PAD)
                acc_w = tl.zeros([ROWS, WEIGHTS_PAD], dtype=tl.float32)
                for lane in tl.static_range(RANKS_PER_NODE):
                    row_w, here = lane_column(w_rows, present, lanes, lane)
                    acc_w += tl.load(row_w.to(tl.pointer_type(tl.float32))[:, None] + slots[None, :],
                                     mask=here[:, None], other=0.0, cache_modifier=".cg")
                tl.store(out_rows + hidden + slots[None, :], acc_w, mask=mask[:, None])
        put_signal(transport_table, heap_base, partial_landing + ((my_node * cap + lo) * row_width).to(tl.int64) * 4,
                   partial_send + ((source_node * cap + lo) * row_width).to(tl.int64) * 4, (hi - lo) * row_width * 4,
                   TAIL + (my_node * CHANNELS + chunk) * 8, epoch.to(tl.int64) << 32, source, TRANSPORT, 1024, GPU)
    if last_program_done((heap_base + DONE).to(tl.pointer_type(tl.int64))):
        # Done reading every node peer's staging: each may overwrite it in its next combine.
        for peer in range(0, RANKS_PER_NODE):
            peer_base = tl.load(node_peer_ptrs + my_node * RANKS_PER_NODE + peer)
            add_release((peer_base + STAGING_FREE + my_local * 8).to(tl.pointer_type(tl.int64)), 1)


@kernel_names.jit("tritonep::internode::final_reduce",
                  do_not_specialize=["rank", "epoch", "num_tokens", "cap"])
def final_reduce_kernel(
    transport_table, heap_base, rank, node_pos_ptr, num_tokens, hidden, partial_landing, cap,
    bias0_ptr, bias1_ptr, out_ptr, out_weights_ptr, epoch, status_ptr, timeout_ns,
    TAIL: tl.constexpr, FREE: tl.constexpr, DONE: tl.constexpr, RANKS_PER_NODE: tl.constexpr,
    NUM_NODES: tl.constexpr, CHANNELS: tl.constexpr, NUM_TOPK: tl.constexpr, WEIGHTS_PAD: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr, HAS_BIAS0: tl.constexpr, HAS_BIAS1: tl.constexpr, NODES_PAD: tl.constexpr,
    TOKENS: tl.constexpr, BLOCK: tl.constexpr, GPU: tl.constexpr, TRANSPORT: tl.constexpr,
):
    my_node = rank // RANKS_PER_NODE
    my_local = rank % RANKS_PER_NODE
    stamp = epoch.to(tl.int64) << 32
    for chunk in range(0, NUM_NODES * CHANNELS):
        wait_signal(heap_base, TAIL + chunk * 8, stamp, status_ptr, timeout_ns, PHASE_NET_COMBINE_DATA,
                    (chunk // CHANNELS) * RANKS_PER_NODE + my_local, GPU)
    row_width = hidden + WEIGHTS_PAD
    sums = (heap_base + partial_landing).to(tl.pointer_type(tl.float32))
    # Nodes are the lanes of [TOKENS, NODES_PAD] tiles, as in node_reduce_kernel: each token's
    # row in each node's sums is read once per tile of tokens.
    lanes = tl.arange(0, NODES_PAD)
    lane_mask = lanes < NUM_NODES
    for t0 in range(tl.program_id(0) * TOKENS, num_tokens, tl.num_programs(0) * TOKENS):
        tokens = (t0 + tl.arange(0, TOKENS)).to(tl.int64)
        token_mask = tokens < num_tokens
        pair_mask = token_mask[:, None] & lane_mask[None, :]
        i = tl.load(node_pos_ptr + tokens[:, None] * NUM_NODES + lanes[None, :], mask=pair_mask, other=-1)
        present = pair_mask & (i >= 0)
        sum_rows = (lanes[None, :] * cap + i).to(tl.int64) * row_width      # [TOKENS, NODES_PAD] offsets
        for c0 in range(0, hidden, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            mask = token_mask[:, None] & (cols < hidden)[None, :]
            offsets = tokens[:, None] * hidden + cols[None, :]
            acc = tl.zeros([TOKENS, BLOCK], dtype=tl.float32)
            if HAS_BIAS0:
                acc += tl.load(bias0_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            if HAS_BIAS1:
                acc += tl.load(bias1_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            for node in tl.static_range(NUM_NODES):
                row, here = lane_column(sum_rows, present, lanes, node)
                acc += tl.load(sums + row[:, None] + cols[None, :], mask=here[:, None] & mask, other=0.0,
                               cache_modifier=".cg")
            tl.store(out_ptr + offsets, acc.to(tl.bfloat16), mask=mask)
        if HAS_WEIGHTS:
            slots = tl.arange(0, WEIGHTS_PAD)
            mask = token_mask[:, None] & (slots < NUM_TOPK)[None, :]
            acc_w = tl.zeros([TOKENS, WEIGHTS_PAD], dtype=tl.float32)
            for node in tl.static_range(NUM_NODES):
                row, here = lane_column(sum_rows, present, lanes, node)
                acc_w += tl.load(sums + row[:, None] + hidden + slots[None, :], mask=here[:, None] & mask,
                                 other=0.0, cache_modifier=".cg")
            tl.store(out_weights_ptr + tokens[:, None] * NUM_TOPK + slots[None, :], acc_w, mask=mask)
    if last_program_done((heap_base + DONE).to(tl.pointer_type(tl.int64))):
        for node in range(0, NUM_NODES):
            signal_add(transport_table, heap_base, FREE + my_node * 8, 1, node * RANKS_PER_NODE + my_local, TRANSPORT)
