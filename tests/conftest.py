"""Shared pytest set-up: GPU tests skip themselves without GPUs; hypothesis has a CI profile.

Select a hypothesis profile with ``HYPOTHESIS_PROFILE`` (``ci`` by default, ``dev`` for a
longer local search).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# CI runs on 2 CPU cores: keep property tests modest, and no per-example deadline because a
# multi-process test's first example also pays for process start-up and warm caches.
settings.register_profile("ci", max_examples=25, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=200, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # device_count() asks the driver without initialising CUDA, so this is safe in the parent
    # of spawned rank processes.
    num_gpus = torch.cuda.device_count()
    if num_gpus >= 2:
        return
    skip = pytest.mark.skip(reason=f"marked gpu: needs >= 2 CUDA GPUs, this machine has {num_gpus}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def interpreter_pools():
    """``get(num_ranks)`` -> a RankPool of CPU ranks running Triton's interpreter
    (``TRITON_INTERPRET=1`` is inherited by the spawned ranks); pools live for the module."""
    from torch_defaults import pool_options  # TRITONEP_TEST_DEFAULT_DTYPE reruns (tests/torch_defaults.py)

    from tritonep.launch import RankPool

    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    pools: dict = {}
    try:
        def get(num_ranks: int) -> RankPool:
            if num_ranks not in pools:
                pools[num_ranks] = RankPool(num_ranks, timeout=900, **pool_options())
            return pools[num_ranks]
        yield get
    finally:
        for pool in pools.values():
            pool.close()
        if previous is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = previous
