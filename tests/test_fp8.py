"""tritonep.core.fp8 against references written out element by element (Python floats, bit ops)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tritonep.core import fp8

E4M3_MAX = 448.0


def reference_scales(x: torch.Tensor, round_scale: bool) -> list[list[float]]:
    """Per row, per 128 channels: max(amax, 1e-4) / 448 in float32, optionally 2**ceil(log2)."""
    return [[scale for scale, _ in row] for row in reference_scales_and_factors(x, round_scale)]


def reference_scales_and_factors(x: torch.Tensor, round_scale: bool) -> list[list[tuple[float, float]]]:
    """Per row, per 128 channels: (scale, the factor x is multiplied by before the e4m3 cast):
    (1 / max(amax, 1e-4)) * 448 in float32, or 1 / scale (exact) with rounded scales."""
    rows = []
    for row in x.float().tolist():
        pairs = []
        for start in range(0, len(row), 128):
            amax = torch.tensor(max(max(abs(v) for v in row[start:start + 128]), 1e-4), dtype=torch.float32)
            scale = (amax / torch.tensor(448.0)).item()
            factor = (torch.tensor(1.0) / amax * torch.tensor(448.0)).item()   # two float32 roundings
            if round_scale:
                mantissa, exponent = math.frexp(scale)  # exact in float64
                scale = 2.0 ** (exponent - 1 if mantissa == 0.5 else exponent)
                factor = 1.0 / scale
            pairs.append((scale, factor))
        rows.append(pairs)
    return rows


def random_x(seed: int, rows: int, hidden: int, spread: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g) * torch.exp(torch.randn(rows, hidden // 128, 1, generator=g)
                                                           * spread).repeat_interleave(128, 1).view(rows, hidden)
    return x.bfloat16()


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(0, 5), groups=st.integers(1, 8),
       spread=st.sampled_from([0.0, 2.0, 6.0]), round_scale=st.booleans())
def test_scales_and_values(seed: int, rows: int, groups: int, spread: float, round_scale: bool) -> None:
    x = random_x(seed, rows, groups * 128, spread)
    x_fp8, scales = fp8.cast_to_fp8(x, round_scale=round_scale)
    assert x_fp8.dtype == torch.float8_e4m3fn and x_fp8.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == (rows, groups)
    pairs = reference_scales_and_factors(x, round_scale)
    expected = [[scale for scale, _ in row] for row in pairs]
    assert scales.tolist() == expected
    # Values: x * factor rounded to e4m3; |x * factor| <= 448 up to float32 rounding of the
    # product (which then rounds to 448 in e4m3), error within e4m3 rounding.
    per_channel = torch.tensor(expected).repeat_interleave(128, 1) if rows else torch.zeros(0, groups * 128)
    factors = torch.tensor([[factor for _, factor in row] for row in pairs], dtype=torch.float32)
    per_channel_factor = factors.repeat_interleave(128, 1) if rows else torch.zeros(0, groups * 128)
    scaled = x.float() * per_channel_factor
    assert scaled.abs().max().item() <= E4M3_MAX * (1 + 2 ** -20) if rows else True
    assert torch.equal(x_fp8.float(), scaled.to(torch.float8_e4m3fn).float())
    back = fp8.cast_back(x_fp8, scales)
    assert back.dtype == torch.bfloat16
    error = (back.float() - x.float()).abs()
    bound = x.float().abs() * (2 ** -4 + 2 ** -8) + per_channel * 2 ** -9
    assert bool((error <= bound).all())


@pytest.mark.parametrize("round_scale", [False, True])
def test_round_scale_powers_of_two(round_scale: bool) -> None:
    x = random_x(3, 16, 512, 4.0)
    _, scales = fp8.cast_to_fp8(x, round_scale=round_scale)
    amax_scale = torch.tensor(reference_scales(x, False))
    exponent = torch.log2(scales.double())
    is_power = bool((exponent == exponent.round()).all())
    if round_scale:
        assert is_power
        assert bool((scales >= amax_scale).all()) and bool((scales < 2 * amax_scale).all())
    else:
        assert not is_power and torch.equal(scales, amax_scale)


def test_exact_power_of_two_not_rounded_up() -> None:
    x = torch.zeros(2, 128)
    x[0, 5] = 448.0 * 4  # scale exactly 4
    x[1, 7] = -448.0 / 8  # scale exactly 1/8
    _, scales = fp8.cast_to_fp8(x.bfloat16(), round_scale=True)
    assert scales.view(-1).tolist() == [4.0, 0.125]


def test_zero_rows_use_the_floor() -> None:
    x_fp8, scales = fp8.cast_to_fp8(torch.zeros(3, 256, dtype=torch.bfloat16))
    expected = (torch.tensor(1e-4, dtype=torch.float32) / 448.0).item()
    assert scales.unique().tolist() == [expected]
    assert x_fp8.float().abs().sum().item() == 0


def manual_unpack(packed: torch.Tensor) -> list[list[float]]:
    rows = []
    for row in packed.tolist():
        values = []
        for word in row:
            word &= 0xFFFFFFFF
            for byte in range(4):
                values.append(2.0 ** (((word >> (8 * byte)) & 0xFF) - 127))
        rows.append(values)
    return rows


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(1, 4), words=st.integers(1, 3),
       spread=st.sampled_from([0.0, 3.0, 8.0]))
def test_ue8m0_packing(seed: int, rows: int, words: int, spread: float) -> None:
    x = random_x(seed, rows, words * 512, spread)
    x_fp8, packed = fp8.cast_to_fp8(x, round_scale=True, use_ue8m0=True)
    assert packed.dtype == torch.int32 and packed.shape == (rows, words)
    expected = reference_scales(x, True)
    assert manual_unpack(packed) == expected
    assert fp8.unpack_ue8m0(packed).tolist() == expected
    # Dequantising with packed or float scales gives the same bf16.
    _, float_scales = fp8.cast_to_fp8(x, round_scale=True)
    assert torch.equal(fp8.cast_back(x_fp8, packed), fp8.cast_back(x_fp8, float_scales))


def test_ue8m0_byte_order_and_sign() -> None:
    # Group g of a row has scale 2**(g - 1): bytes 126, 127, 128, 129 -> lowest byte first.
    scales = torch.tensor([[0.5, 1.0, 2.0, 4.0]])
    packed = fp8.pack_ue8m0(scales)
    expected = 126 | (127 << 8) | (128 << 16) | (129 << 24)
    assert packed.item() == expected - (1 << 32)  # top byte >= 128: negative int32
    assert fp8.unpack_ue8m0(packed).tolist() == scales.tolist()


def test_column_major_and_leading_dims() -> None:
    x = random_x(7, 6, 384, 2.0)
    x_fp8, scales = fp8.cast_to_fp8(x)
    column_major = scales.t().contiguous().t()
    assert not column_major.is_contiguous()
    assert torch.equal(fp8.cast_back(x_fp8, column_major), fp8.cast_back(x_fp8, scales))
    x3 = x.view(2, 3, 384)
    x3_fp8, scales3 = fp8.cast_to_fp8(x3)
    assert scales3.shape == (2, 3, 3)
    assert torch.equal(x3_fp8.view(6, 384).float(), x_fp8.float())
    packed = fp8.cast_to_fp8(random_x(1, 6, 512, 1.0).view(3, 2, 512), use_ue8m0=True)[1]
    assert packed.shape == (3, 2, 1)
    assert fp8.unpack_ue8m0(packed.transpose(0, 1)).shape == (2, 3, 4)
    # Column-major [N, 1] packed scales (hidden 512, as low-latency dispatch returns them).
    x512 = random_x(2, 5, 512, 3.0)
    x512_fp8, packed = fp8.cast_to_fp8(x512, round_scale=True, use_ue8m0=True)
    column = torch.empty(1, 5, dtype=torch.int32).copy_(packed.t()).t()
    assert column.stride() == (1, 5)
    assert torch.equal(fp8.unpack_ue8m0(column), fp8.unpack_ue8m0(packed))
    assert torch.equal(fp8.cast_back(x512_fp8, column), fp8.cast_back(x512_fp8, packed))


def test_hidden_must_be_multiple_of_128() -> None:
    with pytest.raises(ValueError, match="multiple of 128"):
        fp8.cast_to_fp8(torch.zeros(2, 100, dtype=torch.bfloat16))
