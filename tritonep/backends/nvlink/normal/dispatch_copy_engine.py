"""Normal-mode cached dispatch with the copy engines receiving (``Tuning.copy_engine_dispatch``).

In a dispatch every row lands in the receiver's staging at the row index it has in the
receiver's outputs, and the rows from source s fill one contiguous block there, after the
rows from lower sources; each small field (fp8 scales, top-k ids and weights) has a staging
region of its own laid out the same way. Receiving is then a local copy of each source's
block per region, which SM programs do at ~25 GB/s each while a copy engine does ~1.9 TB/s
(4 x H200). So when the host knows the counts (a cached dispatch whose handle read them back),
the dispatch launches only senders (``dispatch_kernel``'s ``COPY_RECEIVE``: all num_sms
programs send, then copy our own rows), and a side stream receives, for each source with rows
for us, in rotated order:

* wait until the source's sender programs have all counted themselves in our
  ``dispatch_arrived`` word for it (the cumulative senders of every copy-engine dispatch so
  far: the same on every rank, since every rank makes the same calls with the same num_sms);
* copy the block of rows, then the block of each small field the call returns, from staging
  into the outputs (a cached dispatch returns no source indices: the handle has them);

then it releases the staging to every source, rows or none: it sets our word in each source's
``dispatch_done`` array to the receivers this rank has counted so far
(``NormalState.dispatch_released``, this call's one included). Only this rank writes that word,
and every earlier call's releases of it finished before this call's side work began (it starts
after the caller's earlier work), so a plain store of the running count is what the senders'
waits expect. (Not source by source as its block is copied: a later dispatch with another
handle may put that source's rows where another source's block still waits to be copied.)

A wait is a one-program kernel (``arrival_wait_kernel``) on the side stream, which times out
into the status word like every wait on a peer. A driver stream wait (``cuStreamWaitValue64``)
would cost the host less, but it has no time-out: a peer that never sends would hang the stream
instead of raising. With cuda-bindings (``driver``) a copy is ``cuMemcpyDtoDAsync`` and the
release a ``cuStreamWriteValue64`` into the peer's signal word (the driver fences the copies
before the write); otherwise torch's ``copy_`` and the one-program signal kernel of the
combine's copy-engine path.

A repeat of such a call with one handle takes the cached dispatch's replay (``replay.py``),
which launches the senders and forks this same side work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton.language as tl

from tritonep.backends.nvlink.memory import SymmetricBuffer
from tritonep.backends.nvlink.normal.combine_copy_engine import set_peer_word
from tritonep.device.signals import wait_at_least
from tritonep.device.status_codes import PHASE_DISPATCH_DATA
from tritonep.runtime import kernel_names
from tritonep.runtime.launcher import FastLauncher, current_stream
from tritonep.runtime.platform import GPU_KERNELS
from tritonep.runtime.side_streams import PeerStreams, driver_result


@kernel_names.jit("tritonep::intranode::arrival_wait",
                  do_not_specialize=["word", "target", "source"])
def arrival_wait_kernel(peer_base_ptrs, rank, word, target, status_ptr, timeout_ns, source, GPU: tl.constexpr):
    """Hold the stream until this rank's signal word ``word`` reaches ``target`` (or the wait
    times out into the status word, naming ``source``)."""
    my_signals = tl.load(peer_base_ptrs + rank).to(tl.pointer_type(tl.int64))
    wait_at_least(my_signals + word, target.to(tl.int64), status_ptr, timeout_ns, PHASE_DISPATCH_DATA, source, GPU)


# Per launch only these change; the rest is fixed per engine (the caller's ``owner``).
_WAIT = FastLauncher(arrival_wait_kernel, changing=("word", "target", "source"))

# The receivers a copy-engine dispatch counts per source (one release each).
RECEIVERS = 1


class DispatchCopier:
    """The copy-engine receive of a cached dispatch, for one engine and tuning: every source's
    blocks, then every source's release, on one side stream of ``streams``, which the caller
    joins. The general path and the cached dispatch's replay (``replay.py``) both call it.

    ``driver``: cuda-bindings' driver module, or None for torch's copies and the signal kernel.
    ``owner``: a key that stands for ``memory``, its signal layout and ``status_args`` in the
    launches' setup keys (the engine's launch generation). ``status_args``: the status word's
    tensor and the time-out, for the wait kernel."""

    __slots__ = ("memory", "streams", "driver", "owner", "wait_args", "arrived_word", "done_word", "sources",
                 "release_addresses")

    def __init__(self, memory: SymmetricBuffer, streams: PeerStreams, driver: Any, owner: object,
                 status_args: tuple[torch.Tensor, int]) -> None:
        self.memory, self.streams, self.driver, self.owner = memory, streams, driver, owner
        rank, num_ranks = memory.rank, memory.num_ranks
        self.wait_args = (memory.peer_base_ptrs, rank, *status_args)
        self.arrived_word, self.done_word = memory.signals.dispatch_arrived, memory.signals.dispatch_done + rank
        self.sources = [(rank + step) % num_ranks for step in range(1, num_ranks)]
        # Our done word in each source's signal area, as mapped here (the driver's releases).
        self.release_addresses = [memory.peers[source].data_ptr() + 8 * self.done_word for source in self.sources] \
            if driver is not None else []

    def fork(self, after: Any, copies: list[tuple[int, int, int, int]], arrived: int, released: int,
             outputs: list[tuple[int, torch.Tensor]]) -> None:
        """Start the receive of a dispatch whose senders were launched after the point ``after``
        of the current stream (``PeerStreams.mark``). ``copies`` from
        ``combine_copy_engine.combine_copies`` (the rows a combine returns to a peer are the rows
        it sent here: ``(source, first row, rows, ...)``, the same block in staging and
        outputs); ``arrived`` the arrived count the sources reach with this call; ``released``
        the receivers this rank has counted with this call (``NormalState.dispatch_released``);
        ``outputs`` each region to copy as ``(its staging offset in bytes, its output)``, the
        rows first (``StagingLayout.dispatch``)."""
        self.streams.fork([self._driver_job(copies, arrived, released, outputs) if self.driver is not None else
                           self._torch_job(copies, arrived, released, outputs)], after=after)

    def _wait(self, source: int, arrived: int) -> None:
        peer_base_ptrs, rank, status, timeout_ns = self.wait_args
        _WAIT(1, self.owner, (peer_base_ptrs, rank, self.arrived_word + source, arrived, status, timeout_ns, source),
              dict(GPU=GPU_KERNELS), 1)

    def _driver_job(self, copies: list[tuple[int, int, int, int]], arrived: int, released: int,
                    outputs: list[tuple[int, torch.Tensor]]) -> Callable[[], None]:
        """Each region's block as ``cuMemcpyDtoDAsync``, each release a ``cuStreamWriteValue64``
        into the source's word (the driver fences the copies before it)."""
        driver, local = self.driver, self.memory.local.data_ptr()
        regions = [(local + offset, out.data_ptr(), out.stride(0) * out.element_size()) for offset, out in outputs]

        def job() -> None:
            stream = current_stream()
            for source, first, rows, _ in copies:
                self._wait(source, arrived)
                for src, dst, row_bytes in regions:
                    driver_result(driver.cuMemcpyDtoDAsync(dst + first * row_bytes, src + first * row_bytes,
                                                           rows * row_bytes, stream), "dispatch's row copy")
            for address in self.release_addresses:
                driver_result(driver.cuStreamWriteValue64(stream, address, released, 0), "dispatch's staging release")
        return job

    def _torch_job(self, copies: list[tuple[int, int, int, int]], arrived: int, released: int,
                   outputs: list[tuple[int, torch.Tensor]]) -> Callable[[], None]:
        """Each region's block as torch's ``copy_``, each release the one-program signal kernel."""
        local, peer_base_ptrs = self.memory.local, self.memory.peer_base_ptrs
        regions = [(offset, out.view(torch.uint8).view(-1), out.stride(0) * out.element_size())
                   for offset, out in outputs]

        def job() -> None:
            for source, first, rows, _ in copies:
                self._wait(source, arrived)
                for offset, out_bytes, row_bytes in regions:
                    out_bytes.narrow(0, first * row_bytes, rows * row_bytes).copy_(
                        local.narrow(0, offset + first * row_bytes, rows * row_bytes), non_blocking=True)
            for source in self.sources:
                set_peer_word(self.owner, peer_base_ptrs, source, self.done_word, released)
        return job
