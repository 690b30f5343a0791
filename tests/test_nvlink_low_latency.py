"""Low-latency mode of the NVLink backend == the CPU backend, on the same inputs.

Interpreter cases (CI): the Triton kernels in Triton's interpreter on CPU ranks sharing
/dev/shm "symmetric memory". GPU cases (marked ``gpu``, run by scripts/gpu_check.sh): the
benchmark's sizes, every option, a race loop, a CUDA-graph replay and a stalled peer.
"""

from __future__ import annotations

import random

import pytest
import torch
from case_batches import check_batch
from low_latency_cases import (
    SCHEDULES,
    LowLatencyCase,
    compare_low_latency,
    compare_low_latency_cases,
    graph_replay,
    rejoin_after_clean,
    release_buffers,
    stalled_peer_error,
    survivors_mask_dead_rank,
    symmetric_masks,
    two_micro_batches,
)
from torch_defaults import pool_options

from tritonep.rank_pool import RankPool, gpu_ranks


def _check(pool: RankPool, cases: LowLatencyCase | list[LowLatencyCase]) -> None:
    """Every case on the NVLink and the CPU backend, compared on the ranks: one pool run."""
    check_batch(pool, compare_low_latency_cases, cases if isinstance(cases, list) else [cases])


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


# Shrink mode. Masks are symmetric (see low_latency_cases). Per round, per rank: ranks masked.
NO_MASKS_2, NO_MASKS_3 = ((), ()), ((), (), ())
INTERPRETER_MASK_CASES = [
    # Rank 1 dropped in round 3 only; round 5 reuses round 3's slot, so each sender must wait
    # for the peer's "slot freed" of round 1 (the last use it wrote into), not of round 3.
    LowLatencyCase(seed=41, tokens=(8, 6), T=8, hidden=256, num_experts=8, num_topk=3, calls=6,
                   masks=(NO_MASKS_2, NO_MASKS_2, NO_MASKS_2, symmetric_masks(2, (1,)))),
    # Masks change after the send, before the hook and the combine: the dispatch keeps the
    # send's masks, the combine skips ranks masked at either time.
    LowLatencyCase(seed=42, tokens=(7, 8), T=8, hidden=256, num_experts=8, num_topk=4, use_fp8=False, hook=True,
                   calls=3, masks=(NO_MASKS_2, NO_MASKS_2, symmetric_masks(2, (0,))),
                   combine_masks=(None, symmetric_masks(2, (0,)), NO_MASKS_2)),
    LowLatencyCase(seed=43, tokens=(5, 6, 4), T=6, hidden=512, num_experts=6, num_topk=3, round_scale=True,
                   use_ue8m0=True, calls=4,
                   masks=(symmetric_masks(3, (2,)), symmetric_masks(3, (0,)), NO_MASKS_3, ((0,), (), ()))),
    LowLatencyCase(seed=44, tokens=(6, 3, 6), T=6, hidden=256, num_experts=6, num_topk=2, hook=True, zero_copy=True,
                   use_out=True, calls=2, masks=(symmetric_masks(3, (1,)), NO_MASKS_3),
                   combine_masks=(symmetric_masks(3, (1, 2)), symmetric_masks(3, (0,)))),
]


@pytest.mark.parametrize("case", INTERPRETER_MASK_CASES, ids=lambda c: f"seed{c.seed}-r{len(c.tokens)}")
def test_interpreter_masks_match_cpu_backend(interpreter_pools, case: LowLatencyCase) -> None:
    _check(interpreter_pools(len(case.tokens)), case)


def test_interpreter_masked_rank_that_makes_no_calls(interpreter_pools) -> None:
    """The last rank makes no NVLink calls (as if dead); the others mask it and must neither
    write to it nor wait for it, in dispatch, combine and clean_low_latency_buffer. Then all
    unmask and clean together, and a normal round works again."""
    pool = interpreter_pools(3)
    case = LowLatencyCase(seed=45, tokens=(6, 5, 6), T=6, hidden=256, num_experts=6, num_topk=3, calls=3,
                          masks=(symmetric_masks(3, (2,)),) * 3)
    problems = pool.run(compare_low_latency, case, 2)
    assert all(not p for p in problems), problems
    pool.run(clean_without, case, 2)
    problems = pool.run(rejoin_after_clean, case)
    assert all(not p for p in problems), problems


