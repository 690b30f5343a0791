"""Every name the benchmark takes from inside tritonep, in one place: when the package's
internals move, this module is the one to follow them. The rest of ``benchmarks`` uses
tritonep's public API only (``Buffer``, ``Config``, ``utils``).

* ``RankPool``: R rank processes in one process group (gloo on CPUs, NCCL with a GPU each).
* ``internode_rdma_bytes``: the internode backend's heap size for a normal-mode problem
  (``layout.heap_bytes_for``).
* The NVLink backend's ``Tuning`` (kernel shapes, the combine's path), reached through
  ``Buffer.backend.tuning`` and swapped on one Buffer for the shape sweep and the SM-only combine;
  ``copy_engine_receives``: whether its cached dispatch receives on the copy engines at R ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

from tritonep.backends.internode.layout import heap_bytes_for as internode_rdma_bytes
from tritonep.backends.nvlink.tuning import copy_engine_receives
from tritonep.rank_pool import RankPool

__all__ = ["RankPool", "changed_tuning", "copy_engine_receives", "internode_rdma_bytes"]


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
