"""Normal-mode cached dispatch with the copy engines receiving (``Tuning.copy_engine_dispatch``).

In a dispatch every row lands in the receiver's staging at the row index it has in the
receiver's outputs, and the rows from source s fill one contiguous block there, after the
rows from lower sources. Receiving is then a local copy of each source's block, which SM
programs do at ~25 GB/s each while a copy engine does ~1.9 TB/s (4 x H200). So when the host
knows the counts (a cached dispatch whose handle read them back), the dispatch launches only
senders (``dispatch_kernel``'s ``COPY_RECEIVE``: all num_sms programs send, then copy our own
rows), and a side stream receives:

* for each source with rows for us, in rotated order: wait until the source's sender programs
  have all counted themselves in our ``dispatch_arrived`` word for it (the cumulative senders
  of every copy-engine dispatch so far: the same on every rank, since every rank makes the
  same calls with the same num_sms), then copy the block from staging into ``recv_x``;
* then one small kernel (``staged_fields_kernel``) copies the small fields of the arrived rows
  (scales, top-k, source index) and releases every source's staging, as receiver programs do.

A wait is a one-program kernel (``arrival_wait_kernel``) on the side stream, which times out
into the status word like every wait on a peer, and a copy torch's ``copy_``. A driver stream
wait (``cuStreamWaitValue64``) would cost the host less, but it has no time-out: a peer that
never sends would hang the stream instead of raising.

No CUDA-graph replay of such calls yet (``replay.py`` learns none): each goes through the
general path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton.language as tl

from tritonep.backends.nvlink.memory import SymmetricBuffer
from tritonep.backends.nvlink.normal.dispatch_kernel import copy_staged_row_fields
from tritonep.device.rows import block_count, block_start, channel_range
from tritonep.device.signals import add_release, wait_at_least
from tritonep.device.status_codes import PHASE_DISPATCH_DATA
from tritonep.runtime import kernel_names
from tritonep.runtime.launcher import FastLauncher
from tritonep.runtime.platform import GPU_KERNELS
from tritonep.runtime.side_streams import PeerStreams

# Programs of the small-field kernel when there are scales or top-k fields (fp8 scales of
# hidden 7168 are 224 bytes a row, several MB a call: one program would take hundreds of us);
# with the source index alone (4 bytes a row), one.
FIELD_PROGRAMS = 16
FIELD_ROWS = 64


@kernel_names.jit("tritonep::intranode::arrival_wait",
                  do_not_specialize=["word", "target", "source"])
def arrival_wait_kernel(peer_base_ptrs, rank, word, target, status_ptr, timeout_ns, source, GPU: tl.constexpr):
    """Hold the stream until this rank's signal word ``word`` reaches ``target`` (or the wait
    times out into the status word, naming ``source``)."""
    my_signals = tl.load(peer_base_ptrs + rank).to(tl.pointer_type(tl.int64))
    wait_at_least(my_signals + word, target.to(tl.int64), status_ptr, timeout_ns, PHASE_DISPATCH_DATA, source, GPU)


# Per launch only these change; the rest is fixed per engine (the caller's ``owner``).
_WAIT = FastLauncher(arrival_wait_kernel, changing=("word", "target", "source"))


@kernel_names.jit("tritonep::intranode::staged_fields",
                  do_not_specialize=["rank", "scale_words"])
def staged_fields_kernel(prefix_ptr, peer_base_ptrs, rank, staging_scales, staging_idx, staging_weights, staging_src,
                         out_scales_ptr, out_idx_ptr, out_weights_ptr, out_src_ptr, scale_words,
                         DONE_WORD: tl.constexpr, NUM_RANKS: tl.constexpr, HAS_SCALES: tl.constexpr,
                         HAS_TOPK: tl.constexpr, NUM_TOPK: tl.constexpr, TOPK_PAD: tl.constexpr,
                         SCALE_PAD: tl.constexpr, ROWS: tl.constexpr):
    """The small fields of every peer's rows, from our staging into the same rows of the outputs
    (each source's block split over the programs), then every program releases every source's
    staging: the side stream runs this after the row copies, so nothing reads staging after."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    my_signals = tl.load(peer_base_ptrs + rank).to(tl.pointer_type(tl.int64))
    for step in range(0, NUM_RANKS - 1):
        source = (rank + 1 + step) % NUM_RANKS
        start = block_start(prefix_ptr, source, rank, NUM_RANKS)
        lo, hi = channel_range(block_count(prefix_ptr, source, rank, NUM_RANKS), pid, programs)
        for row0 in range(start + lo, start + hi, ROWS):
            rows = row0 + tl.arange(0, ROWS)
            mask = rows < start + hi
            # (No row words: staging_x, out_x_ptr and x_words stand unused.)
            copy_staged_row_fields(my_signals, 0, staging_scales, staging_idx, staging_weights, staging_src, rows,
                                   mask, out_src_ptr, out_scales_ptr, out_idx_ptr, out_weights_ptr, out_src_ptr, 0,
                                   scale_words, HAS_SCALES, HAS_TOPK, NUM_TOPK, TOPK_PAD, SCALE_PAD, 16, False)
    for step in range(0, NUM_RANKS - 1):
        source = (rank + 1 + step) % NUM_RANKS
        peer_signals = tl.load(peer_base_ptrs + source).to(tl.pointer_type(tl.int64))
        add_release(peer_signals + DONE_WORD + rank, 1)


_FIELDS = FastLauncher(staged_fields_kernel, changing=(
    "prefix_ptr", "out_scales_ptr", "out_idx_ptr", "out_weights_ptr", "out_src_ptr"))


def field_programs(scale_words: int, num_topk: int) -> int:
    """Programs of ``staged_fields_kernel`` for rows with these fields: each releases every
    source once, so a call counts this many receivers (``NormalState.dispatch_released``)."""
    return FIELD_PROGRAMS if scale_words or num_topk else 1


# A block mover: ``(source, target, first row, rows)`` waits until our arrived word for
# ``source`` reaches ``target``, then copies rows [first, first + rows) of staging's x region
# into the same rows of ``recv_x``.
BlockMover = Callable[[int, int, int, int], None]


class DispatchCopier:
    """The copy-engine receive of a cached dispatch, for one engine and tuning: every source's
    block, then the small-field kernel, on one side stream of ``streams``, which the caller joins.

    ``owner``: a key that stands for ``memory``, its signal layout and ``status_args``
    in the launches' setup keys (the engine's launch generation). ``status_args``: the status
    word's tensor and the time-out, for the wait kernel."""

    __slots__ = ("memory", "rank", "streams", "owner", "status_args")

    def __init__(self, memory: SymmetricBuffer, streams: PeerStreams, owner: object,
                 status_args: tuple[torch.Tensor, int]) -> None:
        self.memory, self.rank, self.streams = memory, memory.rank, streams
        self.owner, self.status_args = owner, status_args

    def fork(self, after: torch.cuda.Event | None, copies: list[tuple[int, int, int, int]], target: int,
             recv_x: torch.Tensor, field_outputs: tuple[torch.Tensor, ...], prefix: torch.Tensor, staging: list[int],
             scale_words: int, setup: tuple, constants: dict[str, Any], programs: int) -> None:
        """Start the receive of a dispatch whose senders were launched after the point ``after``
        of the current stream (``PeerStreams.mark``): ``copies`` from
        ``combine_copy_engine.combine_copies`` (the rows a combine returns to a peer are the rows
        it sent here: ``(source, first row, rows, ...)``, the same block in staging and outputs),
        ``target`` the arrived count the sources reach with this call, ``field_outputs`` the
        scales (as int32 words), top-k ids, top-k weights and source-index outputs as the
        dispatch kernel gets them (placeholders for absent fields), ``prefix``
        rank_prefix_matrix, ``staging`` the dispatch's staging regions
        (``StagingLayout.dispatch``), ``setup`` the call shape's key, ``constants`` its
        dispatch-kernel constants, ``programs`` the field kernel's (``field_programs``)."""
        move = _block_mover(self, recv_x, staging[0], recv_x.shape[1] * recv_x.element_size())
        fields = (prefix, self.memory.peer_base_ptrs, self.rank, *staging[1:], *field_outputs, max(scale_words, 1))

        def field_constants() -> dict[str, Any]:
            return dict({name: constants[name] for name in _FIELD_CONSTANTS}, ROWS=FIELD_ROWS)

        def job() -> None:
            for source, first, rows, _ in copies:
                move(source, target, first, rows)
            _FIELDS(programs, (self.owner, setup), fields, field_constants, 4)
        self.streams.fork([job], after=after)


# What the field kernel takes of the dispatch kernel's constants.
_FIELD_CONSTANTS = ("DONE_WORD", "NUM_RANKS", "HAS_SCALES", "HAS_TOPK", "NUM_TOPK", "TOPK_PAD", "SCALE_PAD")


def _block_mover(copier: DispatchCopier, recv_x: torch.Tensor, staging_x: int, row_bytes: int) -> BlockMover:
    """The one-program wait kernel, then torch's copy of the block."""
    memory = copier.memory
    arrived = memory.signals.dispatch_arrived
    fixed = (memory.peer_base_ptrs, copier.rank)
    status, timeout_ns = copier.status_args
    out_bytes = recv_x.view(torch.uint8).view(-1)

    def move(source: int, target: int, first: int, rows: int) -> None:
        _WAIT(1, copier.owner, (*fixed, arrived + source, target, status, timeout_ns, source),
              dict(GPU=GPU_KERNELS), 1)
        out_bytes.narrow(0, first * row_bytes, rows * row_bytes).copy_(
            memory.local.narrow(0, staging_x + first * row_bytes, rows * row_bytes), non_blocking=True)
    return move
