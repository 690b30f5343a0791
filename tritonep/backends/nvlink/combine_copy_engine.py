"""Normal-mode combine with the copy engines: rows cross NVLink without any SM, SMs only reduce.

In combine, the rows an expert rank returns to source s are one contiguous block of its ``x``
(dispatch laid them out by source, token order inside), and they land in one contiguous range
of s's combine staging (grouped by expert rank, in s's send-list order). When the host knows
the counts (every dispatch that read them back) the block needs no gather, so each block
crosses NVLink as ``cudaMemcpyAsync`` calls into the peer's symmetric memory: the copy engines
carry the bulk bytes at link speed and the SMs are left to reduce.

The block to each peer goes in ``chunks`` pieces, in token order, on that peer's side stream
(``side_streams.PeerStreams``). After each piece a one-program kernel copies the piece's top-k
weights (a few bytes per row) and publishes ``(epoch << 32) | rows`` into the peer's tail word
for (this rank, piece): exactly what an SM sender of ``combine_kernel`` publishes for a
channel, with pieces as channels. So the reduction is ``combine_kernel`` itself with no sender
programs: its reducers wait per stage of tokens for the pieces that hold the stage's rows, and
take the stages interleaved (stage i on program i % P), so that every program follows the
front of arriving pieces and the reduction overlaps the copies instead of trailing them.

Host cost: a combine enqueues two to three operations per piece and peer, so at EP8 its host
path grows with the rank count. With cuda-bindings installed (and the GPU supporting stream
memory operations) a piece is two driver calls: ``cuMemcpyDtoDAsync`` of the rows (and one of
the weights), then ``cuStreamWriteValue64`` of the tail word, which the driver orders after
the copies with a memory barrier; no kernel. Otherwise it is torch's ``copy_`` and the
one-program signal kernel, same semantics (``Tuning.combine_driver=False`` chooses it).

Staging reuse: the reduction's last program waits until every peer's reducers finished the
call (``combine_kernel.release_staging``), and the next combine's copies start only after that
kernel on the caller's stream, so a copy never overwrites rows a peer has not reduced yet.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from .launcher import FastLauncher, current_stream
from .memory import MAX_CHANNELS
from .sync import publish


@triton.jit(do_not_specialize=["peer", "src_row", "dst_row", "rows", "tail_index", "value"])
def combine_piece_signal_kernel(weights_ptr, peer_base_ptrs, peer, src_row, dst_row, rows, staging_weights,
                                tail_index, value, HAS_WEIGHTS: tl.constexpr, NUM_TOPK: tl.constexpr,
                                BLOCK: tl.constexpr):
    """After a piece's rows were copied (stream order): copy its weights, then publish it."""
    peer_base = tl.load(peer_base_ptrs + peer)
    if HAS_WEIGHTS:
        src = weights_ptr + src_row.to(tl.int64) * NUM_TOPK
        dst = (peer_base + staging_weights).to(tl.pointer_type(tl.float32)) + dst_row.to(tl.int64) * NUM_TOPK
        for e0 in range(0, rows * NUM_TOPK, BLOCK):
            elements = e0 + tl.arange(0, BLOCK)
            mask = elements < rows * NUM_TOPK
            tl.store(dst + elements, tl.load(src + elements, mask=mask), mask=mask)
    publish(peer_base.to(tl.pointer_type(tl.int64)) + tail_index, value)


# Per launch only these change; ``peer_base_ptrs`` is fixed per backend (the caller's ``owner``).
_SIGNAL = FastLauncher(combine_piece_signal_kernel, changing=(
    "weights_ptr", "peer", "src_row", "dst_row", "rows", "tail_index", "value"))


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


def combine_copy_jobs(x: torch.Tensor, topk_weights: torch.Tensor | None, copies: list[tuple[int, int, int, int]],
                      peers: list[torch.Tensor], peer_base_ptrs: torch.Tensor, staging_x: int, staging_weights: int,
                      tail_word: int, rank: int, epoch: int, pieces: int, owner: object = None,
                      driver: Any = None) -> list[Callable[[], None]]:
    """One job per peer: its block of ``x`` in ``pieces`` copies, each followed by its signal.

    ``copies`` lists ``(peer, first row in x, rows, first row in the peer's staging)``.
    ``owner``: a key that stands for ``peer_base_ptrs`` (equal keys, equal tensors), or None.
    ``driver``: from ``driver_memory_operations``, or None for torch's copies and the kernel.
    """
    make = _driver_piece if driver is not None else _torch_piece
    move_piece = make(driver, x, topk_weights, peers, peer_base_ptrs, staging_x, staging_weights,
                      tail_word + rank * MAX_CHANNELS, epoch << 32, owner)

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
# copies the piece's rows and top-k weights into the peer's staging, then publishes
# ``stamp + rows`` in the peer's tail word ``tail_index + piece`` for (this rank, piece).
PieceMover = Callable[[int, int, int, int, int, int], None]


def _torch_piece(driver: Any, x: torch.Tensor, topk_weights: torch.Tensor | None, peers: list[torch.Tensor],
                 peer_base_ptrs: torch.Tensor, staging_x: int, staging_weights: int, tail_index: int, stamp: int,
                 owner: object) -> PieceMover:
    """torch's copy of the rows, then the one-program signal kernel (weights and tail word)."""
    row_bytes = x.shape[1] * x.element_size()
    x_bytes = x.view(torch.uint8).view(-1)
    num_topk = topk_weights.shape[1] if topk_weights is not None else 1
    weights = topk_weights if topk_weights is not None else x
    constants = dict(HAS_WEIGHTS=topk_weights is not None, NUM_TOPK=num_topk, BLOCK=1024)
    setup = None if owner is None else (owner, staging_weights, topk_weights is not None, num_topk)

    def move(stream: int, peer: int, piece: int, src_row: int, dst_row: int, rows: int) -> None:
        peers[peer].narrow(0, staging_x + dst_row * row_bytes, rows * row_bytes).copy_(
            x_bytes.narrow(0, src_row * row_bytes, rows * row_bytes), non_blocking=True)
        _SIGNAL(1, setup, (weights, peer_base_ptrs, peer, src_row, dst_row, rows, staging_weights, tail_index + piece,
                           stamp + rows), constants, 4)
    return move


def _driver_piece(driver: Any, x: torch.Tensor, topk_weights: torch.Tensor | None, peers: list[torch.Tensor],
                  peer_base_ptrs: torch.Tensor, staging_x: int, staging_weights: int, tail_index: int, stamp: int,
                  owner: object) -> PieceMover:
    """Through the driver: the rows' copy, the weights' copy, and the tail word written by the
    stream itself (it fences the copies before the write)."""
    row_bytes = x.shape[1] * x.element_size()
    x_address = x.data_ptr()
    weight_bytes = topk_weights.shape[1] * 4 if topk_weights is not None else 0
    weights_address = topk_weights.data_ptr() if topk_weights is not None else 0
    bases = [peer.data_ptr() for peer in peers]

    def move(stream: int, peer: int, piece: int, src_row: int, dst_row: int, rows: int) -> None:
        base = bases[peer]
        _check(driver.cuMemcpyDtoDAsync(base + staging_x + dst_row * row_bytes, x_address + src_row * row_bytes,
                                        rows * row_bytes, stream), "row copy")
        if weight_bytes:
            _check(driver.cuMemcpyDtoDAsync(base + staging_weights + dst_row * weight_bytes,
                                            weights_address + src_row * weight_bytes, rows * weight_bytes, stream),
                   "weights copy")
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
