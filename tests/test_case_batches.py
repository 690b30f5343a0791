"""case_batches: the oracle a case ahead in a thread of its own, verdicts by case and rank."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist
from case_batches import check_batch, oracle_group, run_batch

from tritonep.rank_pool import RankFailure, RankPool


def _sums(group: dist.ProcessGroup, cases: list[int], failing: tuple[int, int] | None = None,
          raising: int | None = None, compare_raising: dict[int, int] | None = None
          ) -> tuple[list[list[str]], list[dict]]:
    """Case c: the oracle sums c + rank over the ranks (a collective on the oracle's group, in
    its thread); the comparison checks it on the caller's thread. ``failing`` = (case, rank):
    that rank reports a mismatch there; ``raising``: the oracle raises at that case;
    ``compare_raising``: rank -> the case whose comparison raises on it."""
    caller = threading.get_ident()

    def oracle(case: int) -> tuple[int, int]:
        if case == raising:
            raise ValueError("planted oracle failure")
        value = torch.tensor([case + group.rank()])
        dist.all_reduce(value, group=oracle_group(group))
        return int(value), threading.get_ident()

    def compare(case: int, result: tuple[int, int]) -> list[str]:
        total, thread = result
        expected = case * group.size() + sum(range(group.size()))
        problems = [f"sum {total}, expected {expected}"] if total != expected else []
        problems += ["the oracle ran on the caller's thread"] if thread == caller else []
        if (compare_raising or {}).get(group.rank()) == case:
            raise ValueError("planted comparison failure")
        return problems + (["planted mismatch"] if (case, group.rank()) == failing else [])

    return run_batch(group, cases, oracle, compare)


@pytest.fixture(scope="module")
def pool():
    with RankPool(3, timeout=120, failure_grace=30) as ranks:
        yield ranks


def test_each_case_compared_with_its_oracle(pool: RankPool) -> None:
    check_batch(pool, _sums, list(range(6)))
    problems_and_times = pool.run(_sums, [3, 1])
    assert all(problems == [[], []] for problems, _ in problems_and_times)
    assert all(set(times[0]) >= {"oracle", "waited", "gpu"} for _, times in problems_and_times)


def test_a_mismatch_names_the_case_and_the_rank(pool: RankPool) -> None:
    with pytest.raises(AssertionError, match="(?s)^4 on rank 2: \\['planted mismatch'\\]$"):
        check_batch(pool, _sums, list(range(6)), (4, 2))


def test_an_oracle_failure_names_the_case(pool: RankPool) -> None:
    with pytest.raises(RankFailure, match="3, oracle: ValueError: planted oracle failure"):
        pool.run(_sums, list(range(6)), None, 3)
    check_batch(pool, _sums, list(range(4)))   # in step afterwards


def test_a_failed_case_stops_the_oracles_and_the_pool_starts_afresh(pool: RankPool) -> None:
    """Rank 0's comparison fails at case 0: its oracle thread stops after case 1. The others
    fail at case 1 (as ranks waiting for a failed peer do), their oracle threads already in
    case 2's collective, which rank 0 never joins: they report, and the pool replaces the
    ranks, so the next batch runs on a fresh group instead of meeting the stuck collective."""
    start = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        pool.run(_sums, list(range(6)), None, None, {0: 0, 1: 1, 2: 1})
    assert time.monotonic() - start < 25
    message = str(failure.value)
    for rank, case in ((0, 0), (1, 1), (2, 1)):
        assert f"--- rank {rank} ---\nRuntimeError: {case}: ValueError: planted comparison failure" in message, message
    assert not pool.running
    check_batch(pool, _sums, list(range(4)))


def test_a_hook_installed_during_a_batch_outlives_it() -> None:
    """The compile clock gives back Triton's hooks as it found them, except where a hook was
    chained onto its own meanwhile (NVSHMEM kernels wrapped on their first launch): that chain
    stays, so later batches still run torch's NVSHMEM set-up for the modules they compile."""
    from rank_timing import CompileClock
    from triton import knobs

    calls: list[str] = []
    saved = knobs.runtime.jit_post_compile_hook
    try:
        knobs.runtime.jit_post_compile_hook = lambda **kwargs: calls.append("earlier")
        with CompileClock() as clock:
            clock_hook = knobs.runtime.jit_post_compile_hook

            def setup(**kwargs):   # as device/nvshmem.py chains torch's set-up onto the hook it finds
                calls.append("set-up")
                return clock_hook(**kwargs)

            knobs.runtime.jit_post_compile_hook = setup
            knobs.runtime.jit_post_compile_hook()
        assert knobs.runtime.jit_post_compile_hook is setup
        assert clock.count == 1 and calls == ["set-up", "earlier"]
        knobs.runtime.jit_post_compile_hook()   # after the batch: passed on, not counted
        assert clock.count == 1 and calls == ["set-up", "earlier"] * 2

        knobs.runtime.jit_post_compile_hook = earlier = saved
        with CompileClock():
            pass
        assert knobs.runtime.jit_post_compile_hook is earlier
    finally:
        knobs.runtime.jit_post_compile_hook = saved