def clean_without(group, case: LowLatencyCase, idle_rank: int) -> None:
    """clean_low_latency_buffer on every rank but ``idle_rank``, which the others mask."""
    from low_latency_cases import buffers

    import tritonep as deep_ep

    if group.rank() != idle_rank:
        rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(case.T, case.hidden, group.size(),
                                                                   case.num_experts)
        nvlink, _ = buffers(group, rdma_bytes, shrink=True)
        nvlink.clean_low_latency_buffer(case.T, case.hidden, case.num_experts)


def third_pending_send_error(group) -> str:
    """Two sends await their hooks (both slots); a third send of the same kind would reuse the
    first one's slot and raises InputError, and running a hook twice raises too."""
    from low_latency_cases import buffers

    import tritonep as deep_ep

    T, hidden, num_experts = 4, 128, 2 * group.size()
    nvlink, _ = buffers(group, deep_ep.Buffer.get_low_latency_rdma_size_hint(T, hidden, group.size(), num_experts))
    x = torch.randn(T, hidden, device=nvlink.device, dtype=torch.float32).to(torch.bfloat16)
    topk_idx = torch.zeros(T, 1, dtype=torch.int64, device=nvlink.device)
    hooks = [nvlink.low_latency_dispatch(x, topk_idx, T, num_experts, return_recv_hook=True)[4] for _ in range(2)]
    message = ""
    try:
        nvlink.low_latency_dispatch(x, topk_idx, T, num_experts, return_recv_hook=True)
    except deep_ep.InputError as error:
        message = str(error)
    for hook in reversed(hooks):
        hook()
    try:
        hooks[0]()
    except deep_ep.InputError as error:
        message += " | " + str(error)
    return message


THIRD_SEND_MESSAGES = ("still awaits its receive hook and holds receive slot", "already called")


def test_interpreter_third_pending_send_raises(interpreter_pools) -> None:
    messages = interpreter_pools(2).run(third_pending_send_error)
    assert all(all(part in m for part in THIRD_SEND_MESSAGES) for m in messages), messages


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_interpreter_two_micro_batches(interpreter_pools, schedule: str) -> None:
    case = LowLatencyCase(seed=11, tokens=(6, 5), T=8, hidden=256, num_experts=8, num_topk=3,
                          use_fp8=schedule != "forward")
    problems = interpreter_pools(2).run(two_micro_batches, case, schedule)
    assert all(not p for p in problems), problems


@pytest.mark.parametrize("kill", [True, False], ids=["killed", "stalled"])
def test_interpreter_dead_rank_masked_by_survivors(interpreter_pools, kill: bool) -> None:
    """Shrink mode, issue 11: rank 2 of 3 CPU ranks is killed (or stalls) mid-run; the two
    survivors' kernels time out on it, mask it and go on, matching the CPU backend. A pool of
    its own (``interpreter_pools`` only sets up the interpreter): the victim never comes back."""
    case = LowLatencyCase(seed=80, tokens=(4, 3, 4), T=4, hidden=256, num_experts=6, num_topk=2, calls=3)
    with RankPool(3, timeout=600, **pool_options()) as pool:
        problems = pool.run(survivors_mask_dead_rank, case, 2, kill, 0.5, may_exit={2})
    assert problems[2] is None and all(not p for p in problems[:2]), problems


# ------------------------------------------------------------------------------- GPU
def _tokens(pool: RankPool, first: int, others: int) -> tuple[int, ...]:
    return (first,) + (others,) * (pool.num_ranks - 1)


def _decode_experts(num_ranks: int) -> int:
    """DeepEP's decode problem has 288 experts; where the rank count does not divide 288 (5 or
    7 ranks), 32 per rank."""
    return 288 if 288 % num_ranks == 0 else 32 * num_ranks


