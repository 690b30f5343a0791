"""Normal-mode combine with the copy engines: rows cross NVLink without any SM, SMs only reduce.

In combine, the rows an expert rank returns to source s are one contiguous block of its ``x``
(dispatch laid them out by source, token order inside), and they land in one contiguous range
of s's combine staging (grouped by expert rank, in s's send-list order). When the host knows
the counts (every dispatch that read them back) the block needs no gather, so each block
crosses NVLink as ``cudaMemcpyAsync`` calls into the peer's symmetric memory: the copy engines
carry the bulk bytes at link speed and the SMs are left to reduce.

The block to each peer goes in ``pieces`` pieces, in token order, each a little smaller than
the one before (``piece_ends``). All pieces go on one side stream (``side_streams.PeerStreams``),
round by round: the first piece of every peer, then the second of every peer, and so on. The
copy engines run one peer copy at a time anyway, and in this order each rank receives the
first rows of every peer early, so its reducers start while the rest is on the wire; the last
round is the smallest, so the reduction that trails the last copy is short. After each piece
the stream publishes the rows so far in the peer's copy tail word for this rank
(``SignalLayout.combine_copy_tail``, which the peer sets back to 0 after each call), so the
reduction is ``combine_kernel`` itself with no sender programs and one channel per peer. Its reducers wait
per stage of tokens for the rows the stage needs, and take the stages interleaved (stage i on
program i % P), so that every program follows the front of arriving rows. The top-k weights (a
few bytes per row) go to all peers in one small kernel on the caller's stream
(``push_combine_weights``) while the first copy runs; the side stream waits for that kernel
before its first tail word, so every tail word is written after the weights it publishes.

Host cost: each operation on a side stream costs the host microseconds, and an EP8 combine has
7 peers. A copy costs about what a small kernel launch costs (through cuda-bindings, ctypes or
``cuMemcpyBatchAsync`` alike), a stream memory write a fraction of that, and a side stream's
fork and join about a copy. With cuda-bindings installed (and the GPU supporting stream memory
operations) a piece is a copy and a ``cuStreamWriteValue64``: the tail word is written by the
stream itself, which the driver orders after the copy with a memory barrier. Otherwise it is
torch's ``copy_`` and a one-program signal kernel, same semantics (``Tuning.copy_driver=
False`` chooses it). By default ``pieces_per_peer`` picks fewer pieces per peer as the peers
grow in number, so that the host's issue stays well under the copies' own time.

``CombineCopier`` is that side work for one engine: the general path and the combine's replay
(``replay.py``) both call it.

Graphs: a combine repeated with one handle and the same ``x`` (and top-k weights) issues the
same side work every call, down to the addresses and tail values, so the replay captures it
once as a CUDA graph (``CombineCopier.capture``: the weights kernel on a branch, the pieces and
tail writes on the side stream) and forks that graph instead: four driver calls in place of the
weights kernel, two per piece and the fork's own. Tail values without the epoch are what make
the work repeat exactly.

Staging reuse: the reduction's last program waits until every peer's reducers finished the
call (``combine_kernel.release_staging``), and the next combine's weights kernel and copies
start only after that kernel on the caller's stream, so neither overwrites rows or weights a
peer has not reduced yet.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton.language as tl

from tritonep.backends.nvlink.memory import SymmetricBuffer
from tritonep.device.rows import block_count, block_start
from tritonep.device.signals import fence_system, publish
from tritonep.runtime import kernel_names
from tritonep.runtime.launcher import FastLauncher, current_stream
from tritonep.runtime.platform import GPU_KERNELS
from tritonep.runtime.side_streams import PeerStreams, driver_result
from tritonep.runtime.streams import set_stream


@kernel_names.jit("tritonep::intranode::piece_signal",
                  do_not_specialize=["peer", "tail_index", "value"])
def combine_piece_signal_kernel(peer_base_ptrs, peer, tail_index, value):
    """After a piece's rows were copied (stream order): publish it in the peer's tail word."""
    peer_base = tl.load(peer_base_ptrs + peer)
    publish(peer_base.to(tl.pointer_type(tl.int64)) + tail_index, value)


# Per launch only these change; ``peer_base_ptrs`` is fixed per engine (the caller's ``owner``).
_SIGNAL = FastLauncher(combine_piece_signal_kernel, changing=("peer", "tail_index", "value"))


@kernel_names.jit("tritonep::intranode::send_weights",
                  do_not_specialize=["rank"])
def combine_weights_kernel(weights_ptr, prefix_ptr, peer_base_ptrs, staging_weights, rank,
                           NUM_RANKS: tl.constexpr, NUM_TOPK: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                           GPU: tl.constexpr):
    """``SPLIT`` programs per peer push the top-k weights of the rows this rank returns to peer
    (rank + 1 + p) % R into that peer's combine staging, at the rows' staging positions.

    In our ``x`` (dispatch's output) the peer's rows are its block of ``rank_prefix_matrix``;
    in the peer's staging they follow the rows it got back from lower expert ranks, the sum
    over e < rank of what it sent to e. The same arithmetic as ``combine_copies`` on the host.
    """
    peer = (rank + 1 + tl.program_id(0) // SPLIT) % NUM_RANKS
    part = tl.program_id(0) % SPLIT
    start = block_start(prefix_ptr, peer, rank, NUM_RANKS)
    total = block_count(prefix_ptr, peer, rank, NUM_RANKS) * NUM_TOPK
    offset = start * 0
    for e in range(0, rank):
        offset += block_count(prefix_ptr, peer, e, NUM_RANKS)
    peer_base = tl.load(peer_base_ptrs + peer)
    src = weights_ptr + start.to(tl.int64) * NUM_TOPK
    dst = (peer_base + staging_weights).to(tl.pointer_type(tl.float32)) + offset.to(tl.int64) * NUM_TOPK
    for e0 in range(part * BLOCK, total, SPLIT * BLOCK):
        elements = e0 + tl.arange(0, BLOCK)
        mask = elements < total
        tl.store(dst + elements, tl.load(src + elements, mask=mask), mask=mask)
    fence_system(GPU)   # the weights reach the peer before anything the streams do after this kernel


_WEIGHTS = FastLauncher(combine_weights_kernel, changing=("weights_ptr", "prefix_ptr"))

# Programs per peer of the weights kernel: one program alone is latency-bound (a few hundred KB
# per peer), and the kernel runs beside the first copy, which it must not outlast.
WEIGHTS_SPLIT = 8

# Pieces in all (over the peers) that a combine's host issue may cost by default: each piece
# costs the host about a kernel launch (module docstring), and more than 8 of them would be a
# large part of an EP8 combine's time on slow hosts.
MAX_PIECES = 8


def pieces_per_peer(num_ranks: int, requested: int) -> int:
    """Pieces per peer: ``requested`` if set (> 0), else 3 at EP2, 2 up to EP5 and 1 from EP6
    on (EP8: 7 pieces). A piece lets the reduction start earlier, but costs the host a copy
    and a stream write."""
    if requested > 0:
        return requested
    return max(1, min(3, MAX_PIECES // max(num_ranks - 1, 1)))


def piece_ratio(pieces: int, requested: float) -> float:
    """The ``piece_ends`` ratio: ``requested`` if set (> 0), else 0.4 for two pieces per peer and
    0.6 for three or more (the last piece then holds about 30% and 18% of the rows): the best of
    0.2 to 1.0 at EP4 (two pieces) and EP2 (three) respectively (docs/findings.md)."""
    if requested > 0:
        return requested
    return 0.4 if pieces == 2 else 0.6


def piece_ends(count: int, pieces: int, ratio: float) -> list[int]:
    """Row ends of a ``count``-row block cut into ``pieces`` pieces in token order, each piece
    ``ratio`` times the one before: the rows of the last round are all the reducers have left
    to do once the last copy lands, so it pays to make that round small."""
    weights = [ratio ** k for k in range(pieces)]
    total, ends, acc = sum(weights), [], 0.0
    for w in weights[:-1]:
        acc += w
        ends.append(min(count, round(count * acc / total)))
    return ends + [count]


def push_combine_weights(topk_weights: torch.Tensor, rank_prefix_matrix: torch.Tensor, peer_base_ptrs: torch.Tensor,
                         staging_weights: int, rank: int, num_ranks: int, owner: object) -> None:
    """Launch ``combine_weights_kernel`` on the current stream: every peer's top-k weights.
    ``owner``: a key that stands for ``peer_base_ptrs``, ``rank`` and ``num_ranks`` (equal
    keys, equal values; the engine's launch generation)."""
    num_topk = topk_weights.shape[1]
    _WEIGHTS((num_ranks - 1) * WEIGHTS_SPLIT, (owner, staging_weights, num_topk),
             (topk_weights, rank_prefix_matrix, peer_base_ptrs, staging_weights, rank),
             lambda: dict(NUM_RANKS=num_ranks, NUM_TOPK=num_topk, SPLIT=WEIGHTS_SPLIT, BLOCK=512, GPU=GPU_KERNELS), 4)


class CombineCopier:
    """The copy-engine combine's side work for one engine and tuning: the top-k weights to every
    peer (on the current stream), then every peer's rows in pieces, round by round, on one side
    stream of ``streams``, which the caller joins after the reduction's launch.

    ``driver``: from ``driver_memory_operations``, or None for torch's copies and the signal
    kernel. ``owner``: a key that stands for ``memory``, ``rank`` and ``num_ranks`` in the
    launches' setup keys (the engine's launch generation). ``piece_ratio``: see ``piece_ends``.
    ``copy_streams``: side streams the peers are spread over (``Tuning.combine_copy_streams``)."""

    __slots__ = ("memory", "rank", "num_ranks", "streams", "driver", "owner", "piece_ratio", "copy_streams",
                 "weights_done")

    def __init__(self, memory: SymmetricBuffer, streams: PeerStreams, driver: Any, owner: object,
                 piece_ratio: float = 1.0, copy_streams: int = 1) -> None:
        self.memory, self.rank, self.num_ranks = memory, memory.rank, memory.num_ranks
        self.streams, self.driver, self.owner, self.piece_ratio = streams, driver, owner, piece_ratio
        self.copy_streams = max(1, copy_streams)
        self.weights_done = torch.cuda.Event() if memory.local.device.type == "cuda" else None

    def fork(self, x: torch.Tensor, topk_weights: torch.Tensor | None, copies: list[tuple[int, int, int, int]],
             rank_prefix_matrix: torch.Tensor, regions: list[int], pieces: int) -> None:
        """Start a combine's side work: ``copies`` from ``combine_copies``, ``regions`` the
        combine's staging regions (x, weights), ``pieces`` per peer."""
        if not copies:   # no rows go to a peer (one rank, or all stay here): nothing to send
            return
        memory = self.memory
        start = self.streams.mark()   # the copies need not wait for the weights kernel
        weights_done = None
        if topk_weights is not None:
            push_combine_weights(topk_weights, rank_prefix_matrix, memory.peer_base_ptrs, regions[1], self.rank,
                                 self.num_ranks, self.owner)
            if self.weights_done is not None:
                weights_done = self.weights_done
                weights_done.record()   # on the current stream
        # Peer i of the list on stream i % N, each stream's peers round by round.
        spread = min(self.copy_streams, len(copies))
        self.streams.fork([self._job(x, copies[first::spread], regions, pieces, weights_done)
                           for first in range(spread)], after=start)

    def _job(self, x: torch.Tensor, copies: list[tuple[int, int, int, int]], regions: list[int], pieces: int,
             weights_done: torch.cuda.Event | None) -> Callable[[], None]:
        memory = self.memory
        return combine_copy_job(x, copies, memory.peers, memory.peer_base_ptrs, regions[0],
                                memory.signals.combine_copy_tail + self.rank, pieces, self.piece_ratio, weights_done,
                                self.owner, self.driver)

    @property
    def captures(self) -> bool:
        """Whether ``capture`` can make graphs here: the driver's copies on one side stream, on
        streams that capture."""
        return self.driver is not None and self.copy_streams == 1 and self.streams.captures

    def capture(self, x: torch.Tensor, topk_weights: torch.Tensor | None, copies: list[tuple[int, int, int, int]],
                rank_prefix_matrix: torch.Tensor, regions: list[int], pieces: int) -> Any:
        """``fork``'s side work with these tensors, captured as a graph for
        ``streams.fork_graph`` (nothing runs): the weights kernel on a branch of the side
        stream, beside the first copy; the first tail write waits for it. None if the driver
        refused the capture (``PeerStreams.capture``)."""
        return self.streams.capture(self._capture_body(x, topk_weights, copies, rank_prefix_matrix, regions, pieces),
                                    "the combine's copy-engine work")

    def _capture_body(self, x: torch.Tensor, topk_weights: torch.Tensor | None,
                      copies: list[tuple[int, int, int, int]], rank_prefix_matrix: torch.Tensor, regions: list[int],
                      pieces: int) -> Callable[[torch.cuda.Stream], None]:
        memory = self.memory

        def body(branch: torch.cuda.Stream) -> None:
            weights_done = None
            if topk_weights is not None:
                side = torch.cuda.current_stream()
                start = torch.cuda.Event()
                start.record(side)
                branch.wait_event(start)
                set_stream(branch)
                try:
                    push_combine_weights(topk_weights, rank_prefix_matrix, memory.peer_base_ptrs, regions[1],
                                         self.rank, self.num_ranks, self.owner)
                finally:
                    set_stream(side)
                weights_done = torch.cuda.Event()
                weights_done.record(branch)
            self._job(x, copies, regions, pieces, weights_done)()
        return body


def driver_memory_operations(device: torch.device) -> Any:
    """cuda-bindings' ``driver`` module when it imports and ``device`` supports 64-bit stream
    memory operations (``cuStreamWriteValue64``), else None (the torch path is used)."""
    if device.type != "cuda":
        return None
    try:
        from cuda.bindings import driver
    except ImportError:
        return None
    attribute = getattr(driver.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS", None)
    if attribute is not None:
        error, supported = driver.cuDeviceGetAttribute(attribute, device.index or 0)
        if error != driver.CUresult.CUDA_SUCCESS or not supported:
            return None
    return driver


def combine_copy_job(x: torch.Tensor, copies: list[tuple[int, int, int, int]], peers: list[torch.Tensor],
                     peer_base_ptrs: torch.Tensor, staging_x: int, tail_index: int, pieces: int, piece_ratio: float,
                     weights_done: torch.cuda.Event | None, owner: object, driver: Any = None) -> Callable[[], None]:
    """A side stream's job: each peer's block of ``x`` in ``pieces`` copies (``piece_ends``),
    round by round over the peers, each copy followed by its tail word; the first tail word
    waits for ``weights_done`` (the weights kernel, when there is one).

    ``copies`` lists ``(peer, first row in x, rows, first row in the peer's staging)``;
    ``tail_index``: this rank's copy tail word in every peer's signal area.
    ``owner``: a key that stands for ``peer_base_ptrs`` (equal keys, equal tensors).
    ``driver``: from ``driver_memory_operations``, or None for torch's copies and the kernel.
    """
    make = _driver_piece if driver is not None else _torch_piece
    move_piece = make(driver, x, peers, peer_base_ptrs, staging_x, tail_index, owner)
    ends = [piece_ends(count, pieces, piece_ratio) for _, _, count, _ in copies]

    def run() -> None:
        stream = current_stream() if driver is not None else 0   # (the kernel finds its own)
        waiting = weights_done
        for piece in range(pieces):
            for (peer, start, _, offset), peer_ends in zip(copies, ends):
                lo, hi = peer_ends[piece - 1] if piece else 0, peer_ends[piece]
                if hi > lo:
                    if waiting is not None:
                        torch.cuda.current_stream().wait_event(waiting)
                        waiting = None
                    move_piece(stream, peer, start + lo, offset + lo, hi - lo, hi)
    return run


# A piece mover: ``(stream, peer, first row in x, first row in the peer's staging, rows, rows so
# far)`` copies the piece's rows into the peer's staging, then publishes the rows so far in the
# peer's tail word ``tail_index``.
PieceMover = Callable[[int, int, int, int, int, int], None]


def _torch_piece(driver: Any, x: torch.Tensor, peers: list[torch.Tensor], peer_base_ptrs: torch.Tensor,
                 staging_x: int, tail_index: int, owner: object) -> PieceMover:
    """torch's copy of the rows, then the one-program signal kernel."""
    row_bytes = x.shape[1] * x.element_size()
    x_bytes = x.view(torch.uint8).view(-1)

    def move(stream: int, peer: int, src_row: int, dst_row: int, rows: int, so_far: int) -> None:
        peers[peer].narrow(0, staging_x + dst_row * row_bytes, rows * row_bytes).copy_(
            x_bytes.narrow(0, src_row * row_bytes, rows * row_bytes), non_blocking=True)
        _SIGNAL(1, owner, (peer_base_ptrs, peer, tail_index, so_far), {}, 1)
    return move


def _driver_piece(driver: Any, x: torch.Tensor, peers: list[torch.Tensor], peer_base_ptrs: torch.Tensor,
                  staging_x: int, tail_index: int, owner: object) -> PieceMover:
    """Through the driver: the rows' copy, then the tail word written by the stream itself (it
    fences the copy before the write)."""
    row_bytes = x.shape[1] * x.element_size()
    x_address = x.data_ptr()
    bases = [peer.data_ptr() for peer in peers]

    def move(stream: int, peer: int, src_row: int, dst_row: int, rows: int, so_far: int) -> None:
        base = bases[peer]
        driver_result(driver.cuMemcpyDtoDAsync(base + staging_x + dst_row * row_bytes,
                                               x_address + src_row * row_bytes, rows * row_bytes, stream),
                      "combine's row copy")
        driver_result(driver.cuStreamWriteValue64(stream, base + tail_index * 8, so_far, 0), "combine's tail write")
    return move


def combine_copies(counts: list[list[int]], rank: int) -> list[tuple[int, int, int, int]]:
    """``(peer, first row in x, rows, first row in the peer's staging)`` for every peer this
    rank returns rows to, peers in rotated order (so that the ranks do not all start on one).

    ``counts[s][d]``: rows rank s sent to rank d in the dispatch. Our ``x`` holds the block
    from each source after the blocks from lower sources; the source's staging holds the rows
    from each expert rank after those from lower expert ranks.
    """
    num_ranks = len(counts)
    result = []
    for step in range(1, num_ranks):
        peer = (rank + step) % num_ranks
        if counts[peer][rank]:
            start = sum(counts[source][rank] for source in range(peer))
            offset = sum(counts[peer][expert_rank] for expert_rank in range(rank))
            result.append((peer, start, counts[peer][rank], offset))
    return result
