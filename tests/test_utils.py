"""tritonep.utils: DeepEP's test helpers behave as DeepEP's do."""

from __future__ import annotations

import math
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import tritonep as deep_ep
from tritonep.utils import bench, calc_diff, hash_tensor, inplace_unique, per_token_cast_back, per_token_cast_to_fp8


def test_exported_like_deep_ep() -> None:
    for name in ("per_token_cast_to_fp8", "per_token_cast_back", "calc_diff", "bench", "inplace_unique",
                 "hash_tensor"):
        assert callable(getattr(deep_ep.utils, name))


# ---------------------------------------------------------------- calc_diff
def test_calc_diff_identical_and_zero() -> None:
    x = torch.randn(64, 32, dtype=torch.bfloat16)
    assert calc_diff(x, x) == pytest.approx(0.0, abs=1e-12)
    # The +1 shift keeps two all-zero tensors well defined.
    assert calc_diff(torch.zeros(8), torch.zeros(8)) == 0.0


def test_calc_diff_matches_formula_and_is_symmetric() -> None:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(100, generator=g), torch.randn(100, generator=g)
    xs, ys = x.double() + 1, y.double() + 1
    expected = 1 - 2 * (xs * ys).sum().item() / (xs * xs + ys * ys).sum().item()
    assert isinstance(calc_diff(x, y), float)
    assert calc_diff(x, y) == pytest.approx(expected, rel=1e-12)
    assert calc_diff(x, y) == pytest.approx(calc_diff(y, x), rel=1e-12)


def test_calc_diff_grows_with_error() -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    assert calc_diff(x, x * 1.001) < calc_diff(x, x * 1.1) < calc_diff(x, -x)


# ---------------------------------------------------------------- inplace_unique
def reference_unique(row: list[int], num_slots: int) -> list[int]:
    values = sorted({v for v in row if v >= 0}, reverse=True)
    keep = min(num_slots, len(row))
    out = values[:keep]
    return out + [-1] * (len(row) - len(out))


@given(st.data())
def test_inplace_unique_matches_reference(data: st.DataObject) -> None:
    num_slots = data.draw(st.integers(1, 12))
    rows = data.draw(st.integers(0, 6))
    cols = data.draw(st.integers(1, 10))
    values = data.draw(st.lists(st.lists(st.integers(-1, num_slots - 1), min_size=cols, max_size=cols),
                                min_size=rows, max_size=rows))
    x = torch.tensor(values, dtype=torch.int64).reshape(rows, cols)
    inplace_unique(x, num_slots)
    assert x.tolist() == [reference_unique(row, num_slots) for row in values]


def test_inplace_unique_deep_ep_usage() -> None:
    # DeepEP's tests: map top-k expert ids to ranks, then deduplicate per token.
    topk_idx = torch.tensor([[0, 5, 1, -1], [7, 6, 4, 5], [-1, -1, -1, -1]])
    rank_idx = topk_idx // 2  # 8 experts on 4 ranks
    rank_idx.masked_fill_(topk_idx == -1, -1)
    inplace_unique(rank_idx, 4)
    assert rank_idx.tolist() == [[2, 0, -1, -1], [3, 2, -1, -1], [-1, -1, -1, -1]]


def test_inplace_unique_int32_and_wide_rows() -> None:
    x = torch.tensor([[1, 1, 0, 1, -1, 0]], dtype=torch.int32)
    inplace_unique(x, 2)  # more columns than slots: everything past num_slots is -1
    assert x.dtype == torch.int32
    assert x.tolist() == [[1, 0, -1, -1, -1, -1]]


# ---------------------------------------------------------------- hash_tensor
def test_hash_tensor_deterministic_and_content_sensitive() -> None:
    x = torch.randn(33, 7, generator=torch.Generator().manual_seed(2)).bfloat16()
    h = hash_tensor(x)
    assert isinstance(h, int)
    assert h == hash_tensor(x.clone())
    y = x.clone()
    y[3, 4] += 1
    assert hash_tensor(y) != h


