"""Normal-mode cached dispatch with the copy engines receiving (``Tuning.copy_engine_dispatch``).

In a dispatch every row lands in the receiver's staging at the row index it has in the
receiver's outputs, and the rows from source s fill one contiguous block there, after the
rows from lower sources; each small field (fp8 scales, top-k ids and weights) has a staging
region of its own laid out the same way. Receiving is then a local copy per region, which SM
programs do at ~25 GB/s each while a copy engine does ~1.9 TB/s (4 x H200). So when the host
knows the counts (a cached dispatch whose handle read them back), the dispatch launches only
senders (``dispatch_kernel``'s ``COPY_RECEIVE``: all num_sms programs send, then copy our own
rows), and a side stream receives:

* one wait until every source's sender programs have all counted themselves in our
  ``dispatch_arrived`` word for it (the cumulative senders of every copy-engine dispatch so
  far: the same on every rank, since every rank makes the same calls with the same num_sms);
  the wait keeps that running total itself, in our ``dispatch_counted`` word, so that its
  arguments are the same on every call;
* the rows of the sources below us, then those of the sources above us (two contiguous ranges
  around our own block, which the senders fill), then the same ranges of each small field the
  call returns (a cached dispatch returns no source indices: the handle has them).

The host's cost is one operation each, so the call issues as few as it can: a wait per source
would let early sources' copies start sooner, but every source's senders run at once and finish
at about the same time, while each copy and each launch costs the host microseconds.

The release of every source's staging is owed, not issued here: this rank's next dispatch
launch with senders adds it first thing (``NormalState.dispatch_release_due``), and that launch
comes after these copies on the stream (the caller joins the side stream). A release here would
be one more operation per source (a stream memory write or a kernel) on every call. Until then a
source's next dispatch waits for it, which it would do anyway for our rows of that dispatch.

The wait is a one-program kernel (``arrival_wait_kernel``) on the side stream, which times out
into the status word like every wait on a peer. A driver stream wait (``cuStreamWaitValue64``)
would cost the host less, but it has no time-out: a peer that never sends would hang the stream
instead of raising. With cuda-bindings (``driver``) a copy is ``cuMemcpyDtoDAsync``; otherwise
torch's ``copy_``.

A repeat of such a call with one handle takes the cached dispatch's replay (``replay.py``),
which launches the senders and forks this same side work. Nothing in that work changes from
one call to the next but the outputs' addresses, so once they repeat (``SideGraphs``) the
replay forks it as one CUDA graph (``capture``): the copies cost the host most of the side
work's time, and in a graph they cost a fraction of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton.language as tl

from tritonep.backends.nvlink.memory import SymmetricBuffer
from tritonep.backends.nvlink.normal.state import NormalState
from tritonep.device.signals import wait_at_least
from tritonep.device.status_codes import PHASE_DISPATCH_DATA
from tritonep.runtime import kernel_names
from tritonep.runtime.launcher import FastLauncher, current_stream
from tritonep.runtime.platform import GPU_KERNELS
from tritonep.runtime.side_streams import driver_result


@kernel_names.jit("tritonep::intranode::arrival_wait", do_not_specialize=["first_word", "counted_word", "senders"])
def arrival_wait_kernel(peer_base_ptrs, rank, first_word, counted_word, senders, status_ptr, timeout_ns,
                        NUM_RANKS: tl.constexpr, GPU: tl.constexpr):
    """Hold the stream until every source's arrived word (this rank's signal word ``first_word``
    + source) has counted ``senders`` more sender programs than this rank's waits counted so far
    (its word ``counted_word``), then add them to that count; a wait that times out goes into
    the status word, naming the source."""
    my_signals = tl.load(peer_base_ptrs + rank).to(tl.pointer_type(tl.int64))
    # Only this kernel, one program on one stream, reads and writes the count.
    target = tl.load(my_signals + counted_word) + senders
    for step in range(1, NUM_RANKS):
        source = (rank + step) % NUM_RANKS
        wait_at_least(my_signals + first_word + source, target, status_ptr, timeout_ns, PHASE_DISPATCH_DATA, source,
                      GPU)
    tl.store(my_signals + counted_word, target)


# Per launch only the senders may change; the rest is fixed per engine (the caller's ``owner``).
_WAIT = FastLauncher(arrival_wait_kernel, changing=("senders",))

# The receivers a copy-engine dispatch counts per source (one release each).
RECEIVERS = 1


def staged_ranges(copies: list[tuple[int, int, int, int]]) -> list[tuple[int, int]]:
    """``(first row, rows)`` of the received rows in staging: the sources' blocks (``copies``,
    from ``combine_copy_engine.combine_copies``), merged where they touch; at most two ranges,
    below and above our own block."""
    ranges: list[tuple[int, int]] = []
    for _, first, rows, _ in sorted(copies, key=lambda copy: copy[1]):
        if ranges and sum(ranges[-1]) == first:
            ranges[-1] = (ranges[-1][0], ranges[-1][1] + rows)
        elif rows:
            ranges.append((first, rows))
    return ranges


class DispatchCopier:
    """The copy-engine receive of a cached dispatch, for one engine and tuning: the arrivals'
    wait and the copies, on one side stream of ``state.peer_streams``, and the counters they
    advance in ``state``. The general path and the cached dispatch's replay (``replay.py``) both
    call it: ``mark`` just before the senders' launch, ``receive`` just after it.

    ``driver``: cuda-bindings' driver module, or None for torch's copies. ``owner``: a key that
    stands for ``memory``, its signal layout and ``status_args`` in the launches' setup keys (the
    engine's launch generation). ``status_args``: the status word's tensor and the time-out, for
    the wait kernel."""

    __slots__ = ("memory", "state", "streams", "driver", "owner", "wait_args", "wait_constants")

    def __init__(self, memory: SymmetricBuffer, state: NormalState, driver: Any, owner: object,
                 status_args: tuple[torch.Tensor, int]) -> None:
        self.memory, self.state, self.streams, self.driver, self.owner = \
            memory, state, state.peer_streams, driver, owner
        status, timeout_ns = status_args
        signals = memory.signals
        self.wait_args = (memory.peer_base_ptrs, memory.rank, signals.dispatch_arrived, signals.dispatch_counted,
                          status, timeout_ns)
        self.wait_constants = dict(NUM_RANKS=memory.num_ranks, GPU=GPU_KERNELS)

    def mark(self) -> Any:
        """The point of the current stream just before the senders' launch (for ``receive``)."""
        return self.streams.mark()

    def receive(self, start: Any, senders: int, ranges: list[tuple[int, int]],
                outputs: list[tuple[int, torch.Tensor]], graph: Any = None) -> None:
        """After the launch of ``senders`` sender programs (``start``: what ``mark`` returned
        before it): count them, owe the sources this call's release, and receive on the side
        stream, which the current stream then joins. ``ranges``: the handle's
        ``staged_ranges``; ``outputs``: each region to copy as ``(its staging offset in bytes,
        its output)``, the rows first (``StagingLayout.dispatch``). ``graph``: that side work
        as ``capture`` made it for these arguments, forked in its place. With nothing to
        receive the wait still runs: it keeps the count."""
        state = self.state
        state.dispatch_arrived += senders
        state.dispatch_release_due += RECEIVERS
        if graph is not None:
            self.streams.fork_graph(graph, after=start)
        else:
            self.streams.fork([self._job(senders, ranges, outputs)], after=start)
        self.streams.join()

    @property
    def captures(self) -> bool:
        """Whether ``capture`` can make graphs here: the driver's copies, on streams that capture."""
        return self.driver is not None and self.streams.captures

    def capture(self, senders: int, ranges: list[tuple[int, int]], outputs: list[tuple[int, torch.Tensor]]) -> Any:
        """``receive``'s side work for these arguments, captured as a graph (nothing runs), or
        None if the driver refused the capture (``PeerStreams.capture``)."""
        job = self._job(senders, ranges, outputs)
        return self.streams.capture(lambda branch: job(), "the dispatch's copy-engine receive")

    def _job(self, senders: int, ranges: list[tuple[int, int]],
             outputs: list[tuple[int, torch.Tensor]]) -> Callable[[], None]:
        """The wait, then each region's ranges: ``cuMemcpyDtoDAsync`` with ``driver``, else
        torch's ``copy_``."""
        peer_base_ptrs, rank, first_word, counted_word, status, timeout_ns = self.wait_args
        wait_args = (peer_base_ptrs, rank, first_word, counted_word, senders, status, timeout_ns)
        driver, local = self.driver, self.memory.local
        if driver is not None:
            base = local.data_ptr()
            regions = [(base + offset, out.data_ptr(), out.stride(0) * out.element_size()) for offset, out in outputs]
        else:
            regions = [(offset, out.view(torch.uint8).view(-1), out.stride(0) * out.element_size())
                       for offset, out in outputs]

        def job() -> None:
            _WAIT(1, self.owner, wait_args, self.wait_constants, 1)
            if driver is not None:
                stream = current_stream()
                for src, dst, row_bytes in regions:
                    for first, rows in ranges:
                        driver_result(driver.cuMemcpyDtoDAsync(dst + first * row_bytes, src + first * row_bytes,
                                                               rows * row_bytes, stream), "dispatch's row copy")
                return
            for offset, out_bytes, row_bytes in regions:
                for first, rows in ranges:
                    out_bytes.narrow(0, first * row_bytes, rows * row_bytes).copy_(
                        local.narrow(0, offset + first * row_bytes, rows * row_bytes), non_blocking=True)
        return job
