"""Shared pytest set-up: GPU tests skip themselves without GPUs; tests of the kernels under
Triton's interpreter are marked ``interpreter`` and skip themselves under numpy >= 2.4 (tests
that build NVLink Buffers on the same CPU ranks but run no kernel there are not); hypothesis
has a CI profile.

Select a hypothesis profile with ``HYPOTHESIS_PROFILE`` (``ci`` by default, ``dev`` for a
longer local search).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import numpy
import pytest
import torch
from hypothesis import HealthCheck, settings

from tritonep.rank_pool import RankPool, gpu_ranks

# CI runs on 2 CPU cores: keep property tests modest, and no per-example deadline because a
# multi-process test's first example also pays for process start-up and warm caches.
settings.register_profile("ci", max_examples=25, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=200, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# Triton 3.6's interpreter turns 1-element arrays into ints with int(array), which numpy >= 2.4
# forbids, so kernels whose loops have runtime bounds fail under it (triton-lang/triton#9171,
# fixed upstream after 3.6). run_tests.sh runs these tests in an environment of their own.
NUMPY_VERSION = tuple(int(part) for part in numpy.__version__.split(".")[:2])
INTERPRETER_SKIP_REASON = (
    f"Triton 3.6's interpreter fails under numpy >= 2.4 (here numpy {numpy.__version__}; triton-lang/triton#9171): "
    "run these tests with numpy<2.4, as `bash scripts/run_tests.sh` does in its own environment, .venv-interpreter")


# tryfirst: the marks must be in place before pytest's -m selection looks at them.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "interpreter_pools" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.interpreter)
            if NUMPY_VERSION >= (2, 4):
                item.add_marker(pytest.mark.skip(reason=INTERPRETER_SKIP_REASON))

    # device_count() asks the driver without initialising CUDA, so this is safe in the parent
    # of spawned rank processes.
    # A test that sizes its group from the machine may say it runs on one GPU too:
    # @pytest.mark.gpu(min_gpus=1); the rest need two.
    num_gpus = gpu_ranks() if torch.cuda.device_count() else 0
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        min_gpus = marker.kwargs.get("min_gpus", 2)
        if num_gpus < min_gpus:
            item.add_marker(pytest.mark.skip(reason=f"marked gpu: needs >= {min_gpus} CUDA GPUs, this machine has "
                                                    f"{num_gpus}"))


SESSION_NOTES: list[str] = []   # lines for the terminal summary


def _failure_grace() -> float:
    """A rank that fails leaves its peers in its kernels' bounded waits (TRITONEP_TIMEOUT_S, 60 s
    by default) or in a collective: their errors, naming rank and phase, get that long to come
    back, then the pool starts afresh."""
    return float(os.environ.get("TRITONEP_TIMEOUT_S", 60)) + 10


@pytest.fixture(scope="session")
def gpu_session_pool():
    """The GPU tests' RankPool, started once per session (``gpu_pool``). Beside it, spare cores
    compile the kernels the suite is listed to need (kernel_cache.py)."""
    from kernel_cache import KERNEL_LIST, warm_in_background

    ranks, cores = gpu_ranks(), len(os.sched_getaffinity(0))
    # Each rank keeps two threads busy (its GPU side, its oracle); the rest compile.
    warming = warm_in_background(KERNEL_LIST, min(32, cores - 2 * ranks))
    pool = _gpu_rank_pool(ranks)
    yield pool
    pool.close()
    if warming is not None:
        SESSION_NOTES.append(warming.stop())


@pytest.fixture(scope="module")
def gpu_pool(gpu_session_pool):
    """A RankPool of ``gpu_ranks()`` ranks on the GPUs (``TRITONEP_GPU_RANKS``, or one per GPU;
    ranks beyond the GPU count share them). One pool serves every module (starting the ranks,
    their CUDA contexts and NCCL takes seconds); each module finds the ranks as the first one did
    (rank_state.py). ``TRITONEP_TEST_KERNELS_OUT``: the ranks list the kernels they compile there
    (kernel_cache.py)."""
    from rank_state import reset_ranks

    _prepare(gpu_session_pool)   # again per module: a pool stopped after a failure started new ranks
    yield gpu_session_pool
    if gpu_session_pool.running:   # not stopped by a failure
        gpu_session_pool.run(reset_ranks)


@pytest.fixture(scope="module")
def transport_pool(gpu_pool):
    """The internode tests' GPU ranks. With one GPU per rank their heap is NVSHMEM's, and torch
    picks a process's symmetric-memory backend once, at its first allocation: such a module gets
    ranks of its own, apart from the session's (whose Buffers allocate through torch's CUDA
    backend). Ranks sharing GPUs use plain stores and torch's CUDA backend: the session's ranks."""
    if gpu_pool.num_ranks > torch.cuda.device_count():
        yield gpu_pool
        return
    pool = _gpu_rank_pool(gpu_pool.num_ranks)
    _prepare(pool)
    yield pool
    pool.close()


# The GPU ranks' CPU tensors of 2 MiB and more on transparent huge pages (torch's CPU allocator
# reads the variable at its first allocation): the oracle's fresh tensors of rows, 100 MB and
# more at the race loops' sizes, then fault in 2 MiB at a time instead of 4 KiB, several times
# faster. Hosts whose huge pages are off ignore it.
GPU_RANK_ENV = {"THP_MEM_ALLOC_ENABLE": "1"}


def _gpu_rank_pool(ranks: int) -> RankPool:
    """``ranks`` GPU ranks under the suite's torch defaults (``TRITONEP_TEST_DEFAULT_*``)."""
    from torch_defaults import pool_options  # TRITONEP_TEST_DEFAULT_DTYPE / _DEVICE reruns

    return RankPool(ranks, use_gpu=True, timeout=600, failure_grace=_failure_grace(), env=GPU_RANK_ENV,
                    **pool_options(use_gpu=True))