def test_hash_tensor_any_size_dtype_and_layout() -> None:
    for t in (torch.zeros(0), torch.tensor(3.0), torch.arange(5, dtype=torch.uint8),
              torch.ones(3, dtype=torch.bool), torch.randn(4, 6).t()):
        assert hash_tensor(t) == hash_tensor(t.contiguous().clone())
    # Non-contiguous input hashes its logical contents.
    m = torch.randn(4, 6)
    assert hash_tensor(m.t()) == hash_tensor(m.t().contiguous())


def test_hash_tensor_is_order_insensitive_over_words() -> None:
    # DeepEP's low-latency tests rely on this: source blocks may arrive in another order.
    x = torch.arange(16, dtype=torch.int64)
    assert hash_tensor(x) == hash_tensor(x.flip(0)) == int(x.sum())


# ---------------------------------------------------------------- bench
def test_bench_counts_calls_and_orders_stats() -> None:
    calls, posts = [], []
    avg, low, high = bench(lambda: calls.append(1), num_warmups=3, num_tests=5,
                           post_fn=lambda: posts.append(1))
    assert len(calls) == 8 and len(posts) == 5
    assert 0 <= low <= avg <= high


def test_bench_measures_time() -> None:
    avg, low, high = bench(lambda: time.sleep(0.002), num_warmups=1, num_tests=4)
    assert low >= 0.0015 and avg < 1.0


def test_bench_single_test() -> None:
    avg, low, high = bench(lambda: None, num_warmups=0, num_tests=1)
    assert math.isfinite(avg) and low <= avg <= high


# ---------------------------------------------------------------- fp8 helpers
def deep_ep_reference_cast(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepEP's per_token_cast_to_fp8, written out."""
    m, n = x.shape
    view = x.view(m, -1, 128)
    amax = view.abs().float().amax(dim=2).clamp(1e-4)
    return (view * (448.0 / amax.unsqueeze(2))).to(torch.float8_e4m3fn).view(m, n), amax / 448.0


def test_fp8_cast_shapes_and_round_trip() -> None:
    x = torch.randn(17, 384, generator=torch.Generator().manual_seed(3)).bfloat16()
    x_fp8, scales = per_token_cast_to_fp8(x)
    assert x_fp8.dtype == torch.float8_e4m3fn and x_fp8.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == (17, 3)
    back = per_token_cast_back(x_fp8, scales)
    assert back.dtype == torch.bfloat16 and back.shape == x.shape
    assert calc_diff(back, x) < 1e-3


def test_fp8_cast_matches_deep_ep() -> None:
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(4)).bfloat16()
    x[2] = 0  # all-zero rows take the 1e-4 floor
    x_fp8, scales = per_token_cast_to_fp8(x)
    ref_fp8, ref_scales = deep_ep_reference_cast(x)
    # The same arithmetic (amax / 448 for the scale, x * (448 / amax) for the values): the same bits.
    assert torch.equal(scales, ref_scales)
    assert torch.equal(x_fp8.view(torch.uint8), ref_fp8.view(torch.uint8))


def test_fp8_cast_back_column_major_and_empty() -> None:
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(5)).bfloat16()
    x_fp8, scales = per_token_cast_to_fp8(x)
    column_major = scales.t().contiguous().t()
    assert torch.equal(per_token_cast_back(x_fp8, column_major), per_token_cast_back(x_fp8, scales))
    empty = per_token_cast_back(x_fp8[:0], scales[:0])
    assert empty.shape == (0, 256) and empty.dtype == torch.bfloat16


def test_fp8_cast_back_ue8m0_packed_scales() -> None:
    g = torch.Generator().manual_seed(6)
    exponents = torch.randint(100, 140, (3, 8), generator=g, dtype=torch.int32)  # 8 blocks = H 1024
    packed = exponents.to(torch.uint8).view(torch.int32)  # [3, 2]: four exponent bytes per int32
    floats = torch.pow(2.0, (exponents - 127).float())
    x_fp8 = torch.randn(3, 1024, generator=g).to(torch.float8_e4m3fn)
    assert torch.equal(per_token_cast_back(x_fp8, packed), per_token_cast_back(x_fp8, floats))
