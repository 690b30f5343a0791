"""Low-latency dispatch/combine of the collective (CPU) backend, through ``tritonep.Buffer``.

Each rank regenerates every rank's inputs from the seed and builds, with Python loops, the
packed layout it must receive (the brute-force reference).
"""

from __future__ import annotations

import math

import pytest
import torch
from collective_inputs import brute_force_combine, odd_strides_if_empty, random_routing, stand_in_expert
from torch_defaults import pool_options

import tritonep as deep_ep
from tritonep.core.checks import InputError
from tritonep.rank_pool import RankPool

NUM_EXPERTS = 12  # divisible by 1, 2, 3 and 4 ranks
T = 6             # num_max_dispatch_tokens_per_rank


@pytest.fixture(scope="module", params=[1, 2, 3, 4])
def pool(request: pytest.FixtureRequest):
    with RankPool(request.param, timeout=120, **pool_options()) as ranks:
        yield ranks


def make_inputs(seed: int, rank: int, num_tokens: int, hidden: int, num_topk: int,
                drop: float = 0.25) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = (torch.randn(num_tokens, hidden, generator=g, dtype=torch.float32, device="cpu")
         * torch.exp(torch.randn(num_tokens, 1, generator=g, dtype=torch.float32, device="cpu") * 2)).bfloat16()
    topk_idx, weights = random_routing(g, num_tokens, NUM_EXPERTS, num_topk, drop)
    return odd_strides_if_empty(x, hidden), topk_idx, weights


def token_counts(num_ranks: int, seed: int) -> list[int]:
    sizes = [(seed + 3 * r) % (T + 1) for r in range(num_ranks)]
    sizes[0] = T
    return sizes


def make_buffer(group, hidden: int) -> deep_ep.Buffer:
    size = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, hidden, group.size(), NUM_EXPERTS)
    return deep_ep.Buffer(group, num_rdma_bytes=size, low_latency_mode=True)


def reference_scale(values: list[float], round_scale: bool) -> float:
    scale = (torch.tensor(max(max(abs(v) for v in values), 1e-4), dtype=torch.float32) / 448.0).item()
    if round_scale:
        mantissa, exponent = math.frexp(scale)
        scale = 2.0 ** (exponent - 1 if mantissa == 0.5 else exponent)
    return scale


def unpack_bytes(word: int) -> list[float]:
    word &= 0xFFFFFFFF
    return [2.0 ** (((word >> (8 * b)) & 0xFF) - 127) for b in range(4)]


def expected_layout(seed, sizes, hidden, num_topk, me, num_ranks):
    """For each local expert: [(source, token)] in source-ascending, token order."""
    per_rank = NUM_EXPERTS // num_ranks
    layout = [[] for _ in range(per_rank)]
    inputs = [make_inputs(seed, s, n, hidden, num_topk) for s, n in enumerate(sizes)]
    for local in range(per_rank):
        for source, (_, topk_idx, _) in enumerate(inputs):
            for t, row in enumerate(topk_idx.tolist()):
                if me * per_rank + local in row:
                    layout[local].append((source, t))
    return layout, inputs


