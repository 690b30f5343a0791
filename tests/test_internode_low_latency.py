"""Low latency across nodes == the CPU backend, on groups split into simulated nodes.

The internode Buffer in low-latency mode runs the NVLink backend's low-latency engine and
kernels over its heap, every row stored straight into the expert's rank through the
plain-stores transport. The cases of ``low_latency_cases`` (fresh calls, hooks, zero-copy,
``out``, several calls, masks, two micro-batches, CUDA-graph capture, a stalled peer) run with
``TRITONEP_GPUS_PER_NODE`` set in the ranks, so their Buffers are the internode backend's and
the CPU backend's on the same split:

* ``interpreter``: 4 CPU ranks as 2 nodes of 2, under Triton's interpreter;
* ``gpu``: the machine's ranks split into nodes of half of them (``TRITONEP_GPU_RANKS=4`` on one
  GPU: ranks share it, plain stores through CUDA IPC; with one GPU per rank, plain stores
  through torch symmetric memory, ``TRITONEP_TRANSPORT=stores``).
"""

from __future__ import annotations

import os

import low_latency_cases as cases
import pytest
from low_latency_cases import SCHEDULES, LowLatencyCase, symmetric_masks

from tritonep.core.topology import GPUS_PER_NODE_VARIABLE
from tritonep.rank_pool import RankPool


def on_nodes(group, ranks_per_node: int, function_name: str, *args) -> tuple[object, list[str]]:
    """On every rank: ``low_latency_cases.<function_name>(group, *args)`` with the group split
    into nodes of ``ranks_per_node``; returns its result and the backends of the Buffers it
    kept. The pool is this module's: the setting stays for its later calls."""
    os.environ[GPUS_PER_NODE_VARIABLE] = str(ranks_per_node)
    os.environ["TRITONEP_TRANSPORT"] = "stores"
    result = getattr(cases, function_name)(group, *args)
    backends = sorted({type(buffer.backend).__name__ for key, buffer in cases._state.items()
                       if key.endswith(" nvlink")})
    return result, backends


def _run(pool: RankPool, ranks_per_node: int, function_name: str, *args) -> list:
    outcomes = pool.run(on_nodes, ranks_per_node, function_name, *args)
    for _, backends in outcomes:   # stalled_peer_error keeps no Buffer
        assert backends == (["InternodeBackend"] if function_name != "stalled_peer_error" else []), backends
    return [result for result, _ in outcomes]


def _check(pool: RankPool, case: LowLatencyCase, ranks_per_node: int = 2) -> None:
    problems = _run(pool, ranks_per_node, "compare_low_latency", case)
    assert all(not p for p in problems), f"{case}: {problems}"


NO_MASKS = ((),) * 4
INTERPRETER_CASES = [
    LowLatencyCase(seed=1, tokens=(6, 4, 6, 3), T=6, hidden=256, num_experts=8, num_topk=3, calls=2),
    LowLatencyCase(seed=2, tokens=(5, 0, 4, 5), T=5, hidden=256, num_experts=8, num_topk=4, use_fp8=False,
                   hook=True, zero_copy=True, use_out=True),
    LowLatencyCase(seed=3, tokens=(4, 4, 3, 4), T=4, hidden=512, num_experts=4, num_topk=2, round_scale=True,
                   use_ue8m0=True, routing="skewed"),
    # Shrink mode: rank 3 (node 1) dropped in the second round, another rank's mask changed
    # between a dispatch and its combine in the third.
    LowLatencyCase(seed=4, tokens=(4, 3, 4, 2), T=4, hidden=256, num_experts=8, num_topk=3, hook=True, calls=3,
                   masks=(NO_MASKS, symmetric_masks(4, (3,)), NO_MASKS),
                   combine_masks=(None, None, symmetric_masks(4, (0,)))),
]


@pytest.mark.parametrize("case", INTERPRETER_CASES, ids=lambda c: f"seed{c.seed}")
def test_interpreter_two_nodes_of_two(interpreter_pools, case: LowLatencyCase) -> None:
    _check(interpreter_pools(4), case)