@pytest.mark.gpu(min_gpus=1)
@pytest.mark.parametrize("use_fp8,round_scale,use_ue8m0", [(True, False, False), (True, True, False),
                                                           (True, True, True), (False, False, False)])
@pytest.mark.parametrize("hook", [False, True])
def test_gpu_benchmark_shape(gpu_pool, use_fp8: bool, round_scale: bool, use_ue8m0: bool, hook: bool) -> None:
    """DeepEP's low-latency problem: 128 tokens, hidden 7168, top-8 of 288 experts."""
    _check(gpu_pool, LowLatencyCase(seed=21, tokens=_tokens(gpu_pool, 128, 128), T=128, hidden=7168,
                                    num_experts=_decode_experts(gpu_pool.num_ranks), num_topk=8, use_fp8=use_fp8,
                                    round_scale=round_scale, use_ue8m0=use_ue8m0, hook=hook, calls=2))


@pytest.mark.gpu(min_gpus=1)
@pytest.mark.parametrize("variant", ["zero_copy", "out", "fewer_tokens", "skewed", "one_expert", "none", "topk11"])
def test_gpu_variants(gpu_pool, variant: str) -> None:
    _check(gpu_pool, LowLatencyCase(
        seed=30, tokens=_tokens(gpu_pool, 100 if variant == "fewer_tokens" else 128, 0 if variant == "fewer_tokens"
                                else 128), T=128, hidden=4096, num_experts=gpu_pool.num_ranks * 18,
        num_topk=11 if variant == "topk11" else 8, zero_copy=variant == "zero_copy", use_out=variant == "out",
        routing=variant if variant in ("skewed", "one_expert", "none") else "random", calls=2))


@pytest.mark.gpu(min_gpus=1)
@pytest.mark.parametrize("options", [dict(), dict(hook=True), dict(zero_copy=True, use_out=True),
                                     dict(use_fp8=False, hook=True, zero_copy=True)],
                         ids=["plain", "hook", "zero_copy_out", "bf16_hook_zero_copy"])
def test_gpu_repeated_calls(gpu_pool, options: dict) -> None:
    """Six rounds of one call shape: from the third on, calls are replayed
    (backends/nvlink/low_latency/replay.py), with new tensors each round."""
    R = gpu_pool.num_ranks
    _check(gpu_pool, LowLatencyCase(seed=90, tokens=_tokens(gpu_pool, 128, 96), T=128, hidden=7168,
                                    num_experts=_decode_experts(R), num_topk=8, calls=6, **options))


@pytest.mark.gpu(min_gpus=1)
def test_gpu_race_loop(gpu_pool) -> None:
    """40 random cases back to back (sizes, options, hooks) to shake out races between slots."""
    rng = random.Random(1)
    cases = []
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
        case.num_topk = min(case.num_topk, case.num_experts)   # one rank: 4 experts, top-8 impossible
        cases.append(case)
    _check(gpu_pool, cases)


@pytest.mark.gpu(min_gpus=1)
def test_gpu_third_pending_send_raises(gpu_pool) -> None:
    messages = gpu_pool.run(third_pending_send_error)
    assert all(all(part in m for part in THIRD_SEND_MESSAGES) for m in messages), messages


@pytest.mark.gpu(min_gpus=1)
@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("use_fp8", [True, False])
def test_gpu_two_micro_batches(gpu_pool, schedule: str, use_fp8: bool) -> None:
    """DeepEP's decode shape, two micro-batches in flight, hooks in every order (issue 11)."""
    R = gpu_pool.num_ranks
    case = LowLatencyCase(seed=70, tokens=_tokens(gpu_pool, 128, 120), T=128, hidden=7168,
                          num_experts=_decode_experts(R), num_topk=8, use_fp8=use_fp8)
    problems = gpu_pool.run(two_micro_batches, case, schedule)
    assert all(not p for p in problems), problems


@pytest.mark.gpu(min_gpus=1)
def test_gpu_cuda_graph_replay(gpu_pool) -> None:
    problems = gpu_pool.run(graph_replay, 13)
    assert all(not p for p in problems), problems


