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
which launches the senders and forks this same side work.
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


@kernel_names.jit("tritonep::intranode::arrival_wait", do_not_specialize=["first_word", "target"])
def arrival_wait_kernel(peer_base_ptrs, rank, first_word, target, status_ptr, timeout_ns, NUM_RANKS: tl.constexpr,
                        GPU: tl.constexpr):
    """Hold the stream until every source's arrived word (this rank's signal word ``first_word``
    + source) reaches ``target``; a wait that times out goes into the status word, naming the
    source."""
    my_signals = tl.load(peer_base_ptrs + rank).to(tl.pointer_type(tl.int64))
    for step in range(1, NUM_RANKS):
        source = (rank + step) % NUM_RANKS
        wait_at_least(my_signals + first_word + source, target.to(tl.int64), status_ptr, timeout_ns,
                      PHASE_DISPATCH_DATA, source, GPU)


# Per launch only the target changes; the rest is fixed per engine (the caller's ``owner``).
_WAIT = FastLauncher(arrival_wait_kernel, changing=("target",))

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
        self.wait_args = (memory.peer_base_ptrs, memory.rank, memory.signals.dispatch_arrived, status, timeout_ns)
        self.wait_constants = dict(NUM_RANKS=memory.num_ranks, GPU=GPU_KERNELS)

    def mark(self) -> Any:
        """The point of the current stream just before the senders' launch (for ``receive``)."""
        return self.streams.mark()

    def receive(self, start: Any, senders: int, ranges: list[tuple[int, int]],
                outputs: list[tuple[int, torch.Tensor]]) -> None:
        """After the launch of ``senders`` sender programs (``start``: what ``mark`` returned
        before it): count them, owe the sources this call's release, and receive on the side
        stream, which the current stream then joins. ``ranges``: the handle's
        ``staged_ranges``; ``outputs``: each region to copy as ``(its staging offset in bytes,
        its output)``, the rows first (``StagingLayout.dispatch``). Nothing to receive, nothing
        to wait for: a later wait's count covers this call's senders too."""
        state = self.state
        state.dispatch_arrived += senders
        state.dispatch_release_due += RECEIVERS
        if not ranges:
            return
        arrived = state.dispatch_arrived
        self.streams.fork([self._driver_job(ranges, arrived, outputs) if self.driver is not None else
                           self._torch_job(ranges, arrived, outputs)], after=start)
        self.streams.join()

    def _wait(self, arrived: int) -> None:
        peer_base_ptrs, rank, first_word, status, timeout_ns = self.wait_args
        _WAIT(1, self.owner, (peer_base_ptrs, rank, first_word, arrived, status, timeout_ns), self.wait_constants, 1)

    def _driver_job(self, ranges: list[tuple[int, int]], arrived: int,
                    outputs: list[tuple[int, torch.Tensor]]) -> Callable[[], None]:
        """Each region's ranges as ``cuMemcpyDtoDAsync``."""
        driver, local = self.driver, self.memory.local.data_ptr()
        regions = [(local + offset, out.data_ptr(), out.stride(0) * out.element_size()) for offset, out in outputs]

        def job() -> None:
            self._wait(arrived)
            stream = current_stream()
            for src, dst, row_bytes in regions:
                for first, rows in ranges:
                    driver_result(driver.cuMemcpyDtoDAsync(dst + first * row_bytes, src + first * row_bytes,
                                                           rows * row_bytes, stream), "dispatch's row copy")
        return job

    def _torch_job(self, ranges: list[tuple[int, int]], arrived: int,
                   outputs: list[tuple[int, torch.Tensor]]) -> Callable[[], None]:
        """Each region's ranges as torch's ``copy_``."""
        local = self.memory.local
        regions = [(offset, out.view(torch.uint8).view(-1), out.stride(0) * out.element_size())
                   for offset, out in outputs]

        def job() -> None:
            self._wait(arrived)
            for offset, out_bytes, row_bytes in regions:
                for first, rows in ranges:
                    out_bytes.narrow(0, first * row_bytes, rows * row_bytes).copy_(
                        local.narrow(0, offset + first * row_bytes, rows * row_bytes), non_blocking=True)
        return job
