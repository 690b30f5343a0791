"""Shrink mode (rank masks) of low-latency mode on the collective (CPU) backend.

A rank that masks rank m sends nothing to m's experts, receives nothing from m and leaves m's
experts out of its combine; on this backend rows also stop when the *other* side masks
(gloo collectives involve every rank, so a cut is "no rows either way"). The expected values
are built independently: counts by brute force from every rank's regenerated inputs, rows as
the unmasked result with the cut sources' blocks removed, and the combine as the unmasked
combine with the weights of cut experts set to zero, and by brute force from the inputs.
"""

from __future__ import annotations

import random

import pytest
import torch
from collective_inputs import brute_force_combine, dispatched_rows, random_routing, stand_in_expert

import tritonep as deep_ep
from tritonep.core.checks import InputError
from tritonep.rank_pool import RankPool

NUM_EXPERTS = 12  # divisible by 2, 3 and 4 ranks
T = 6


@pytest.fixture(scope="module", params=[2, 3, 4])
def pool(request: pytest.FixtureRequest):
    with RankPool(request.param, timeout=120) as ranks:
        yield ranks


# ---------------------------------------------------------------------------- helpers
def make_inputs(seed: int, rank: int, hidden: int, num_topk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    num_tokens = T if rank == 0 else (seed + 2 * rank) % (T + 1)
    x = (torch.randn(num_tokens, hidden, generator=g) * torch.exp(torch.randn(num_tokens, 1, generator=g))).bfloat16()
    topk_idx, weights = random_routing(g, num_tokens, NUM_EXPERTS, num_topk, 0.2)
    return x, topk_idx, weights


def scenario_masks(name: str, num_ranks: int, seed: int = 0) -> list[list[int]]:
    """The ranks each rank masks, for a named scenario."""
    last = num_ranks - 1
    if name == "none":
        return [[] for _ in range(num_ranks)]
    if name == "symmetric":      # everyone drops the last rank, which drops everyone else
        return [[last] if r != last else list(range(last)) for r in range(num_ranks)]
    if name == "asymmetric":     # rank 0 masks the last rank; the last rank masks nobody
        return [[last]] + [[] for _ in range(last)]
    if name == "self":           # rank 0 masks itself: its own experts get nothing from it
        return [[0]] + [[] for _ in range(last)]
    if name == "random":
        rng = random.Random(seed * 31 + num_ranks)
        return [[d for d in range(num_ranks) if rng.random() < 0.35] for _ in range(num_ranks)]
    raise ValueError(name)


def linked(masks: list[list[int]]) -> list[list[bool]]:
    """[s][d]: rows flow between s and d (neither masks the other)."""
    n = len(masks)
    return [[d not in masks[s] and s not in masks[d] for d in range(n)] for s in range(n)]


def set_masks(buffer: deep_ep.Buffer, ranks: list[int]) -> None:
    """Mask exactly ``ranks`` through the public API, and check the query."""
    buffer.low_latency_clean_mask_buffer()
    for rank in ranks:
        buffer.low_latency_update_mask_buffer(rank, True)
    status = torch.full((buffer.group_size,), 7, dtype=torch.int32)
    buffer.low_latency_query_mask_buffer(status)
    assert status.tolist() == [int(r in ranks) for r in range(buffer.group_size)]


def buffers(group, hidden: int) -> tuple[deep_ep.Buffer, deep_ep.Buffer]:
    """(unmasked Buffer, shrink-mode Buffer)."""
    size = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, hidden, group.size(), NUM_EXPERTS)
    return (deep_ep.Buffer(group, num_rdma_bytes=size, low_latency_mode=True),
            deep_ep.Buffer(group, num_rdma_bytes=size, low_latency_mode=True, enable_shrink=True))


def _rows(packed, use_fp8: bool, expert: int, begin: int, count: int) -> list[torch.Tensor]:
    if use_fp8:
        return [packed[0][expert, begin:begin + count].view(torch.uint8), packed[1][expert, begin:begin + count]]
    return [packed[expert, begin:begin + count]]