def test_interpreter_two_micro_batches(interpreter_pools) -> None:
    case = LowLatencyCase(seed=5, tokens=(4, 3, 4, 4), T=4, hidden=256, num_experts=8, num_topk=3)
    problems = _run(interpreter_pools(4), 2, "two_micro_batches", case, "interleaved")
    assert all(not p for p in problems), problems


# ---------------------------------------------------------------------------------- GPUs
def _tokens(pool: RankPool, T: int, count: int) -> tuple[int, ...]:
    return (count,) * pool.num_ranks


def _split(pool: RankPool) -> int:
    assert pool.num_ranks % 2 == 0, "the GPU tests split the ranks into two nodes"
    return pool.num_ranks // 2


@pytest.mark.gpu(min_gpus=1)
@pytest.mark.parametrize("options", [dict(), dict(use_fp8=False, hook=True), dict(zero_copy=True, use_out=True),
                                     dict(round_scale=True, use_ue8m0=True, calls=3)], ids=str)
def test_gpu_decode_shape(gpu_pool, options: dict) -> None:
    """DeepEP's decode shape (T=128, hidden 7168, top-8) on two simulated nodes."""
    R = gpu_pool.num_ranks
    _check(gpu_pool, LowLatencyCase(seed=31, tokens=_tokens(gpu_pool, 128, 120), T=128, hidden=7168,
                                    num_experts=8 * R, num_topk=8, **options), _split(gpu_pool))


@pytest.mark.gpu(min_gpus=1)
def test_gpu_masks(gpu_pool) -> None:
    R = gpu_pool.num_ranks
    none = ((),) * R
    _check(gpu_pool, LowLatencyCase(seed=32, tokens=_tokens(gpu_pool, 128, 100), T=128, hidden=7168,
                                    num_experts=8 * R, num_topk=8, hook=True, calls=3,
                                    masks=(none, symmetric_masks(R, (R - 1,)), none),
                                    combine_masks=(None, None, symmetric_masks(R, (0,)))), _split(gpu_pool))


@pytest.mark.gpu(min_gpus=1)
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_gpu_two_micro_batches(gpu_pool, schedule: str) -> None:
    R = gpu_pool.num_ranks
    case = LowLatencyCase(seed=33, tokens=_tokens(gpu_pool, 128, 128), T=128, hidden=7168, num_experts=8 * R,
                          num_topk=8)
    problems = _run(gpu_pool, _split(gpu_pool), "two_micro_batches", case, schedule)
    assert all(not p for p in problems), problems


@pytest.mark.gpu(min_gpus=1)
@pytest.mark.parametrize("masked", [False, True])
def test_gpu_cuda_graph_replay(gpu_pool, masked: bool) -> None:
    problems = _run(gpu_pool, _split(gpu_pool), "graph_replay", 34, 3, masked)
    assert all(not p for p in problems), problems


@pytest.mark.gpu(min_gpus=1)
def test_gpu_race_loop(gpu_pool) -> None:
    """30 random cases back to back (sizes, options, hooks) across the node split."""
    import random

    rng = random.Random(7)
    R = gpu_pool.num_ranks
    for i in range(30):
        T = rng.choice([1, 16, 128])
        use_fp8 = rng.random() < 0.6
        case = LowLatencyCase(
            seed=600 + i, tokens=tuple(rng.randint(0, T) for _ in range(R)), T=T, hidden=rng.choice([2048, 7168]),
            num_experts=R * rng.choice([4, 36]), num_topk=rng.choice([1, 8]), use_fp8=use_fp8,
            round_scale=use_fp8 and rng.random() < 0.5, hook=rng.random() < 0.5, zero_copy=rng.random() < 0.3,
            routing=rng.choice(["random", "skewed", "one_expert"]), calls=2)
        _check(gpu_pool, case, _split(gpu_pool))


@pytest.mark.gpu(min_gpus=1)
def test_gpu_stalled_peer_names_rank_and_phase(gpu_pool) -> None:
    messages = _run(gpu_pool, _split(gpu_pool), "stalled_peer_error")
    assert "rank 0 (node 0)" in messages[0] and "waiting for rank" in messages[0], messages[0]
    assert all(m == "" for m in messages[1:]), messages
