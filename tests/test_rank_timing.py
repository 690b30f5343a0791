"""rank_timing: kernels counted as built or loaded from Triton's cache, pool runs timed per test."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist
from rank_timing import TESTS, CompileClock, TimedPool, current_test, summary_lines

from tritonep.rank_pool import RankPool


def test_the_clock_tells_cache_hits_from_compiles_and_gives_the_listener_back() -> None:
    """Triton calls the cache hook, then its compilation listener (at the end of compile, with
    ``cache_hit``), then the post-compile hook; the clock splits the time at the listener."""
    from triton import knobs

    heard: list[bool] = []
    saved = knobs.compilation.listener
    try:
        knobs.compilation.listener = lambda **kwargs: heard.append(kwargs["cache_hit"])
        earlier = knobs.compilation.listener
        with CompileClock() as clock:
            for hit in (True, False, True):
                knobs.runtime.jit_cache_hook()
                knobs.compilation.listener(cache_hit=hit)
                knobs.runtime.jit_post_compile_hook()
        assert (clock.count, clock.cached, clock.built) == (3, 2, 1)
        assert clock.seconds >= clock.cached_seconds + clock.built_seconds
        assert heard == [True, False, True], "the listener found in place must still hear every compile"
        assert knobs.compilation.listener is earlier
    finally:
        knobs.compilation.listener = saved


def _rank_and_maybe_exit(group: dist.ProcessGroup, leaving: int) -> int:
    if group.rank() == leaving:
        os._exit(0)
    return group.rank() * 10


def test_a_timed_pool_returns_the_results_and_keeps_the_runs_of_the_test() -> None:
    test = current_test()
    TESTS.pop(test, None)
    with RankPool(2, timeout=120) as pool:
        timed = TimedPool(pool)
        assert timed.num_ranks == 2
        assert timed.run(_rank_and_maybe_exit, -1) == [0, 10]
        assert timed.run(_rank_and_maybe_exit, 1, may_exit={1}) == [0, None]
    times = TESTS[test]
    assert times.runs == 2 and times.functions == {"_rank_and_maybe_exit"}
    assert times.slowest["wall"] >= 0 and times.slowest["compiles"] == 0
    assert any(line.endswith(f"{test} (_rank_and_maybe_exit)") for line in summary_lines())


def test_a_rank_failure_comes_back_under_the_function_name() -> None:
    from tritonep.rank_pool import RankFailure

    with RankPool(2, timeout=120) as pool, pytest.raises(RankFailure, match="ZeroDivisionError"):
        TimedPool(pool).run(_divide_by_rank)


def _divide_by_rank(group: dist.ProcessGroup) -> float:
    return 1 / group.rank()