# ---------------------------------------------------------------------------- rank functions
def case_masked_round_trip(group, seed: int, scenario: str, combine_scenario: str | None, use_fp8: bool,
                           hook: bool) -> None:
    """Dispatch with ``scenario``'s masks, optionally switch to ``combine_scenario``'s before the
    receive hook and the combine, and compare with the unmasked Buffer's result."""
    me, num_ranks = group.rank(), group.size()
    hidden, num_topk = (256, 3) if use_fp8 else (128, 4)
    per_rank = NUM_EXPERTS // num_ranks
    plain, shrink = buffers(group, hidden)
    masks = scenario_masks(scenario, num_ranks, seed)
    combine_masks = masks if combine_scenario is None else scenario_masks(combine_scenario, num_ranks, seed + 1)
    links = linked(masks)
    combine_links = [[a and b for a, b in zip(row, other)] for row, other in zip(links, linked(combine_masks))]
    x, topk_idx, weights = make_inputs(seed, me, hidden, num_topk)

    set_masks(shrink, masks[me])
    recv_stats = torch.zeros(per_rank, dtype=torch.int32)
    dispatch_wait = torch.zeros(num_ranks, dtype=torch.int64)
    packed, count, handle, _, recv_hook = shrink.low_latency_dispatch(
        x, topk_idx, T, NUM_EXPERTS, cumulative_local_expert_recv_stats=recv_stats,
        dispatch_wait_recv_cost_stats=dispatch_wait, use_fp8=use_fp8, return_recv_hook=hook)
    if combine_scenario is not None:   # the dispatch already chose its ranks: this affects the combine
        set_masks(shrink, combine_masks[me])
    if hook:
        recv_hook()
    packed_u, count_u, handle_u, _, _ = plain.low_latency_dispatch(x, topk_idx, T, NUM_EXPERTS, use_fp8=use_fp8)

    # Counts by brute force over every rank's inputs.
    all_topk = [make_inputs(seed, s, hidden, num_topk)[1] for s in range(num_ranks)]
    expected_counts = [sum(int((all_topk[s] == me * per_rank + e).sum()) for s in range(num_ranks) if links[s][me])
                       for e in range(per_rank)]
    assert count.tolist() == expected_counts
    assert recv_stats.tolist() == expected_counts

    # Rows, src_info, layout_range: the unmasked result without the cut sources' blocks.
    src_info, layout_range = handle[0], handle[1]
    for e in range(per_rank):
        begin = 0
        for s in range(num_ranks):
            unmasked = int(handle_u[1][e, s])
            begin_u, n = unmasked >> 32, unmasked & 0xFFFFFFFF
            if not links[s][me]:
                assert int(layout_range[e, s]) == begin << 32, (e, s)
                continue
            assert int(layout_range[e, s]) == (begin << 32) | n, (e, s)
            for got, want in zip(_rows(packed, use_fp8, e, begin, n), _rows(packed_u, use_fp8, e, begin_u, n)):
                assert torch.equal(got, want)
            assert torch.equal(src_info[e, begin:begin + n], handle_u[0][e, begin_u:begin_u + n])
            begin += n
        assert bool((src_info[e, begin:] == -1).all())
    assert [bool(v > 0) for v in dispatch_wait.tolist()] == [links[s][me] for s in range(num_ranks)]

    # Combine: cut experts count as zero.
    cut = torch.tensor([not combine_links[me][r] for r in range(num_ranks)])
    kept_weights = torch.where((topk_idx >= 0) & ~cut[topk_idx.clamp(min=0) // per_rank], weights, 0.0)
    combine_wait = torch.zeros(num_ranks, dtype=torch.int64)
    combined, _, combine_hook = shrink.low_latency_combine(stand_in_expert(packed, use_fp8, me), topk_idx, weights,
                                                           handle, return_recv_hook=hook,
                                                           combine_wait_recv_cost_stats=combine_wait)
    if hook:
        combine_hook()
    expected = plain.low_latency_combine(stand_in_expert(packed_u, use_fp8, me), topk_idx, kept_weights, handle_u)[0]
    torch.testing.assert_close(combined.float(), expected.float(), rtol=2 ** -7, atol=1e-4)
    brute_force = brute_force_combine(dispatched_rows(x, use_fp8), topk_idx, kept_weights)
    torch.testing.assert_close(combined.float(), brute_force, rtol=2 ** -7, atol=1e-4)
    assert [bool(v > 0) for v in combine_wait.tolist()] == combine_links[me]


def case_mask_api(group) -> None:
    """update/query/clean round trips, then a masked call after the clean equals an unmasked one."""
    me, num_ranks = group.rank(), group.size()
    last = num_ranks - 1
    plain, shrink = buffers(group, 128)
    status = torch.full((num_ranks,), 5, dtype=torch.int32)

    def query() -> list[int]:
        shrink.low_latency_query_mask_buffer(status)
        return status.tolist()

    assert query() == [0] * num_ranks
    shrink.low_latency_update_mask_buffer(last, True)
    assert query() == [0] * last + [1]
    shrink.low_latency_update_mask_buffer(0, mask=True)
    shrink.low_latency_update_mask_buffer(last, True)          # idempotent
    assert query() == [1] + [0] * (last - 1) + [1]
    shrink.low_latency_update_mask_buffer(last)                # mask defaults to False: unmask
    assert query() == [1] + [0] * last
    strided = torch.zeros(num_ranks, 2, dtype=torch.int32)[:, 1]  # any strides are fine
    shrink.low_latency_query_mask_buffer(strided)
    assert strided.tolist() == [1] + [0] * last
    # clean_low_latency_buffer with masks set communicates with nobody here; it must still work.
    shrink.clean_low_latency_buffer(T, 128, NUM_EXPERTS)
    shrink.low_latency_clean_mask_buffer()
    assert query() == [0] * num_ranks
    # With every mask cleared a shrink-mode Buffer behaves like a plain one.
    x, topk_idx, weights = make_inputs(3, me, 128, 2)
    results = []
    for buffer in (plain, shrink):
        packed, count, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, T, NUM_EXPERTS, use_fp8=False)
        combined = buffer.low_latency_combine(packed, topk_idx, weights, handle)[0]
        valid_rows = [packed[e, :n].clone() for e, n in enumerate(count.tolist())]   # rows past the count: any
        results.append((valid_rows, count.clone(), handle[1].clone(), combined))
    (rows, *rest), (rows_u, *rest_u) = results[1], results[0]
    assert all(torch.equal(got, want) for got, want in zip(rows, rows_u, strict=True))
    assert all(torch.equal(got, want) for got, want in zip(rest, rest_u, strict=True))


def _error(fn) -> str:
    try:
        fn()
    except InputError as error:
        return str(error)
    return "no error"


def case_mask_errors(group) -> dict[str, str]:
    num_ranks = group.size()
    size = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, 128, num_ranks, NUM_EXPERTS)
    plain = deep_ep.Buffer(group, num_rdma_bytes=size, low_latency_mode=True)
    normal_only = deep_ep.Buffer(group, num_nvl_bytes=1 << 20, enable_shrink=True)
    shrink = deep_ep.Buffer(group, num_rdma_bytes=size, low_latency_mode=True, enable_shrink=True)
    status = torch.zeros(num_ranks, dtype=torch.int32)
    messages = {
        "update without shrink": _error(lambda: plain.low_latency_update_mask_buffer(0, True)),
        "query without shrink": _error(lambda: plain.low_latency_query_mask_buffer(status)),
        "clean without shrink": _error(plain.low_latency_clean_mask_buffer),
        "update without low latency": _error(lambda: normal_only.low_latency_update_mask_buffer(0, True)),
        "rank -1": _error(lambda: shrink.low_latency_update_mask_buffer(-1, True)),
        "rank R": _error(lambda: shrink.low_latency_update_mask_buffer(num_ranks, True)),
        "rank bool": _error(lambda: shrink.low_latency_update_mask_buffer(True, True)),
        "rank float": _error(lambda: shrink.low_latency_update_mask_buffer(1.0, True)),
        "mask str": _error(lambda: shrink.low_latency_update_mask_buffer(0, "yes")),
        "status int64": _error(lambda: shrink.low_latency_query_mask_buffer(status.long())),
        "status shape": _error(lambda: shrink.low_latency_query_mask_buffer(torch.zeros(num_ranks + 1,
                                                                                          dtype=torch.int32))),
        "status 2-D": _error(lambda: shrink.low_latency_query_mask_buffer(status.view(1, -1))),
        "status list": _error(lambda: shrink.low_latency_query_mask_buffer([0] * num_ranks)),
        "status device": _error(lambda: shrink.low_latency_query_mask_buffer(torch.zeros(num_ranks,
                                                                                           dtype=torch.int32,
                                                                                           device="meta"))),
    }
    x, topk_idx, weights = make_inputs(1, group.rank(), 128, 2)
    packed, _, handle, _, _ = shrink.low_latency_dispatch(x, topk_idx, T, NUM_EXPERTS, use_fp8=False)
    for name, stats in [("combine stats int32", torch.zeros(num_ranks, dtype=torch.int32)),
                        ("combine stats shape", torch.zeros(num_ranks + 1, dtype=torch.int64))]:
        messages[name] = _error(lambda stats=stats: shrink.low_latency_combine(
            packed, topk_idx, weights, handle, combine_wait_recv_cost_stats=stats))
    shrink.low_latency_combine(packed, topk_idx, weights, handle)   # the pair completes: peers are not left waiting
    # Nothing was masked by the failed calls.
    shrink.low_latency_query_mask_buffer(status)
    assert status.tolist() == [0] * num_ranks
    return messages


