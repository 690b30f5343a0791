"""Every name the benchmark takes from inside tritonep, in one place: when the package's
internals move, this module is the one to follow them. The rest of ``benchmarks`` uses
tritonep's public API only (``Buffer``, ``Config``, ``utils``).

* ``RankPool``: R rank processes in one process group (gloo on CPUs, NCCL with a GPU each).
* ``internode_rdma_bytes``: the internode backend's heap size for a normal-mode problem
  (``layout.heap_bytes_for``).
* The NVLink backend's ``Tuning`` (kernel shapes, the combine's path), reached through
  ``Buffer.backend.tuning`` and swapped on one Buffer for the shape sweep and the SM-only combine;
  ``copy_engine_receives``: whether its cached dispatch receives on the copy engines at R ranks.
* ``count_waits``: how long the NVLink backend's fresh dispatches wait for their count exchange
  (``CountExchange.result``, timed by wrapping it), so that a fresh row can tell the host's own
  work from its wait on the GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator

from tritonep.backends.internode.layout import heap_bytes_for as internode_rdma_bytes
from tritonep.backends.nvlink.normal.counts import CountExchange
from tritonep.backends.nvlink.tuning import copy_engine_receives
from tritonep.rank_pool import RankPool

__all__ = ["RankPool", "changed_tuning", "copy_engine_receives", "count_waits", "internode_rdma_bytes"]


@contextlib.contextmanager
def changed_tuning(buffer: object, **changes: object) -> Iterator[dict]:
    """Inside the block, ``buffer``'s NVLink backend runs with ``changes`` to its ``Tuning``
    (fields by name; none: the defaults). Yields the fields in effect."""
    backend = buffer.backend   # type: ignore[attr-defined]
    default = backend.tuning
    backend.tuning = dataclasses.replace(default, **changes)
    try:
        yield dataclasses.asdict(backend.tuning)
    finally:
        backend.tuning = default


@contextlib.contextmanager
def count_waits() -> Iterator[Callable[[], int]]:
    """Inside the block, the nanoseconds this process spends in the NVLink backend's read-backs of
    count exchanges (the poll for the mailbox's flag and the words' copy out) add up; yields a
    function that returns the running total."""
    read_back = CountExchange.result
    total = [0]

    def timed(self: CountExchange, *args: object, **kwargs: object) -> list[int]:
        begin = time.perf_counter_ns()
        try:
            return read_back(self, *args, **kwargs)
        finally:
            total[0] += time.perf_counter_ns() - begin

    CountExchange.result = timed   # type: ignore[method-assign]
    try:
        yield lambda: total[0]
    finally:
        CountExchange.result = read_back   # type: ignore[method-assign]
