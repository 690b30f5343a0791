"""RankPool: results come back by rank; failures and dead ranks raise RankFailure, never hang."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tritonep.rank_pool import RankFailure, RankPool


def _rank_sum(group: dist.ProcessGroup, offset: int) -> int:
    value = torch.tensor([group.rank() + offset])
    dist.all_reduce(value, group=group)
    return int(value)


def _fail_on_rank_one(group: dist.ProcessGroup) -> int:
    if group.rank() == 1:
        raise ValueError("planted failure")
    return group.rank()


def _exit_on_rank_one(group: dist.ProcessGroup) -> int:
    if group.rank() == 1:
        os._exit(3)
    return group.rank()


def test_results_by_rank_and_errors_carry_tracebacks() -> None:
    with RankPool(3, timeout=60) as pool:
        assert pool.run(_rank_sum, 10) == [33, 33, 33]
        with pytest.raises(RankFailure, match=r"(?s)rank 1 ---.*planted failure"):
            pool.run(_fail_on_rank_one)
        assert pool.run(_rank_sum, 0) == [3, 3, 3]   # the pool survives a Python error


def _fail_on_rank_one_while_others_wait(group: dist.ProcessGroup) -> int:
    """Rank 1 raises before a collective the others then wait in, for ever (gloo's own time-out
    is 30 minutes)."""
    if group.rank() == 1:
        raise ValueError("planted failure before the barrier")
    dist.barrier(group=group)
    return group.rank()


def test_a_failure_releases_the_ranks_left_waiting_for_it() -> None:
    """The others are stopped a grace period after rank 1's failure, not after the pool's
    time-out; the error carries rank 1's traceback and names the ranks stopped, and the next
    run gets a fresh group."""
    with RankPool(3, timeout=600, failure_grace=2) as pool:
        start = time.monotonic()
        with pytest.raises(RankFailure) as failure:
            pool.run(_fail_on_rank_one_while_others_wait)
        assert time.monotonic() - start < 60
        message = str(failure.value)
        assert "rank 1 ---" in message and "planted failure before the barrier" in message, message
        assert "rank(s) [0, 2] had not finished" in message, message
        assert not pool.running
        assert pool.run(_rank_sum, 0) == [3, 3, 3]
        assert pool.running


def _leave_on_rank_two(group: dist.ProcessGroup) -> int:
    from tritonep.rank_pool import leave_after_this_run

    if group.rank() == 2:
        leave_after_this_run()
    return group.rank()


def test_a_rank_that_cannot_go_on_gets_the_pool_replaced() -> None:
    with RankPool(3, timeout=120) as pool:
        assert pool.run(_leave_on_rank_two) == [0, 1, 2]   # its result still comes back
        assert not pool.running
        assert pool.run(_rank_sum, 0) == [3, 3, 3]


def _sleep_on_rank(group: dist.ProcessGroup, rank: int, seconds: float) -> int:
    if group.rank() == rank:
        time.sleep(seconds)
    return group.rank()


def test_a_hang_names_the_ranks_that_did_not_finish() -> None:
    with RankPool(3, timeout=120) as pool:
        pool.run(_rank_sum, 0)   # started (start-up counts against the first run's time-out)
        pool.timeout = 3
        with pytest.raises(RankFailure, match=r"rank\(s\) \[2\] did not finish _sleep_on_rank within 3 s"):
            pool.run(_sleep_on_rank, 2, 600)
        pool.timeout = 120
        assert pool.run(_rank_sum, 0) == [3, 3, 3]   # started afresh


def test_a_rank_that_dies_raises_instead_of_hanging() -> None:
    pool = RankPool(2, timeout=60)
    with pytest.raises(RankFailure, match="rank 1 exited"):
        pool.run(_exit_on_rank_one)


def _defaults(group: dist.ProcessGroup) -> tuple[torch.dtype, str]:
    return torch.get_default_dtype(), torch.get_default_device().type


def test_default_dtype_and_device_are_set_in_every_rank() -> None:
    with RankPool(2, timeout=60, default_dtype=torch.bfloat16, default_device="meta") as pool:
        assert pool.run(_defaults) == [(torch.bfloat16, "meta")] * 2
    with RankPool(1, timeout=60) as pool:
        assert pool.run(_defaults) == [(torch.float32, "cpu")]


def test_bad_default_dtype_is_refused_before_starting_ranks() -> None:
    with pytest.raises(ValueError, match="floating torch.dtype"):
        RankPool(2, default_dtype=torch.int32)


def test_test_pools_follow_the_environment() -> None:
    """tests/torch_defaults.py: TRITONEP_TEST_DEFAULT_DTYPE reaches the rank workers."""
    from torch_defaults import default_dtype, pool_options

    with RankPool(1, timeout=60, **pool_options()) as pool:
        assert pool.run(_defaults) == [(default_dtype() or torch.float32, "cpu")]
