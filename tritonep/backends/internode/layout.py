"""Where everything lives in the internode backend's heap, and how rows are packed.

The heap (``memory.TransportHeap``, ``num_rdma_bytes`` on every rank) starts with int64 signal
words, then the count exchange's payload slots, then the data area, split in two halves:

* dispatch: ``send`` [nodes][cap][row] (this rank's rows for each node, packed) and
  ``landing`` [nodes][cap][row] (rows the rank of the same local index in each node put here);
* combine: ``staging`` [R * cap][hidden] bf16 and its top-k weights (this rank's combine input,
  which the ranks of its node read), ``partial_send`` [nodes][cap][hidden + K] float32 (this
  rank's sums over its node, per source node) and ``partial_landing`` [nodes][cap][...] (the
  sums each node sent back for this rank's tokens).

``cap`` (rows one rank sends to one node at most) follows from each half's size and the call's
row sizes. A dispatch row is int32 words: x, scales, the global top-k ids (int64), weights, the
source token index, and the token's position in the receive block of each rank of the
destination node (-1 where that rank does not take it).
"""

from __future__ import annotations

from dataclasses import dataclass

from tritonep.backends.nvlink.memory import MAX_LOCAL_EXPERTS
from tritonep.core.routing import round_up

# Chunks (each with its own signal) of the rows one rank sends one node. Each is one program's
# block-wide put: over NVLink (NVSHMEM's P2P path) the program's threads copy the bytes
# themselves, so the chunks, and the threads per program (``PUT_WARPS``), set the bandwidth.
CHANNELS = 16
PUT_WARPS = 16
# The programs that read the node's peers (the node receive, the node reduce) take this many
# columns per step: a remote load's latency is paid per step, so wide steps keep more bytes in
# flight. The node receive runs with RECEIVE_WARPS.
NODE_BLOCK = 512
RECEIVE_WARPS = 8
SIGNATURE_WORDS = 8     # (hidden words, scale words, top-k, experts, num_worst_tokens, T, 0, 0)


@dataclass(frozen=True)
class HeapLayout:
    num_ranks: int
    ranks_per_node: int
    nbytes: int

    @property
    def num_nodes(self) -> int:
        return self.num_ranks // self.ranks_per_node

    # ---- int64 signal words (byte offsets) ----------------------------------------------
    @property
    def notify_flag(self) -> int:          # [R]: the last count exchange each source finished
        return 0

    @property
    def landing_tail(self) -> int:         # [nodes, CHANNELS]: (epoch << 32) once a chunk landed
        return self.notify_flag + 8 * self.num_ranks

    @property
    def landing_free(self) -> int:         # [nodes]: receivers of each node done with my rows, ever
        return self.landing_tail + 8 * self.num_nodes * CHANNELS

    @property
    def partial_tail(self) -> int:         # [nodes, CHANNELS]: a node's partial sums landed
        return self.landing_free + 8 * self.num_nodes

    @property
    def partial_free(self) -> int:         # [nodes]: sources done with the sums I sent, ever
        return self.partial_tail + 8 * self.num_nodes * CHANNELS

    @property
    def staged(self) -> int:               # [ranks per node]: combine epoch each node peer staged
        return self.partial_free + 8 * self.num_nodes

    @property
    def staging_free(self) -> int:         # [ranks per node]: node peers done reading my staging, ever
        return self.staged + 8 * self.ranks_per_node

    @property
    def done_counters(self) -> int:        # [4]: programs of a launch that finished (local)
        return self.staging_free + 8 * self.ranks_per_node

    # ---- the count exchange -------------------------------------------------------------
    @property
    def payload_words(self) -> int:        # int32: rows per rank, rows per node, expert counts, signature
        return round_up(self.num_ranks + self.num_nodes + MAX_LOCAL_EXPERTS + SIGNATURE_WORDS, 4)

    @property
    def payload_send(self) -> int:         # int32 [R destinations, payload_words]
        return round_up(self.done_counters + 8 * 4, 64)

    @property
    def payload_landing(self) -> int:      # int32 [2 parities, R sources, payload_words]
        return self.payload_send + 4 * self.num_ranks * self.payload_words

    @property
    def data_start(self) -> int:
        return round_up(self.payload_landing + 8 * self.num_ranks * self.payload_words, 4096)

    @property
    def half_bytes(self) -> int:
        return max(self.nbytes - self.data_start, 0) // 2 // 4096 * 4096

    # ---- dispatch half ----------------------------------------------------------------
    def dispatch(self, row_words: int) -> tuple[int, int, int]:
        """(cap, send offset, landing offset) for dispatch rows of ``row_words`` int32 words."""
        region = self.num_nodes * 4 * row_words
        cap = self.half_bytes // (2 * region)
        return cap, self.data_start, self.data_start + cap * region

    # ---- combine half -----------------------------------------------------------------
    def combine(self, hidden: int, num_topk: int) -> tuple[int, int, int, int, int]:
        """(cap, staging x, staging weights, partial send, partial landing) byte offsets."""
        pad = weights_pad(num_topk)
        staging_row = 2 * hidden + 4 * pad
        partial_row = 4 * (hidden + pad)
        per_cap = self.num_ranks * staging_row + 2 * self.num_nodes * partial_row
        cap = self.half_bytes // per_cap
        start = self.data_start + self.half_bytes
        staging_x = start
        staging_weights = staging_x + self.num_ranks * cap * 2 * hidden
        partial_send = round_up(staging_weights + self.num_ranks * cap * 4 * pad, 16)
        partial_landing = partial_send + self.num_nodes * cap * partial_row
        return cap, staging_x, staging_weights, partial_send, partial_landing


def weights_pad(num_topk: int) -> int:
    """Top-k weights per combine row as staged and summed: a power of two, at least 4 (16 bytes)."""
    return max(4, 1 << max(num_topk - 1, 0).bit_length())


@dataclass(frozen=True)
class RowPacking:
    """Where each field sits in a dispatch row (int32 words)."""

    x_words: int
    scale_words: int
    num_topk: int
    ranks_per_node: int

    @property
    def idx_word(self) -> int:             # global top-k ids, int64 (8-byte aligned)
        return round_up(self.x_words + self.scale_words, 2)

    @property
    def weights_word(self) -> int:
        return self.idx_word + 2 * self.num_topk

    @property
    def src_word(self) -> int:
        return self.weights_word + self.num_topk

    @property
    def pos_word(self) -> int:             # [ranks per node]: row in each node rank's block, or -1
        return self.src_word + 1

    @property
    def row_words(self) -> int:            # 16-byte rows
        return round_up(self.pos_word + self.ranks_per_node, 4)


def heap_bytes_for(tokens: int, hidden: int, num_topk: int, num_ranks: int, ranks_per_node: int) -> int:
    """The smallest heap (bytes, 4 KiB steps from 1 MiB, growing by a quarter) that takes a bf16
    dispatch (the largest rows; fp8 rows are smaller) and a combine of ``tokens`` tokens per rank
    under any routing: every token to one node."""
    packing = RowPacking(hidden // 2, 0, num_topk, ranks_per_node)
    size = 1 << 20
    while True:
        layout = HeapLayout(num_ranks, ranks_per_node, size)
        if min(layout.dispatch(packing.row_words)[0], layout.combine(hidden, num_topk)[0]) >= tokens:
            return size
        size = size * 5 // 4 // 4096 * 4096 + 4096