def _prepare(pool: RankPool) -> None:
    """``rank_state.prepare_ranks`` on every rank: the host's cores shared out (two threads per
    rank are busy already), the compiled kernels listed where ``TRITONEP_TEST_KERNELS_OUT`` says."""
    from kernel_cache import OUT_VARIABLE
    from rank_state import prepare_ranks

    pool.run(prepare_ranks, max(1, len(os.sched_getaffinity(0)) // (2 * pool.num_ranks)), os.environ.get(OUT_VARIABLE))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int,
                            config: pytest.Config) -> None:
    """With ``--durations``: where the time of the batched cases went (case_batches.py)."""
    from case_batches import summary_lines

    lines = summary_lines()
    if (lines or SESSION_NOTES) and config.option.durations is not None:
        terminalreporter.section("batched cases: wall time, and per phase the slowest rank's sum over cases")
        for line in SESSION_NOTES + lines:
            terminalreporter.write_line(line)


@contextlib.contextmanager
def _interpreting_cpu_pools() -> Iterator[Callable[[int], RankPool]]:
    """``get(num_ranks)`` -> a RankPool of CPU ranks with ``TRITON_INTERPRET=1`` (inherited by
    the spawned ranks: the NVLink backend then takes CPU tensors), one per rank count."""
    from torch_defaults import pool_options  # TRITONEP_TEST_DEFAULT_DTYPE reruns (tests/torch_defaults.py)

    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    pools: dict[int, RankPool] = {}
    try:
        def get(num_ranks: int) -> RankPool:
            if num_ranks not in pools:
                pools[num_ranks] = RankPool(num_ranks, timeout=900, failure_grace=_failure_grace(),
                                            **pool_options())
            return pools[num_ranks]
        yield get
    finally:
        for pool in pools.values():
            pool.close()
        if previous is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = previous


@pytest.fixture(scope="module")
def interpreter_pools():
    """Pools of CPU ranks that run the NVLink kernels in Triton's interpreter
    (``_interpreting_cpu_pools``), for the module. Tests that use it are marked ``interpreter``
    and skip under numpy >= 2.4 (see pytest_collection_modifyitems)."""
    with _interpreting_cpu_pools() as get:
        yield get


@pytest.fixture(scope="module")
def nvlink_host_pools():
    """The same pools for tests of the NVLink backend's host side, which launch no kernel in
    the interpreter (Buffer options and set-up, launches recorded instead of run): numpy >= 2.4
    does not affect them, so they are not marked ``interpreter`` and run in the main run."""
    with _interpreting_cpu_pools() as get:
        yield get
