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
    from gpu_pools import failure_grace

    return failure_grace()


def _uses(session: pytest.Session, fixture: str) -> bool:
    return any(fixture in getattr(item, "fixturenames", ()) for item in session.items)


@pytest.fixture(scope="session")
def gpu_session_pool(request: pytest.FixtureRequest):
    """The GPU tests' RankPool, started once per session (``gpu_pool``). Beside it, spare cores
    compile the kernels the suite is listed to need (kernel_cache.py), and the internode tests'
    ranks start too when the session has such tests (``transport_session_pool``), so that
    their start-up overlaps the first tests."""
    from gpu_pools import ready_gpu_pool, start_gpu_pool
    from kernel_cache import KERNEL_LIST, WAIT_VARIABLE, warm_in_background

    ranks, cores = gpu_ranks(), len(os.sched_getaffinity(0))
    # Each rank keeps two threads busy (its GPU side, its oracle); the rest compile.
    warming = warm_in_background(KERNEL_LIST, min(32, cores - 2 * ranks), ranks)
    if warming is not None and os.environ.get(WAIT_VARIABLE) == "1":
        SESSION_NOTES.append(warming.wait())
    pool = start_gpu_pool(ranks)
    if _own_transport_ranks(ranks) and _uses(request.session, "transport_pool"):
        _STARTING["transport"] = start_gpu_pool(ranks)
    timed = ready_gpu_pool(pool, "the session's GPU ranks")
    yield timed
    pool.close()
    for unused in _STARTING.values():   # started for tests that then did not run
        unused.close(force=True)
    if warming is not None:
        SESSION_NOTES.append(warming.stop())


_STARTING: dict[str, RankPool] = {}   # pools started ahead of the fixture that hands them out


def _own_transport_ranks(ranks: int) -> bool:
    """Whether the internode tests get ranks apart from the session's: with one GPU per rank
    their heap is NVSHMEM's, and torch picks a process's symmetric-memory backend once, at its
    first allocation (the session's Buffers allocate through torch's CUDA backend). Ranks
    sharing GPUs use plain stores and torch's CUDA backend: the session's ranks serve."""
    return ranks <= torch.cuda.device_count()


@pytest.fixture(scope="module")
def gpu_pool(gpu_session_pool):
    """A RankPool of ``gpu_ranks()`` ranks on the GPUs (``TRITONEP_GPU_RANKS``, or one per GPU;
    ranks beyond the GPU count share them). One pool serves every module (starting the ranks,
    their CUDA contexts and NCCL takes seconds); each module finds the ranks as the first one did
    (rank_state.py). ``TRITONEP_TEST_KERNELS_OUT``: the ranks list the kernels they compile there
    (kernel_cache.py)."""
    from gpu_pools import prepare
    from rank_state import reset_ranks

    prepare(gpu_session_pool)   # again per module: a pool stopped after a failure started new ranks
    yield gpu_session_pool
    if gpu_session_pool.running:   # not stopped by a failure
        gpu_session_pool.run(reset_ranks)


@pytest.fixture(scope="session")
def transport_session_pool(gpu_session_pool):
    """The internode tests' GPU ranks (``_own_transport_ranks``), one pool for every internode
    module: NVSHMEM is initialised once, and the Buffers each module keeps stay for the session
    (NVSHMEM frees collectively, so nothing is freed behind a module's back; together they take
    about 3 GB of NVSHMEM's heap at 4 ranks, ``NVSHMEM_SYMMETRIC_SIZE``)."""
    from gpu_pools import ready_gpu_pool, start_gpu_pool

    if not _own_transport_ranks(gpu_session_pool.num_ranks):
        yield gpu_session_pool
        return
    pool = _STARTING.pop("transport", None) or start_gpu_pool(gpu_session_pool.num_ranks)
    yield ready_gpu_pool(pool, "the internode tests' GPU ranks")
    pool.close()


@pytest.fixture(scope="module")
def transport_pool(transport_session_pool, gpu_pool):
    """``transport_session_pool`` for a module: prepared again (a pool stopped after a failure
    started new ranks), its environment restored at the module's end."""
    from gpu_pools import prepare
    from rank_state import restore_environment

    if transport_session_pool is gpu_pool:
        yield gpu_pool
        return
    prepare(transport_session_pool)
    yield transport_session_pool
    if transport_session_pool.running:
        transport_session_pool.run(restore_environment)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int,
                            config: pytest.Config) -> None:
    """With ``--durations``: where the time of the batched cases went (case_batches.py)."""
    import case_batches
    import rank_timing

    if config.option.durations is None:
        return
    batches = case_batches.summary_lines()
    if batches or SESSION_NOTES:
        terminalreporter.section("batched cases: wall time, and per phase the slowest rank's sum over cases")
        for line in SESSION_NOTES + batches:
            terminalreporter.write_line(line)
    runs = rank_timing.summary_lines()
    if runs:
        terminalreporter.section("GPU pool runs per test: wall time, and in the slowest rank where the "
                                 "kernels' time went")
        for line in runs:
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
