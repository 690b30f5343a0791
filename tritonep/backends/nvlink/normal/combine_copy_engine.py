"""Normal-mode combine with the copy engines: rows cross NVLink without any SM, SMs only reduce.

In combine, the rows an expert rank returns to source s are one contiguous block of its ``x``
(dispatch laid them out by source, token order inside), and they land in one contiguous range
of s's combine staging (grouped by expert rank, in s's send-list order). When the host knows
the counts (every dispatch that read them back) the block needs no gather, so each block
crosses NVLink as ``cudaMemcpyAsync`` calls into the peer's symmetric memory: the copy engines
carry the bulk bytes at link speed and the SMs are left to reduce.

The block to each peer goes in ``pieces`` pieces, in token order, on that peer's side stream
(``side_streams.PeerStreams``). After each piece the stream publishes ``(epoch << 32) | rows``
in the peer's tail word for (this rank, piece): exactly what an SM sender of
``combine_kernel`` publishes for a channel, with pieces as channels. So the reduction is
``combine_kernel`` itself with no sender programs: its reducers wait per stage of tokens for
the pieces that hold the stage's rows, and take the stages interleaved (stage i on program
i % P), so that every program follows the front of arriving pieces and the reduction overlaps
the copies instead of trailing them. The top-k weights (a few bytes per row) go first, for all
peers in one small kernel on the caller's stream (``push_combine_weights``); the side streams
start after it, so every tail word is written after the weights it publishes.

Host cost: each operation on a side stream costs the host microseconds, and an EP8 combine has
7 peers. A copy costs about what a small kernel launch costs (through cuda-bindings, ctypes or
``cuMemcpyBatchAsync`` alike), a stream memory write a fraction of that, and a side stream's
fork and join about a copy. With cuda-bindings installed (and the GPU supporting stream memory
operations) a piece is a copy and a ``cuStreamWriteValue64``: the tail word is written by the
stream itself, which the driver orders after the copy with a memory barrier. Otherwise it is
torch's ``copy_`` and a one-program signal kernel, same semantics (``Tuning.combine_driver=
False`` chooses it). By default ``pieces_per_peer`` picks fewer pieces per peer as the peers
grow in number, so that the host's issue stays well under the copies' own time.

``CombineCopier`` is that side work for one engine: the general path and the combine's replay
(``replay.py``) both call it.

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

from tritonep.backends.nvlink.memory import MAX_CHANNELS, SymmetricBuffer
from tritonep.device.rows import block_count, block_start
from tritonep.device.signals import fence_system, publish
from tritonep.runtime import kernel_names
from tritonep.runtime.launcher import FastLauncher, current_stream
from tritonep.runtime.platform import GPU_KERNELS
from tritonep.runtime.side_streams import PeerStreams


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
                           NUM_RANKS: tl.constexpr, NUM_TOPK: tl.constexpr, BLOCK: tl.constexpr, GPU: tl.constexpr):
    """Program p pushes the top-k weights of the rows this rank returns to peer
    (rank + 1 + p) % R into that peer's combine staging, at the rows' staging positions.

    In our ``x`` (dispatch's output) the peer's rows are its block of ``rank_prefix_matrix``;
    in the peer's staging they follow the rows it got back from lower expert ranks, the sum
    over e < rank of what it sent to e. The same arithmetic as ``combine_copies`` on the host.
    """
    peer = (rank + 1 + tl.program_id(0)) % NUM_RANKS
    start = block_start(prefix_ptr, peer, rank, NUM_RANKS)
    total = block_count(prefix_ptr, peer, rank, NUM_RANKS) * NUM_TOPK
    offset = start * 0
    for e in range(0, rank):
        offset += block_count(prefix_ptr, peer, e, NUM_RANKS)
    peer_base = tl.load(peer_base_ptrs + peer)
    src = weights_ptr + start.to(tl.int64) * NUM_TOPK
    dst = (peer_base + staging_weights).to(tl.pointer_type(tl.float32)) + offset.to(tl.int64) * NUM_TOPK
    for e0 in range(0, total, BLOCK):
        elements = e0 + tl.arange(0, BLOCK)
        mask = elements < total
        tl.store(dst + elements, tl.load(src + elements, mask=mask), mask=mask)
    fence_system(GPU)   # the weights reach the peer before anything the streams do after this kernel


_WEIGHTS = FastLauncher(combine_weights_kernel, changing=("weights_ptr", "prefix_ptr"))

# Pieces in all (over the peers) that a combine's host issue may cost by default: each piece
# costs the host about a kernel launch (module docstring), and more than 8 of them would be a
# large part of an EP8 combine's time on slow hosts.
MAX_PIECES = 8


def pieces_per_peer(num_ranks: int, requested: int) -> int:
    """Pieces per peer: ``requested`` if set (> 0), else 2 while the peers are few and 1 from
    EP6 on (EP8: 7 pieces). A piece lets the reduction start earlier, but costs the host a copy
    and a stream write: past 2 per peer the host's cost outweighs the earlier start."""
    if requested > 0:
        return requested
    return max(1, min(2, MAX_PIECES // max(num_ranks - 1, 1)))


def push_combine_weights(topk_weights: torch.Tensor, rank_prefix_matrix: torch.Tensor, peer_base_ptrs: torch.Tensor,
                         staging_weights: int, rank: int, num_ranks: int, owner: object) -> None:
    """Launch ``combine_weights_kernel`` on the current stream: every peer's top-k weights, one
    program per peer. ``owner``: a key that stands for ``peer_base_ptrs``, ``rank`` and
    ``num_ranks`` (equal keys, equal values; the engine's launch generation)."""
    num_topk = topk_weights.shape[1]
    _WEIGHTS(num_ranks - 1, (owner, staging_weights, num_topk),
             (topk_weights, rank_prefix_matrix, peer_base_ptrs, staging_weights, rank),
             lambda: dict(NUM_RANKS=num_ranks, NUM_TOPK=num_topk, BLOCK=1024, GPU=GPU_KERNELS), 4)


class CombineCopier:
    """The copy-engine combine's side work for one engine and tuning: the top-k weights to every
    peer (on the current stream: the tail words publish them), then each peer's rows in pieces on
    that peer's side stream of ``streams``, which the caller joins after the reduction's launch.

    ``driver``: from ``driver_memory_operations``, or None for torch's copies and the signal
    kernel. ``owner``: a key that stands for ``memory``, ``rank`` and ``num_ranks`` in the
    launches' setup keys (the engine's launch generation)."""

    __slots__ = ("memory", "rank", "num_ranks", "streams", "driver", "owner")

    def __init__(self, memory: SymmetricBuffer, streams: PeerStreams, driver: Any, owner: object) -> None:
        self.memory, self.rank, self.num_ranks = memory, memory.rank, memory.num_ranks
        self.streams, self.driver, self.owner = streams, driver, owner

    def fork(self, x: torch.Tensor, topk_weights: torch.Tensor | None, copies: list[tuple[int, int, int, int]],
             rank_prefix_matrix: torch.Tensor, regions: list[int], pieces: int, epoch: int) -> None:
        """Start combine ``epoch``'s side work: ``copies`` from ``combine_copies``, ``regions``
        the combine's staging regions (x, weights), ``pieces`` per peer."""
        if not copies:   # no rows go to a peer (one rank, or all stay here): nothing to send
            return
        memory = self.memory
        if topk_weights is not None:
            push_combine_weights(topk_weights, rank_prefix_matrix, memory.peer_base_ptrs, regions[1], self.rank,
                                 self.num_ranks, self.owner)
        self.streams.fork(combine_copy_jobs(
            x, copies, memory.peers, memory.peer_base_ptrs, regions[0], memory.signals.combine_tail, self.rank, epoch,
            pieces, self.owner, self.driver))


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


def _check(result: tuple, what: str) -> None:
    if result[0] != 0:   # CUresult.CUDA_SUCCESS
        raise RuntimeError(f"combine's {what} failed: {result[0]!r}")


def piece_range(count: int, piece: int, pieces: int) -> tuple[int, int]:
    """Rows [lo, hi) of a ``count``-row block in piece ``piece`` of ``pieces`` (``rows.channel_range``)."""
    size = -(-count // pieces)
    lo = min(piece * size, count)
    return lo, min(lo + size, count)


def combine_copy_jobs(x: torch.Tensor, copies: list[tuple[int, int, int, int]], peers: list[torch.Tensor],
                      peer_base_ptrs: torch.Tensor, staging_x: int, tail_word: int, rank: int, epoch: int,
                      pieces: int, owner: object, driver: Any = None) -> list[Callable[[], None]]:
    """One job per peer: its block of ``x`` in ``pieces`` copies, each followed by its tail word
    (the weights went before, ``push_combine_weights``).

    ``copies`` lists ``(peer, first row in x, rows, first row in the peer's staging)``.
    ``owner``: a key that stands for ``peer_base_ptrs`` (equal keys, equal tensors).
    ``driver``: from ``driver_memory_operations``, or None for torch's copies and the kernel.
    """
    make = _driver_piece if driver is not None else _torch_piece
    move_piece = make(driver, x, peers, peer_base_ptrs, staging_x, tail_word + rank * MAX_CHANNELS, epoch << 32,
                      owner)

    def job(peer: int, start: int, count: int, offset: int) -> Callable[[], None]:
        def run() -> None:
            stream = current_stream() if driver is not None else 0   # (the kernel finds its own)
            for piece in range(pieces):
                lo, hi = piece_range(count, piece, pieces)
                if hi > lo:
                    move_piece(stream, peer, piece, start + lo, offset + lo, hi - lo)
        return run

    return [job(*copy) for copy in copies]


# A piece mover: ``(stream, peer, piece, first row in x, first row in the peer's staging, rows)``
# copies the piece's rows into the peer's staging, then publishes ``stamp + rows`` in the peer's
# tail word ``tail_index + piece`` for (this rank, piece).
PieceMover = Callable[[int, int, int, int, int, int], None]


def _torch_piece(driver: Any, x: torch.Tensor, peers: list[torch.Tensor], peer_base_ptrs: torch.Tensor,
                 staging_x: int, tail_index: int, stamp: int, owner: object) -> PieceMover:
    """torch's copy of the rows, then the one-program signal kernel."""
    row_bytes = x.shape[1] * x.element_size()
    x_bytes = x.view(torch.uint8).view(-1)

    def move(stream: int, peer: int, piece: int, src_row: int, dst_row: int, rows: int) -> None:
        peers[peer].narrow(0, staging_x + dst_row * row_bytes, rows * row_bytes).copy_(
            x_bytes.narrow(0, src_row * row_bytes, rows * row_bytes), non_blocking=True)
        _SIGNAL(1, owner, (peer_base_ptrs, peer, tail_index + piece, stamp + rows), {}, 1)
    return move


def _driver_piece(driver: Any, x: torch.Tensor, peers: list[torch.Tensor], peer_base_ptrs: torch.Tensor,
                  staging_x: int, tail_index: int, stamp: int, owner: object) -> PieceMover:
    """Through the driver: the rows' copy, then the tail word written by the stream itself (it
    fences the copy before the write)."""
    row_bytes = x.shape[1] * x.element_size()
    x_address = x.data_ptr()
    bases = [peer.data_ptr() for peer in peers]

    def move(stream: int, peer: int, piece: int, src_row: int, dst_row: int, rows: int) -> None:
        base = bases[peer]
        _check(driver.cuMemcpyDtoDAsync(base + staging_x + dst_row * row_bytes, x_address + src_row * row_bytes,
                                        rows * row_bytes, stream), "row copy")
        _check(driver.cuStreamWriteValue64(stream, base + (tail_index + piece) * 8, stamp + rows, 0), "tail write")
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
