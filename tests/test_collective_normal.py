"""Normal-mode dispatch/combine of the collective (CPU) backend, through ``tritonep.Buffer``.

Every rank regenerates every rank's inputs from the seed, so each rank can build what it must
receive with plain Python loops (the brute-force reference) and compare locally.
"""

from __future__ import annotations

import pytest
import torch
from collective_inputs import odd_strides_if_empty, random_routing
from hypothesis import given, settings
from hypothesis import strategies as st
from torch_defaults import pool_options

import tritonep as deep_ep
from tritonep.core import fp8
from tritonep.core.checks import InputError
from tritonep.rank_pool import RankPool

NUM_EXPERTS = 12  # divisible by 1, 2, 3 and 4 ranks


@pytest.fixture(scope="module", params=[1, 2, 3, 4])
def pool(request: pytest.FixtureRequest):
    with RankPool(request.param, timeout=120, **pool_options()) as ranks:
        yield ranks


# ---------------------------------------------------------------------------- inputs and references
def make_inputs(seed: int, rank: int, num_tokens: int, hidden: int, num_topk: int, num_experts: int,
                drop: float = 0.25) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(num_tokens, hidden, generator=g, dtype=torch.float32, device="cpu").bfloat16()
    topk_idx, weights = random_routing(g, num_tokens, num_experts, num_topk, drop)
    return odd_strides_if_empty(x, hidden), topk_idx, weights


