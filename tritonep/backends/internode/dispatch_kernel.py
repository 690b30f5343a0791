"""The internode dispatch's kernels: the count exchange, the network stage, the node stage.

1. ``notify_kernel`` (one program): every rank puts its payload for each rank (rows per rank,
   rows per node, that rank's expert counts, the call's signature) into that rank's slot, with
   a signal, over the transport; then it waits for every source's signal. The host reads the
   slots back: the one host synchronisation of a fresh dispatch.
2. ``network_send_kernel``: the rows this rank sends each node were packed into its ``send``
   area, once per node whatever the number of the node's ranks that take them. Program (node
   m, chunk c) waits until the ranks of node m finished reading the previous call's rows, then
   puts its chunk, with a signal, to the rank of node m with this rank's local index (so each
   NIC talks to one NIC per node).
3. ``node_receive_kernel``: a rank reads the rows that landed at every rank of its own node
   (itself included) over the node's pointers, and keeps those whose position for it is not
   -1, at that position in its block for the source: the receive order is global source rank,
   then token, as in one node. The last program tells every source, over the transport, that
   its rows in this node may be overwritten.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tritonep.backends.internode.transport import put_signal, signal_add, wait_signal
from tritonep.device.rows import block_start, channel_range, copy_rows
from tritonep.device.signals import last_program_done, wait_at_least
from tritonep.device.status_codes import PHASE_NET_DISPATCH_DATA, PHASE_NET_DISPATCH_SLOT, PHASE_NET_NOTIFY
from tritonep.runtime import kernel_names


@kernel_names.jit("tritonep::internode::notify_dispatch",
                  do_not_specialize=["rank", "epoch"])
def notify_kernel(transport_table, heap_base, rank, epoch, status_ptr, timeout_ns,
                  PAYLOAD_SEND: tl.constexpr, PAYLOAD_LANDING: tl.constexpr, PAYLOAD_BYTES: tl.constexpr,
                  FLAG: tl.constexpr, NUM_RANKS: tl.constexpr, GPU: tl.constexpr, TRANSPORT: tl.constexpr):
    slot = ((epoch % 2) * NUM_RANKS + rank) * PAYLOAD_BYTES
    for step in range(0, NUM_RANKS):
        destination = (rank + step) % NUM_RANKS
        put_signal(transport_table, heap_base, PAYLOAD_LANDING + slot, PAYLOAD_SEND + destination * PAYLOAD_BYTES,
                   PAYLOAD_BYTES, FLAG + rank * 8, epoch, destination, TRANSPORT, 256, GPU)
    for source in range(0, NUM_RANKS):
        wait_signal(heap_base, FLAG + source * 8, epoch, status_ptr, timeout_ns, PHASE_NET_NOTIFY, source, GPU)


@kernel_names.jit("tritonep::internode::dispatch",
                  do_not_specialize=["rank", "epoch", "released_target", "cap"])
def network_send_kernel(transport_table, heap_base, rank, node_rows_ptr, cap, row_bytes, send, landing, epoch,
                        released_target, status_ptr, timeout_ns,
                        TAIL: tl.constexpr, FREE: tl.constexpr, RANKS_PER_NODE: tl.constexpr,
                        NUM_NODES: tl.constexpr, CHANNELS: tl.constexpr, GPU: tl.constexpr,
                        TRANSPORT: tl.constexpr):
    pid = tl.program_id(0)
    # Rotated, so that the nodes' first chunks do not all go to one node.
    my_node = rank // RANKS_PER_NODE
    node = (my_node + pid // CHANNELS) % NUM_NODES
    chunk = pid % CHANNELS
    destination = node * RANKS_PER_NODE + rank % RANKS_PER_NODE
    lo, hi = channel_range(tl.load(node_rows_ptr + node), chunk, CHANNELS)
    wait_signal(heap_base, FREE + node * 8, released_target, status_ptr, timeout_ns, PHASE_NET_DISPATCH_SLOT,
                destination, GPU)
    # An empty chunk still signals: receivers wait for every chunk of the call.
    put_signal(transport_table, heap_base, landing + (my_node * cap + lo).to(tl.int64) * row_bytes,
               send + (node * cap + lo).to(tl.int64) * row_bytes, (hi - lo) * row_bytes,
               TAIL + (my_node * CHANNELS + chunk) * 8, epoch.to(tl.int64) << 32, destination, TRANSPORT, 1024, GPU)


@triton.jit
def _take_topk(landed, rows, take, out_rows, out_idx_ptr, out_weights_ptr, idx_word, weights_word, row_words, rank,
               experts_per_rank, NUM_TOPK: tl.constexpr, TOPK_PAD: tl.constexpr):
    """The global top-k ids of landed rows as this rank's local ids (-1, weight 0, elsewhere)."""
    slots = tl.arange(0, TOPK_PAD)
    mask = take[:, None] & (slots < NUM_TOPK)[None, :]
    row_start = rows.to(tl.int64)[:, None] * row_words
    low = tl.load(landed + row_start + idx_word + 2 * slots[None, :], mask=mask, other=0, cache_modifier=".cg")
    high = tl.load(landed + row_start + idx_word + 2 * slots[None, :] + 1, mask=mask, other=0, cache_modifier=".cg")
    experts = (high.to(tl.int64) << 32) | (low.to(tl.int64) & 0xFFFFFFFF)
    weights = tl.load(landed + row_start + weights_word + slots[None, :], mask=mask, other=0,
                      cache_modifier=".cg").to(tl.float32, bitcast=True)
    local = experts - rank * experts_per_rank
    here = (experts >= 0) & (local >= 0) & (local < experts_per_rank)
    out = out_rows.to(tl.int64)[:, None] * NUM_TOPK + slots[None, :]
    tl.store(out_idx_ptr + out, tl.where(here, local, -1), mask=mask)
    tl.store(out_weights_ptr + out, tl.where(here, weights, 0.0), mask=mask)


