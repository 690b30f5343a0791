"""RankPool: results come back by rank; failures and dead ranks raise RankFailure, never hang."""

from __future__ import annotations

import os

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