def brute_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    per_expert_count = num_experts // num_ranks
    per_rank = [0] * num_ranks
    per_expert = [0] * num_experts
    in_rank = [[False] * num_ranks for _ in range(topk_idx.shape[0])]
    for t, row in enumerate(topk_idx.tolist()):
        for e in row:
            if e >= 0:
                per_expert[e] += 1
                in_rank[t][e // per_expert_count] = True
        for r in range(num_ranks):
            per_rank[r] += in_rank[t][r]
    return per_rank, per_expert, in_rank


def expected_receive(seed, sizes, hidden, num_topk, num_experts, me, num_ranks):
    """Rows rank ``me`` must receive, in SPEC order: by source ascending, token order inside."""
    per_rank_experts = num_experts // num_ranks
    rows = []  # (source, token, x row, local ids, weights)
    for source, num_tokens in enumerate(sizes):
        x, topk_idx, weights = make_inputs(seed, source, num_tokens, hidden, num_topk, num_experts)
        for t in range(num_tokens):
            ids = topk_idx[t].tolist()
            if any(e >= 0 and e // per_rank_experts == me for e in ids):
                local = [e - me * per_rank_experts if e >= 0 and e // per_rank_experts == me else -1 for e in ids]
                w = [weights[t, k].item() if local[k] >= 0 else 0.0 for k in range(num_topk)]
                rows.append((source, t, x[t], local, w))
    return rows


def brute_prefix(seed, sizes, hidden, num_topk, num_experts, num_ranks):
    counts = [[0] * num_ranks for _ in range(num_ranks)]
    for source, num_tokens in enumerate(sizes):
        _, topk_idx, _ = make_inputs(seed, source, num_tokens, hidden, num_topk, num_experts)
        _, _, in_rank = brute_layout(topk_idx, num_experts, num_ranks)
        for row in in_rank:
            for r in range(num_ranks):
                counts[source][r] += row[r]
    prefix = [[sum(counts[i][j] for i in range(k + 1)) for j in range(num_ranks)] for k in range(num_ranks)]
    return prefix


def make_x(x: torch.Tensor, kind: str):
    """bf16, or fp8 with float32 / column-major float32 / packed int32 scales."""
    if kind == "bf16":
        return x
    if kind == "ue8m0":
        return fp8.cast_to_fp8(x, round_scale=True, use_ue8m0=True)
    data, scales = fp8.cast_to_fp8(x)
    if kind == "fp8_colmajor":
        scales = scales.t().contiguous().t()
    return data, scales


def do_dispatch(buffer, x, topk_idx, weights, num_experts, **kwargs):
    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    assert per_rdma is None
    return buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                           num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=weights, **kwargs)


# ---------------------------------------------------------------------------- rank functions
def case_layout(group, seed: int, num_tokens: int, num_topk: int) -> None:
    buffer = deep_ep.Buffer(group)
    _, topk_idx, _ = make_inputs(seed, group.rank(), num_tokens, 128, num_topk, NUM_EXPERTS)
    per_rank, per_rdma, per_expert, in_rank, event = buffer.get_dispatch_layout(topk_idx, NUM_EXPERTS)
    ref_rank, ref_expert, ref_in = brute_layout(topk_idx, NUM_EXPERTS, group.size())
    assert per_rdma is None
    assert per_rank.dtype == torch.int32 and per_rank.tolist() == ref_rank
    assert per_expert.dtype == torch.int32 and per_expert.tolist() == ref_expert
    assert in_rank.dtype == torch.bool and in_rank.tolist() == ref_in
    event.current_stream_wait()


def case_dispatch(group, seed: int, sizes: list[int], hidden: int, num_topk: int, kind: str, alignment: int,
                  num_worst: int) -> None:
    me, num_ranks = group.rank(), group.size()
    buffer = deep_ep.Buffer(group)
    x, topk_idx, weights = make_inputs(seed, me, sizes[me], hidden, num_topk, NUM_EXPERTS)
    recv_x, recv_idx, recv_w, expert_list, handle, _ = do_dispatch(
        buffer, make_x(x, kind), topk_idx, weights, NUM_EXPERTS, expert_alignment=alignment,
        num_worst_tokens=num_worst)
    rows = expected_receive(seed, sizes, hidden, num_topk, NUM_EXPERTS, me, num_ranks)
    real = len(rows)
    total = num_worst if num_worst else real
    if kind != "bf16":
        recv_x, recv_scales = recv_x
        sent = [make_x(make_inputs(seed, source, sizes[source], hidden, num_topk, NUM_EXPERTS)[0], kind)
                for source in range(num_ranks)]
        assert recv_x.dtype == torch.float8_e4m3fn and recv_scales.dtype == sent[0][1].dtype
        assert recv_scales.shape == (total, sent[0][1].shape[1])
        if rows:  # fp8 bytes and scales are carried through unchanged
            assert torch.equal(recv_scales[:real], torch.stack([sent[s][1][t] for s, t, *_ in rows]))
            assert torch.equal(recv_x[:real].view(torch.uint8),
                               torch.stack([sent[s][0][t] for s, t, *_ in rows]).view(torch.uint8))
        recv_x = recv_x.view(torch.uint8)
        expected_x = [sent[s][0][t].view(torch.uint8) for s, t, *_ in rows]
    else:
        expected_x = [r[2] for r in rows]
    assert recv_x.shape == (total, hidden)
    if rows:
        assert torch.equal(recv_x[:real], torch.stack(expected_x))
    assert recv_idx.tolist()[:real] == [r[3] for r in rows]
    assert recv_w.tolist()[:real] == [r[4] for r in rows]
    assert handle.recv_src_idx.tolist()[:real] == [r[1] for r in rows]
    assert handle[0].dtype == torch.int32
    assert handle[0].tolist() == brute_prefix(seed, sizes, hidden, num_topk, NUM_EXPERTS, num_ranks)
    if num_worst:
        assert expert_list == []
        assert bool((recv_idx[real:] == -1).all()) and bool((recv_w[real:] == 0).all())
        assert bool((recv_x[real:].float() == 0).all())
        assert bool((handle.recv_src_idx[real:] == -1).all())
    else:
        counts = [sum(1 for r in rows for e in r[3] if e == local) for local in range(NUM_EXPERTS // num_ranks)]
        assert expert_list == [(c + alignment - 1) // alignment * alignment for c in counts]


def case_cached(group, seed: int, sizes: list[int], hidden: int, kind: str, num_worst: int) -> None:
    me = group.rank()
    buffer = deep_ep.Buffer(group)
    x, topk_idx, weights = make_inputs(seed, me, sizes[me], hidden, 3, NUM_EXPERTS)
    x2 = (x.float() * -2 + 1).bfloat16()
    _, _, _, _, handle, _ = do_dispatch(buffer, make_x(x, kind), topk_idx, weights, NUM_EXPERTS,
                                        num_worst_tokens=num_worst)
    fresh = do_dispatch(buffer, make_x(x2, kind), topk_idx, weights, NUM_EXPERTS, num_worst_tokens=num_worst)[0]
    cached, idx, w, lst, cached_handle, _ = buffer.dispatch(make_x(x2, kind), handle=handle)
    assert idx is None and w is None and lst is None and cached_handle is None
    if kind == "bf16":
        assert torch.equal(cached, fresh)
    else:
        assert torch.equal(cached[0].float(), fresh[0].float()) and torch.equal(cached[1], fresh[1])


def case_combine(group, seed: int, sizes: list[int], hidden: int, bias_kind: str, num_worst: int) -> None:
    me = group.rank()
    buffer = deep_ep.Buffer(group)
    x, topk_idx, weights = make_inputs(seed, me, sizes[me], hidden, 4, NUM_EXPERTS)
    recv_x, _, recv_w, _, handle, _ = do_dispatch(buffer, x, topk_idx, weights, NUM_EXPERTS,
                                                  num_worst_tokens=num_worst)
    if num_worst:
        real = int(handle[0][-1, me])
        recv_x[real:] = 7  # padding rows must be ignored
        recv_w[real:] = 7
    g = torch.Generator().manual_seed(seed + 17 * me)
    b0 = torch.randn(sizes[me], hidden, generator=g, dtype=torch.float32, device="cpu").bfloat16()
    b1 = torch.randn(sizes[me], hidden, generator=g, dtype=torch.float32, device="cpu").bfloat16()
    bias = {"none": None, "tensor": b0, "tuple": (b0, b1), "tuple_none": (None, b1)}[bias_kind]
    combined, combined_w, _ = buffer.combine(recv_x, handle, topk_weights=recv_w, bias=bias)
    copies = torch.tensor([[sum(row)] for row in brute_layout(topk_idx, NUM_EXPERTS, group.size())[2]],
                          dtype=torch.float32).view(-1, 1)
    expected = x.float() * copies
    if bias_kind in ("tensor", "tuple"):
        expected += b0.float()
    if bias_kind in ("tuple", "tuple_none"):
        expected += b1.float()
    assert combined.dtype == torch.bfloat16 and combined.shape == x.shape
    if bias_kind == "none":
        assert torch.equal(combined, expected.bfloat16())  # copies of one bf16 value sum exactly
    else:
        torch.testing.assert_close(combined.float(), expected, rtol=2 ** -7, atol=1e-5)
    # Each valid (t, k) weight lives on exactly one rank, which received t: the sum is w or 0.
    assert torch.equal(combined_w, torch.where(topk_idx >= 0, weights, 0.0))
    no_weights = buffer.combine(recv_x, handle)[1]
    assert no_weights is None


def case_mismatch(group, field: str) -> str:
    me = group.rank()
    buffer = deep_ep.Buffer(group)
    hidden = 256 if field == "hidden" and me == group.size() - 1 else 128
    num_topk = 3 if field == "topk" and me == group.size() - 1 else 2
    x, topk_idx, weights = make_inputs(1, me, 5, hidden, num_topk, NUM_EXPERTS)
    kind = "fp8" if field == "dtype" and me == 0 else "bf16"
    try:
        do_dispatch(buffer, make_x(x, kind), topk_idx, weights, NUM_EXPERTS)
    except InputError as error:
        return str(error)
    return "no error"


def case_mismatch_after_dispatch(group, field: str) -> str:
    """Cached dispatch and combine exchange no counts but must still catch disagreeing ranks."""
    me, last = group.rank(), group.rank() == group.size() - 1
    buffer = deep_ep.Buffer(group)
    x, topk_idx, weights = make_inputs(1, me, 5, 128, 2, NUM_EXPERTS)
    recv_x, _, recv_w, _, handle, _ = do_dispatch(buffer, x, topk_idx, weights, NUM_EXPERTS)
    try:
        if field == "cached_hidden":
            buffer.dispatch(torch.zeros(5, 256 if last else 128, dtype=torch.bfloat16), handle=handle)
        elif field == "cached_dtype":
            buffer.dispatch(make_x(x, "fp8" if last else "bf16"), handle=handle)
        elif field == "combine_hidden":
            buffer.combine(torch.zeros(recv_x.shape[0], 256 if last else 128, dtype=torch.bfloat16), handle)
        else:
            buffer.combine(recv_x, handle, topk_weights=None if last else recv_w)
    except InputError as error:
        return str(error)
    return "no error"


def case_worst_too_small(group) -> str:
    me = group.rank()
    buffer = deep_ep.Buffer(group)
    x, topk_idx, weights = make_inputs(2, me, 8, 128, 2, NUM_EXPERTS, drop=0.0)
    try:
        do_dispatch(buffer, x, topk_idx, weights, NUM_EXPERTS, num_worst_tokens=1 if me == 0 else 1000)
    except InputError as error:
        return str(error)
    return "no error"


def case_no_topk(group, seed: int, sizes: list[int]) -> None:
    """Dispatch without top-k: only x (and the per-expert list) travel; combine still works."""
    me = group.rank()
    buffer = deep_ep.Buffer(group)
    x, topk_idx, _ = make_inputs(seed, me, sizes[me], 128, 2, NUM_EXPERTS)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, NUM_EXPERTS)
    recv_x, recv_idx, recv_w, expert_list, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    rows = expected_receive(seed, sizes, 128, 2, NUM_EXPERTS, me, group.size())
    assert recv_idx is None and recv_w is None
    assert recv_x.shape[0] == len(rows) and len(expert_list) == NUM_EXPERTS // group.size()
    combined, combined_w, _ = buffer.combine(recv_x, handle)
    assert combined_w is None
    assert torch.equal(combined, (x.float() * in_rank.sum(1, keepdim=True)).bfloat16())


# ---------------------------------------------------------------------------- tests
def sizes_for(num_ranks: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(0, 12, (num_ranks,), generator=g, device="cpu").tolist()
    if num_ranks > 1:
        sizes[seed % num_ranks] = 0  # one rank sends nothing
    return sizes


@pytest.mark.parametrize("num_tokens,num_topk", [(0, 2), (1, 1), (13, 4), (40, 12)])
def test_layout(pool: RankPool, num_tokens: int, num_topk: int) -> None:
    pool.run(case_layout, 5, num_tokens, num_topk)


@pytest.mark.parametrize("kind", ["bf16", "fp8", "fp8_colmajor", "ue8m0"])
@pytest.mark.parametrize("alignment,num_worst", [(1, 0), (4, 0), (1, 64)])
def test_dispatch(pool: RankPool, kind: str, alignment: int, num_worst: int) -> None:
    seed = 11 + alignment + num_worst
    hidden = 512 if kind == "ue8m0" else 256
    pool.run(case_dispatch, seed, sizes_for(pool.num_ranks, seed), hidden, 3, kind, alignment, num_worst)


@pytest.mark.parametrize("kind,num_worst", [("bf16", 0), ("fp8_colmajor", 0), ("bf16", 50), ("ue8m0", 0)])
def test_cached_dispatch_equals_fresh(pool: RankPool, kind: str, num_worst: int) -> None:
    hidden = 512 if kind == "ue8m0" else 128
    pool.run(case_cached, 4, sizes_for(pool.num_ranks, 4), hidden, kind, num_worst)


@pytest.mark.parametrize("bias_kind", ["none", "tensor", "tuple", "tuple_none"])
@pytest.mark.parametrize("num_worst", [0, 60])
def test_combine(pool: RankPool, bias_kind: str, num_worst: int) -> None:
    pool.run(case_combine, 9, [7] * pool.num_ranks, 128, bias_kind, num_worst)


def test_dispatch_without_topk(pool: RankPool) -> None:
    pool.run(case_no_topk, 3, sizes_for(pool.num_ranks, 3))


@pytest.mark.parametrize("field,needle", [("hidden", "hidden"), ("topk", "top-k"), ("dtype", "x dtype")])
def test_mismatched_ranks_raise_everywhere(pool: RankPool, field: str, needle: str) -> None:
    if pool.num_ranks == 1:
        pytest.skip("needs two ranks to disagree")
    messages = pool.run(case_mismatch, field)
    assert all(needle in message for message in messages), messages


@pytest.mark.parametrize("field,needle", [("cached_hidden", "hidden"), ("cached_dtype", "x dtype"),
                                          ("combine_hidden", "hidden"), ("combine_weights", "topk_weights")])
def test_mismatch_in_cached_dispatch_and_combine(pool: RankPool, field: str, needle: str) -> None:
    if pool.num_ranks == 1:
        pytest.skip("needs two ranks to disagree")
    messages = pool.run(case_mismatch_after_dispatch, field)
    assert all(needle in message for message in messages), messages


def test_num_worst_tokens_too_small_raises_everywhere(pool: RankPool) -> None:
    messages = pool.run(case_worst_too_small)
    assert all("num_worst_tokens" in message and "rank 0" in message for message in messages), messages


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 1000), hidden=st.sampled_from([128, 384]), num_topk=st.integers(1, 6),
       kind=st.sampled_from(["bf16", "fp8"]))
def test_dispatch_random_shapes(pool: RankPool, seed: int, hidden: int, num_topk: int, kind: str) -> None:
    pool.run(case_dispatch, seed, sizes_for(pool.num_ranks, seed), hidden, num_topk, kind, 2, 0)