@kernel_names.jit("tritonep::internode::node_receive",
                  do_not_specialize=["rank", "epoch", "cap", "num_out_rows", "experts_per_rank"])
def node_receive_kernel(
    # The node's heaps (this rank's node only), the transport, this rank.
    node_peer_ptrs, transport_table, heap_base, rank,
    # Where the rows landed, how many in each (rank of the node, source node), rank_prefix_matrix.
    landing, cap, row_words, landing_rows_ptr, prefix_ptr,
    # The row's fields (RowPacking).
    x_words, scale_words, idx_word, weights_word, src_word, pos_word,
    # Outputs; and, for the combine, the positions of the rows that landed at this rank.
    out_x_ptr, out_scales_ptr, out_idx_ptr, out_weights_ptr, out_src_ptr, num_out_rows, kept_pos_ptr, kept_rows,
    experts_per_rank, epoch, status_ptr, timeout_ns,
    TAIL: tl.constexpr, FREE: tl.constexpr, DONE: tl.constexpr, RANKS_PER_NODE: tl.constexpr,
    NUM_NODES: tl.constexpr, NUM_RANKS: tl.constexpr, CHANNELS: tl.constexpr, HAS_SCALES: tl.constexpr,
    HAS_TOPK: tl.constexpr, NUM_TOPK: tl.constexpr, TOPK_PAD: tl.constexpr, NODE_PAD: tl.constexpr,
    ROWS: tl.constexpr, BLOCK: tl.constexpr, GPU: tl.constexpr, TRANSPORT: tl.constexpr,
):
    pid = tl.program_id(0)
    my_node = rank // RANKS_PER_NODE
    my_local = rank % RANKS_PER_NODE
    stamp = epoch.to(tl.int64) << 32
    for item in range(pid, RANKS_PER_NODE * NUM_NODES * CHANNELS, tl.num_programs(0)):
        holder = item // (NUM_NODES * CHANNELS)            # the rank of this node the rows landed at
        source_node = (item // CHANNELS) % NUM_NODES
        chunk = item % CHANNELS
        source = source_node * RANKS_PER_NODE + holder
        holder_base = tl.load(node_peer_ptrs + my_node * RANKS_PER_NODE + holder)
        tail = (holder_base + TAIL + (source_node * CHANNELS + chunk) * 8).to(tl.pointer_type(tl.int64))
        seen = wait_at_least(tail, stamp, status_ptr, timeout_ns, PHASE_NET_DISPATCH_DATA, source, GPU)
        arrived = seen < stamp + (1 << 55)
        lo, hi = channel_range(tl.load(landing_rows_ptr + holder * NUM_NODES + source_node), chunk, CHANNELS)
        start = block_start(prefix_ptr, source, rank, NUM_RANKS)
        landed = (holder_base + landing + source_node.to(tl.int64) * cap * row_words * 4).to(tl.pointer_type(tl.int32))
        for row0 in range(lo, hi, ROWS):
            rows = row0 + tl.arange(0, ROWS)
            mask = (rows < hi) & arrived
            pos = tl.load(landed + rows.to(tl.int64) * row_words + pos_word + my_local, mask=mask, other=-1,
                          cache_modifier=".cg")
            out_rows = start + pos
            take = mask & (pos >= 0) & (out_rows < num_out_rows)
            copy_rows(landed, rows, row_words, 1, out_x_ptr, out_rows, take, x_words, BLOCK, True)
            if HAS_SCALES:
                copy_rows(landed + x_words, rows, row_words, 1, out_scales_ptr, out_rows, take, scale_words, 64, True)
            if HAS_TOPK:
                _take_topk(landed, rows, take, out_rows, out_idx_ptr, out_weights_ptr, idx_word, weights_word,
                           row_words, rank, experts_per_rank, NUM_TOPK, TOPK_PAD)
            src = tl.load(landed + rows.to(tl.int64) * row_words + src_word, mask=take, cache_modifier=".cg")
            tl.store(out_src_ptr + out_rows, src, mask=take)
            if holder == my_local:
                # The rows that landed here: which ranks of the node took each, for the combine.
                node_ranks = tl.arange(0, NODE_PAD)
                keep = mask[:, None] & (node_ranks < RANKS_PER_NODE)[None, :]
                positions = tl.load(landed + rows.to(tl.int64)[:, None] * row_words + pos_word + node_ranks[None, :],
                                    mask=keep, other=-1, cache_modifier=".cg")
                kept = (source_node * kept_rows + rows).to(tl.int64)[:, None] * RANKS_PER_NODE + node_ranks[None, :]
                tl.store(kept_pos_ptr + kept, positions, mask=keep & (rows < kept_rows)[:, None])
    if last_program_done((heap_base + DONE).to(tl.pointer_type(tl.int64))):
        # Every rank of this node read every chunk: each source may overwrite its rows here.
        for source in range(0, NUM_RANKS):
            signal_add(transport_table, heap_base, FREE + my_node * 8, 1, source, TRANSPORT)