# ---------------------------------------------------------------------------- rank functions
def case_dispatch_layout(group, seed: int, hidden: int, num_topk: int, use_fp8: bool, round_scale: bool,
                         use_ue8m0: bool) -> None:
    me, num_ranks = group.rank(), group.size()
    sizes = token_counts(num_ranks, seed)
    buffer = make_buffer(group, hidden)
    x, topk_idx, _ = make_inputs(seed, me, sizes[me], hidden, num_topk)
    packed, count, handle, event, hook = buffer.low_latency_dispatch(
        x, topk_idx, T, NUM_EXPERTS, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0)
    assert hook is None
    event.current_stream_wait()
    layout, inputs = expected_layout(seed, sizes, hidden, num_topk, me, num_ranks)
    per_rank = NUM_EXPERTS // num_ranks
    src_info, layout_range, t_, h_, e_ = handle
    assert (t_, h_, e_) == (T, hidden, NUM_EXPERTS)
    assert count.dtype == torch.int32 and count.tolist() == [len(rows) for rows in layout]
    assert src_info.dtype == torch.int32 and src_info.shape == (per_rank, num_ranks * T)
    assert layout_range.dtype == torch.int64 and layout_range.shape == (per_rank, num_ranks)
    if use_fp8:
        data, scales = packed
        assert data.dtype == torch.float8_e4m3fn and data.shape == (per_rank, num_ranks * T, hidden)
        groups = hidden // 512 if use_ue8m0 else hidden // 128
        assert scales.dtype == (torch.int32 if use_ue8m0 else torch.float32)
        assert scales.shape == (per_rank, num_ranks * T, groups)
        assert scales.stride(1) == 1 and scales.stride(2) == num_ranks * T  # column-major
    else:
        assert packed.dtype == torch.bfloat16 and packed.shape == (per_rank, num_ranks * T, hidden)
    for local, rows in enumerate(layout):
        begin = 0
        for source in range(num_ranks):
            n = sum(1 for s, _ in rows if s == source)
            assert layout_range[local, source].item() == (begin << 32) | n
            begin += n
        assert src_info[local, :len(rows)].tolist() == [t for _, t in rows]
        for row, (source, t) in enumerate(rows):
            original = inputs[source][0][t]
            if not use_fp8:
                assert torch.equal(packed[local, row], original)
                continue
            values = original.float()
            for group_index in range(hidden // 128):
                chunk = values[group_index * 128:(group_index + 1) * 128]
                scale = reference_scale(chunk.tolist(), round_scale)
                if use_ue8m0:
                    got_scale = unpack_bytes(int(scales[local, row, group_index // 4]))[group_index % 4]
                else:
                    got_scale = scales[local, row, group_index].item()
                assert got_scale == scale
                got = data[local, row, group_index * 128:(group_index + 1) * 128].float() * scale
                # e4m3 keeps 3 mantissa bits: relative error <= 2**-4, plus the subnormal step.
                assert bool(((got - chunk).abs() <= chunk.abs() * 2 ** -4 + scale * 2 ** -9).all())
                if round_scale:
                    assert math.log2(scale) == round(math.log2(scale))


def case_round_trip(group, seed: int, hidden: int, zero_copy: bool, use_out: bool, hook_mode: bool) -> None:
    me, num_ranks = group.rank(), group.size()
    sizes = token_counts(num_ranks, seed)
    buffer = make_buffer(group, hidden)
    x, topk_idx, weights = make_inputs(seed, me, sizes[me], hidden, 4)
    packed, count, handle, _, hook = buffer.low_latency_dispatch(x, topk_idx, T, NUM_EXPERTS, use_fp8=False,
                                                                 return_recv_hook=hook_mode)
    if hook_mode:
        hook()  # fills packed, count and the handle's src_info / layout_range in place
    layout, _ = expected_layout(seed, sizes, hidden, 4, me, num_ranks)
    assert count.tolist() == [len(rows) for rows in layout]
    assert [handle[0][e, :len(rows)].tolist() for e, rows in enumerate(layout)] == [[t for _, t in rows]
                                                                                   for rows in layout]
    y = stand_in_expert(packed, False, me)
    source = y
    if zero_copy:
        source = buffer.get_next_low_latency_combine_buffer(handle)
        source.copy_(y)
    out = torch.full_like(x, 5.0) if use_out else None
    combined, _, hook = buffer.low_latency_combine(source, topk_idx, weights, handle, zero_copy=zero_copy,
                                                   return_recv_hook=hook_mode, out=out)
    if hook_mode:
        hook()
    if use_out:
        assert combined.data_ptr() == out.data_ptr()
    assert combined.dtype == torch.bfloat16 and combined.shape == x.shape
    torch.testing.assert_close(combined.float(), brute_force_combine(x, topk_idx, weights), rtol=2 ** -7, atol=1e-4)


def case_fp8_round_trip(group, seed: int, round_scale: bool, use_ue8m0: bool) -> None:
    """Dequantised fp8 rows sent back: within e4m3 tolerance of x * sum of valid weights."""
    me = group.rank()
    hidden = 512
    buffer = make_buffer(group, hidden)
    x, topk_idx, weights = make_inputs(seed, me, T, hidden, 3)
    (data, scales), _, handle, _, _ = buffer.low_latency_dispatch(
        x, topk_idx, T, NUM_EXPERTS, use_fp8=True, round_scale=round_scale, use_ue8m0=use_ue8m0)
    if use_ue8m0:
        # 4 exponent bytes per int32, decoded here independently of tritonep.core.fp8.
        words = scales.clone(memory_format=torch.contiguous_format).view(torch.uint8).float()
        factors = torch.exp2(words - 127)
    else:
        factors = scales
    rows = (data.float().view(*data.shape[:2], -1, 128) * factors.unsqueeze(-1)).view(data.shape).bfloat16()
    combined = buffer.low_latency_combine(rows, topk_idx, weights, handle)[0]
    expected = x.float() * torch.where(topk_idx >= 0, weights, 0.0).sum(1, keepdim=True)
    bound = x.float().abs() * weights.sum(1, keepdim=True) * (2 ** -4 + 2 ** -7) + 1e-3
    assert bool(((combined.float() - expected).abs() <= bound).all())


def case_hook_two_batches(group, seed: int) -> None:
    """Two dispatches in flight (double buffering), received in reverse order."""
    me = group.rank()
    hidden = 256
    buffer = make_buffer(group, hidden)
    batches = [make_inputs(seed + i, me, T, hidden, 3) for i in range(2)]
    issued = [buffer.low_latency_dispatch(x, idx, T, NUM_EXPERTS, use_fp8=False, return_recv_hook=True)
              for x, idx, _ in batches]
    for _, _, _, _, hook in reversed(issued):
        hook()
    combines = []
    for (_, idx, w), (packed, _, handle, _, _) in zip(batches, issued, strict=True):
        combines.append(buffer.low_latency_combine(stand_in_expert(packed, False, me), idx, w, handle,
                                                   return_recv_hook=True))
    for (combined, _, hook), (x, idx, w) in zip(combines, batches, strict=True):
        hook()
        torch.testing.assert_close(combined.float(), brute_force_combine(x, idx, w), rtol=2 ** -7, atol=1e-4)


def case_stats(group, seed: int) -> None:
    me, num_ranks = group.rank(), group.size()
    sizes = token_counts(num_ranks, seed)
    buffer = make_buffer(group, 128)
    x, topk_idx, _ = make_inputs(seed, me, sizes[me], 128, 3)
    recv_stats = torch.full((NUM_EXPERTS // num_ranks,), 3, dtype=torch.int32)
    wait_stats = torch.zeros(num_ranks, dtype=torch.int64)
    for _ in range(2):
        buffer.low_latency_dispatch(x, topk_idx, T, NUM_EXPERTS, cumulative_local_expert_recv_stats=recv_stats,
                                    dispatch_wait_recv_cost_stats=wait_stats, use_fp8=False)
    layout, _ = expected_layout(seed, sizes, 128, 3, me, num_ranks)
    assert recv_stats.tolist() == [3 + 2 * len(rows) for rows in layout]
    assert wait_stats.dtype == torch.int64 and bool((wait_stats > 0).all())


def case_combine_buffers(group) -> None:
    """get_next_low_latency_combine_buffer alternates between two views; clean zeroes them."""
    num_ranks = group.size()
    buffer = make_buffer(group, 128)
    x, topk_idx, weights = make_inputs(0, group.rank(), T, 128, 2)
    packed, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, T, NUM_EXPERTS, use_fp8=False)
    first = buffer.get_next_low_latency_combine_buffer(handle)
    assert first.shape == (NUM_EXPERTS // num_ranks, num_ranks * T, 128) and first.dtype == torch.bfloat16
    assert buffer.get_next_low_latency_combine_buffer(handle).data_ptr() == first.data_ptr()
    first.copy_(packed)
    buffer.low_latency_combine(first, topk_idx, weights, handle, zero_copy=True)
    second = buffer.get_next_low_latency_combine_buffer(handle)
    assert second.data_ptr() != first.data_ptr()
    end_first = first.data_ptr() + first.numel() * 2
    assert second.data_ptr() >= end_first or second.data_ptr() + second.numel() * 2 <= first.data_ptr()
    buffer.low_latency_combine(packed, topk_idx, weights, handle)
    assert buffer.get_next_low_latency_combine_buffer(handle).data_ptr() == first.data_ptr()
    buffer.clean_low_latency_buffer(T, 128, NUM_EXPERTS)
    assert bool((first.float() == 0).all()) and bool((second.float() == 0).all())


def case_local_buffer_tensor(group) -> None:
    buffer = deep_ep.Buffer(group, num_nvl_bytes=4096, num_rdma_bytes=1024)
    ints = buffer.get_local_buffer_tensor(torch.int32, (4, 4), offset=64)
    ints.copy_(torch.arange(16, dtype=torch.int32).view(4, 4))
    as_bytes = buffer.get_local_buffer_tensor(torch.uint8, None, offset=0)
    assert as_bytes.shape == (4096,)
    assert torch.equal(as_bytes[64:128].view(torch.int32), torch.arange(16, dtype=torch.int32))
    rdma = buffer.get_local_buffer_tensor(torch.float32, None, offset=512, use_rdma_buffer=True)
    assert rdma.shape == (128,) and rdma.data_ptr() != as_bytes.data_ptr()
    with pytest.raises(InputError):
        buffer.get_local_buffer_tensor(torch.int32, (2,), offset=3)


def case_mismatch(group, field: str) -> str:
    me, last = group.rank(), group.rank() == group.size() - 1
    hidden = 256 if field == "hidden" and last else 128
    num_experts = 2 * NUM_EXPERTS if field == "num_experts" and last else NUM_EXPERTS
    buffer = deep_ep.Buffer(group, num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(
        T, 256, group.size(), 2 * NUM_EXPERTS), low_latency_mode=True)
    x, topk_idx, weights = make_inputs(0, me, T, hidden, 2)
    try:
        packed, _, handle, _, hook = buffer.low_latency_dispatch(x, topk_idx, T, num_experts, use_fp8=False,
                                                                 return_recv_hook=field == "before_hook")
        if field == "combine_topk":
            if last:
                topk_idx = torch.where(topk_idx == topk_idx.max(), -1, topk_idx)  # fewer pairs than dispatched
            buffer.low_latency_combine(packed, topk_idx, weights, handle)
        if field == "before_hook":
            buffer.low_latency_combine(packed, topk_idx, weights, handle)
    except InputError as error:
        return str(error)
    return "no error"


# ---------------------------------------------------------------------------- tests
@pytest.mark.parametrize("use_fp8,round_scale,use_ue8m0,hidden", [
    (False, False, False, 128), (True, False, False, 256), (True, True, False, 256), (True, True, True, 512)])
@pytest.mark.parametrize("num_topk", [1, 5])
def test_dispatch_layout(pool: RankPool, use_fp8: bool, round_scale: bool, use_ue8m0: bool, hidden: int,
                         num_topk: int) -> None:
    pool.run(case_dispatch_layout, 7 + num_topk, hidden, num_topk, use_fp8, round_scale, use_ue8m0)


@pytest.mark.parametrize("zero_copy,use_out,hook_mode", [
    (False, False, False), (True, False, False), (False, True, False), (False, False, True), (True, True, True)])
def test_round_trip(pool: RankPool, zero_copy: bool, use_out: bool, hook_mode: bool) -> None:
    pool.run(case_round_trip, 2, 256, zero_copy, use_out, hook_mode)


@pytest.mark.parametrize("round_scale,use_ue8m0", [(False, False), (True, False), (True, True)])
def test_fp8_round_trip(pool: RankPool, round_scale: bool, use_ue8m0: bool) -> None:
    pool.run(case_fp8_round_trip, 5, round_scale, use_ue8m0)


def test_hook_two_batches(pool: RankPool) -> None:
    pool.run(case_hook_two_batches, 8)


def test_stats(pool: RankPool) -> None:
    pool.run(case_stats, 4)


def test_combine_buffers(pool: RankPool) -> None:
    pool.run(case_combine_buffers)


def test_local_buffer_tensor(pool: RankPool) -> None:
    pool.run(case_local_buffer_tensor)


@pytest.mark.parametrize("field,needle", [("hidden", "hidden"), ("num_experts", "num_experts"),
                                          ("combine_topk", "topk_idx"), ("before_hook", "hook")])
def test_mismatched_ranks_raise_everywhere(pool: RankPool, field: str, needle: str) -> None:
    if pool.num_ranks == 1 and field in ("hidden", "num_experts"):
        pytest.skip("needs two ranks to disagree")
    messages = pool.run(case_mismatch, field)
    assert all(needle in message for message in messages), messages
