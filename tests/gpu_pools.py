"""The GPU tests' rank pools: how they are started, prepared and timed.

Every GPU pool runs under the suite's torch defaults (``TRITONEP_TEST_DEFAULT_*``), is prepared
(``rank_state.prepare_ranks``: cores shared out, the kernels it compiles listed for the next
session's warming, ``kernel_cache.py``) and has its runs timed (``rank_timing.TimedPool``), so
that the GPU log says where each test's time went. conftest.py holds the session's pools; a
test that needs ranks of its own (one rank, or a rank that dies) takes ``own_gpu_pool``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from rank_timing import TimedPool, note_start

from tritonep.rank_pool import RankPool

# The GPU ranks' CPU tensors of 2 MiB and more on transparent huge pages (torch's CPU allocator
# reads the variable at its first allocation): the oracle's fresh tensors of rows, 100 MB and
# more at the race loops' sizes, then fault in 2 MiB at a time instead of 4 KiB, several times
# faster. Hosts whose huge pages are off ignore it.
GPU_RANK_ENV = {"THP_MEM_ALLOC_ENABLE": "1"}


def failure_grace() -> float:
    """A rank that fails leaves its peers in its kernels' bounded waits (TRITONEP_TIMEOUT_S, 60 s
    by default) or in a collective: their errors, naming rank and phase, get that long to come
    back, then the pool starts afresh."""
    return float(os.environ.get("TRITONEP_TIMEOUT_S", 60)) + 10


def start_gpu_pool(ranks: int) -> RankPool:
    """``ranks`` GPU ranks under the suite's torch defaults, starting: the processes, CUDA and
    their process group come up in the background until the first run waits for them."""
    from torch_defaults import pool_options  # TRITONEP_TEST_DEFAULT_DTYPE / _DEVICE reruns

    return RankPool(ranks, use_gpu=True, timeout=600, failure_grace=failure_grace(), env=GPU_RANK_ENV,
                    **pool_options(use_gpu=True))


def prepare(pool: RankPool | TimedPool) -> None:
    """``rank_state.prepare_ranks`` on every rank: the host's cores shared out (two threads per
    rank are busy already), the compiled kernels listed where ``TRITONEP_TEST_KERNELS_OUT`` says."""
    from kernel_cache import OUT_VARIABLE
    from rank_state import prepare_ranks

    pool.run(prepare_ranks, max(1, len(os.sched_getaffinity(0)) // (2 * pool.num_ranks)), os.environ.get(OUT_VARIABLE))


def ready_gpu_pool(pool: RankPool, what: str) -> TimedPool:
    """``pool`` once its ranks answer (the wait noted for the summary), prepared and timed."""
    from rank_state import answer

    note_start(what, pool, answer)
    timed = TimedPool(pool)
    prepare(timed)
    return timed


@contextlib.contextmanager
def own_gpu_pool(ranks: int, what: str) -> Iterator[TimedPool]:
    """A GPU pool for one test (or one module), apart from the session's. Closed by force at the
    end: such pools serve tests that leave a rank dead or stalled, whose peers could not leave
    their process group in order, and nothing else runs on them."""
    pool = start_gpu_pool(ranks)
    try:
        yield ready_gpu_pool(pool, what)
    finally:
        pool.close(force=True)
