"""Low-latency mode of the NVLink backend == the CPU backend, on the same inputs.

Interpreter cases (CI): the Triton kernels in Triton's interpreter on CPU ranks sharing
/dev/shm "symmetric memory". GPU cases (marked ``gpu``, run by scripts/gpu_check.sh): the
benchmark's sizes, every option, a race loop, a CUDA-graph replay and a stalled peer.
"""

from __future__ import annotations

import random

import pytest
import torch
from low_latency_cases import (
    LowLatencyCase,
    compare_low_latency,
    graph_replay,
    stalled_peer_error,
)
from torch_defaults import pool_options

from tritonep.launch import RankPool


def _check(pool: RankPool, case: LowLatencyCase) -> None:
    problems = pool.run(compare_low_latency, case)
    assert all(not p for p in problems), f"{case}: {problems}"


INTERPRETER_CASES = [
    LowLatencyCase(seed=1, tokens=(8, 5), T=8, hidden=256, num_experts=8, num_topk=3, use_fp8=False),
    LowLatencyCase(seed=2, tokens=(8, 8), T=8, hidden=256, num_experts=8, num_topk=3, calls=3),
    LowLatencyCase(seed=3, tokens=(6, 8), T=8, hidden=512, num_experts=8, num_topk=2, round_scale=True,
                   use_ue8m0=True, hook=True),
    LowLatencyCase(seed=4, tokens=(3, 0), T=4, hidden=128, num_experts=4, num_topk=4, round_scale=True,
                   zero_copy=True, use_out=True, routing="skewed"),
    LowLatencyCase(seed=5, tokens=(7, 7), T=7, hidden=256, num_experts=8, num_topk=2, use_fp8=False,
                   routing="one_expert", hook=True, calls=2),
    LowLatencyCase(seed=6, tokens=(4, 4), T=4, hidden=128, num_experts=4, num_topk=2, routing="none"),
    LowLatencyCase(seed=7, tokens=(5, 2, 6), T=6, hidden=256, num_experts=6, num_topk=3, calls=2),
    LowLatencyCase(seed=8, tokens=(4, 4, 0), T=4, hidden=128, num_experts=12, num_topk=11, use_fp8=False, hook=True),
]


@pytest.mark.parametrize("case", INTERPRETER_CASES, ids=lambda c: f"seed{c.seed}-r{len(c.tokens)}")
def test_interpreter_matches_cpu_backend(interpreter_pools, case: LowLatencyCase) -> None:
    _check(interpreter_pools(len(case.tokens)), case)


def second_pending_send_error(group) -> str:
    """A send awaits its hook; a second send of the same kind raises InputError (the NVLink path
    allows one pending hook per kind for now), and running a hook twice raises too."""
    from low_latency_cases import buffers

    import tritonep as deep_ep

    T, hidden, num_experts = 4, 128, 2 * group.size()
    nvlink, _ = buffers(group, deep_ep.Buffer.get_low_latency_rdma_size_hint(T, hidden, group.size(), num_experts))
    x = torch.randn(T, hidden, device=nvlink.device, dtype=torch.float32).to(torch.bfloat16)
    topk_idx = torch.zeros(T, 1, dtype=torch.int64, device=nvlink.device)
    hook = nvlink.low_latency_dispatch(x, topk_idx, T, num_experts, return_recv_hook=True)[4]
    message = ""
    try:
        nvlink.low_latency_dispatch(x, topk_idx, T, num_experts, return_recv_hook=True)
    except deep_ep.InputError as error:
        message = str(error)
    hook()
    try:
        hook()
    except deep_ep.InputError as error:
        message += " | " + str(error)
    return message


def test_interpreter_second_pending_send_raises(interpreter_pools) -> None:
    messages = interpreter_pools(2).run(second_pending_send_error)
    assert all("one pending receive hook" in m and "already called" in m for m in messages), messages


# ------------------------------------------------------------------------------- GPU
@pytest.fixture(scope="module")
def gpu_pool():
    pool = RankPool(torch.cuda.device_count(), use_gpu=True, timeout=600, **pool_options(use_gpu=True))
    yield pool
    pool.close()


def _tokens(pool: RankPool, first: int, others: int) -> tuple[int, ...]:
    return (first,) + (others,) * (pool.num_ranks - 1)


@pytest.mark.gpu
@pytest.mark.parametrize("use_fp8,round_scale,use_ue8m0", [(True, False, False), (True, True, False),
                                                           (True, True, True), (False, False, False)])
@pytest.mark.parametrize("hook", [False, True])
def test_gpu_benchmark_shape(gpu_pool, use_fp8: bool, round_scale: bool, use_ue8m0: bool, hook: bool) -> None:
    """DeepEP's low-latency problem: 128 tokens, hidden 7168, top-8 of 288 experts."""
    _check(gpu_pool, LowLatencyCase(seed=21, tokens=_tokens(gpu_pool, 128, 128), T=128, hidden=7168,
                                    num_experts=288, num_topk=8, use_fp8=use_fp8, round_scale=round_scale,
                                    use_ue8m0=use_ue8m0, hook=hook, calls=2))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["zero_copy", "out", "fewer_tokens", "skewed", "one_expert", "none", "topk11"])
def test_gpu_variants(gpu_pool, variant: str) -> None:
    _check(gpu_pool, LowLatencyCase(
        seed=30, tokens=_tokens(gpu_pool, 100 if variant == "fewer_tokens" else 128, 0 if variant == "fewer_tokens"
                                else 128), T=128, hidden=4096, num_experts=gpu_pool.num_ranks * 18,
        num_topk=11 if variant == "topk11" else 8, zero_copy=variant == "zero_copy", use_out=variant == "out",
        routing=variant if variant in ("skewed", "one_expert", "none") else "random", calls=2))


@pytest.mark.gpu
def test_gpu_race_loop(gpu_pool) -> None:
    """40 random cases back to back (sizes, options, hooks) to shake out races between slots."""
    rng = random.Random(1)
    for i in range(40):
        T = rng.choice([1, 16, 128, 256])
        use_fp8 = rng.random() < 0.6
        case = LowLatencyCase(
            seed=500 + i, tokens=tuple(rng.randint(0, T) for _ in range(gpu_pool.num_ranks)), T=T,
            hidden=rng.choice([2048, 7168]), num_experts=gpu_pool.num_ranks * rng.choice([4, 36]),
            num_topk=rng.choice([1, 8]), use_fp8=use_fp8, round_scale=use_fp8 and rng.random() < 0.5,
            hook=rng.random() < 0.5, zero_copy=rng.random() < 0.3,
            routing=rng.choice(["random", "random", "skewed", "one_expert"]), calls=2)
        case.use_ue8m0 = case.round_scale and rng.random() < 0.5
        _check(gpu_pool, case)


@pytest.mark.gpu
def test_gpu_second_pending_send_raises(gpu_pool) -> None:
    messages = gpu_pool.run(second_pending_send_error)
    assert all("one pending receive hook" in m and "already called" in m for m in messages), messages


@pytest.mark.gpu
def test_gpu_cuda_graph_replay(gpu_pool) -> None:
    problems = gpu_pool.run(graph_replay, 13)
    assert all(not p for p in problems), problems


@pytest.mark.gpu
def test_gpu_stalled_peer_raises_with_rank_and_phase(gpu_pool) -> None:
    messages = gpu_pool.run(stalled_peer_error)
    assert "waiting for rows from the peer" in messages[0] and "waiting for rank 1" in messages[0], messages