@pytest.mark.gpu(min_gpus=1)
@pytest.mark.parametrize("variant", ["drop_last", "drop_first_hook", "change_before_combine", "self"])
def test_gpu_masks(gpu_pool, variant: str) -> None:
    """Shrink mode on GPUs, against the CPU backend: DeepEP's shapes, several rounds."""
    R = gpu_pool.num_ranks
    none = ((),) * R
    masks = {"drop_last": (none, symmetric_masks(R, (R - 1,)), none, symmetric_masks(R, (R - 1,)), none, none),
             "drop_first_hook": (symmetric_masks(R, (0,)), none, none),
             "change_before_combine": (none, symmetric_masks(R, (R - 1,)), none),
             "self": (((0,),) + ((),) * (R - 1), none)}[variant]
    combine_masks = (symmetric_masks(R, (R - 1,)), none, symmetric_masks(R, (0,))) \
        if variant == "change_before_combine" else ()
    _check(gpu_pool, LowLatencyCase(seed=60, tokens=_tokens(gpu_pool, 128, 100), T=128, hidden=7168,
                                    num_experts=_decode_experts(R), num_topk=8,
                                    hook=variant in ("drop_first_hook", "change_before_combine"),
                                    calls=len(masks), masks=masks, combine_masks=combine_masks))


@pytest.mark.gpu
def test_gpu_masked_rank_that_makes_no_calls(gpu_pool) -> None:
    R = gpu_pool.num_ranks
    case = LowLatencyCase(seed=61, tokens=_tokens(gpu_pool, 64, 64), T=64, hidden=4096, num_experts=16 * R,
                          num_topk=8, calls=4, masks=(symmetric_masks(R, (R - 1,)),) * 4)
    problems = gpu_pool.run(compare_low_latency, case, R - 1)
    assert all(not p for p in problems), problems
    gpu_pool.run(clean_without, case, R - 1)
    problems = gpu_pool.run(rejoin_after_clean, case)
    assert all(not p for p in problems), problems


@pytest.mark.gpu(min_gpus=1)
def test_gpu_masked_cuda_graph_replay(gpu_pool) -> None:
    """Mask updates, dispatch and combine captured in one CUDA graph and replayed."""
    problems = gpu_pool.run(graph_replay, 17, masked=True)
    assert all(not p for p in problems), problems


@pytest.fixture(scope="module")
def dead_rank_pool(gpu_pool):
    """At least 3 ranks (ranks share GPUs where there are fewer), in a pool of their own beside
    the module's pool, whose Buffers are released first (8 ranks sharing one H100 ran out of
    memory at the new pool's start, 2026-11-25). Both dead-rank tests share it: the stalled
    rank's test leaves every process in step, and the killed rank's runs last."""
    from gpu_pools import own_gpu_pool

    gpu_pool.run(release_buffers)
    with own_gpu_pool(max(gpu_ranks(), 3), "the dead-rank tests' GPU ranks") as pool:
        yield pool


@pytest.mark.gpu(min_gpus=1)
@pytest.mark.parametrize("kill", [False, True], ids=["stalled", "killed"])   # the pool's last run kills
def test_gpu_dead_rank_masked_by_survivors(dead_rank_pool, kill: bool) -> None:
    """Shrink mode, issue 11: the last rank stalls (or is killed) after one round, at DeepEP's
    decode shape; the survivors mask it on their own within the time-out (2 s) and match the
    CPU backend."""
    R = dead_rank_pool.num_ranks
    case = LowLatencyCase(seed=81, tokens=(128,) * R, T=128, hidden=7168,
                          num_experts=_decode_experts(R), num_topk=8, calls=4)
    problems = dead_rank_pool.run(survivors_mask_dead_rank, case, R - 1, kill, 2.0, may_exit={R - 1})
    assert problems[R - 1] is None and all(not p for p in problems[:R - 1]), problems


@pytest.mark.gpu
def test_gpu_stalled_peer_raises_with_rank_and_phase(gpu_pool) -> None:
    messages = gpu_pool.run(stalled_peer_error)
    assert "waiting for rows from the peer" in messages[0] and "waiting for rank 1" in messages[0], messages