# ---------------------------------------------------------------------------- tests
SCENARIOS = ["none", "symmetric", "asymmetric", "self", "random"]


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("use_fp8", [False, True], ids=["bf16", "fp8"])
def test_masked_round_trip(pool: RankPool, scenario: str, use_fp8: bool) -> None:
    pool.run(case_masked_round_trip, 11, scenario, None, use_fp8, False)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_masks_with_hooks(pool: RankPool, seed: int) -> None:
    pool.run(case_masked_round_trip, 20 + seed, "random", None, seed % 2 == 0, True)


@pytest.mark.parametrize("dispatch_scenario,combine_scenario", [
    ("none", "symmetric"), ("symmetric", "none"), ("none", "asymmetric"), ("random", "random")])
@pytest.mark.parametrize("hook", [False, True], ids=["no_hook", "hook"])
def test_masks_change_between_dispatch_and_combine(pool: RankPool, dispatch_scenario: str, combine_scenario: str,
                                                   hook: bool) -> None:
    """The combine skips ranks masked at its dispatch or at the combine; with a hook, the masks
    change after the send and before the receive (the dispatch keeps the send's masks)."""
    pool.run(case_masked_round_trip, 5, dispatch_scenario, combine_scenario, False, hook)


def test_mask_api_round_trips(pool: RankPool) -> None:
    pool.run(case_mask_api)


def test_mask_errors(pool: RankPool) -> None:
    messages = pool.run(case_mask_errors)[0]
    for name, message in messages.items():
        if "without" in name:
            assert "enable_shrink=True" in message, (name, message)
        elif name.startswith("rank"):
            assert "rank_to_mask must be an int in [0," in message, (name, message)
        elif name.startswith("mask"):
            assert "mask must be a bool" in message, (name, message)
        elif name.startswith("status"):
            assert "mask_status must" in message, (name, message)
        else:
            assert "combine_wait_recv_cost_stats must" in message, (name, message)
