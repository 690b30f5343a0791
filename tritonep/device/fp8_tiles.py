"""FP8 (e4m3) quantisation of a tile of rows, inside a Triton kernel.

The same rules as ``tritonep.core.fp8.cast_to_fp8`` (the CPU backend's): per row, per 128
channels, ``scale = max(amax, 1e-4) / 448``, optionally rounded up to a power of two, and
``x * ((1 / amax) * 448)`` (or ``x * (1 / scale)`` with rounded scales) rounded to
nearest-even e4m3. The divisions are IEEE-exact (``div_rn``) and the products IEEE too, so the GPU
kernels and the CPU backend produce the same bytes.

On GPUs the conversion is the hardware's ``cvt.rn.satfinite``. Triton's interpreter rounds
fp8 ties away from zero and mishandles mantissa carries, so under ``TRITON_INTERPRET`` the
conversion is done with integer operations instead (``_e4m3_bits_exact``), which keeps the
CPU tests bit-exact.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _round_shift(value, shift):
    """``value >> shift`` rounded to nearest, ties to even (``value`` >= 0, 0 < ``shift`` < 32)."""
    kept = value >> shift
    rest = value - (kept << shift)
    half = 1 << (shift - 1)
    up = (rest > half) | ((rest == half) & ((kept & 1) == 1))
    return kept + up.to(tl.int32)


@triton.jit
def _e4m3_bits_exact(values):
    """float32 -> e4m3fn byte (as int32), round-to-nearest-even, saturating at 448."""
    bits = values.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    exponent = ((bits >> 23) & 0xFF) - 127
    mantissa = bits & 0x7FFFFF
    # Normal e4m3 (exponent >= -6): keep 3 mantissa bits; a carry into the exponent is fine.
    normal = ((exponent + 7) << 3) + _round_shift(mantissa, 20)
    normal = tl.minimum(normal, 0x7E)   # 448 is the largest finite e4m3fn value
    # Subnormal e4m3 (units of 2**-9): the full 24-bit significand shifted right.
    shift = tl.minimum(14 - exponent, 31)
    subnormal = _round_shift(mantissa | 0x800000, tl.maximum(shift, 1))
    subnormal = tl.where(exponent < -30, 0, subnormal)
    magnitude = tl.where(exponent >= -6, normal, subnormal)
    return sign | magnitude


@triton.jit
def cast_row(row_ptr, present, HIDDEN: tl.constexpr, GROUPS_PAD: tl.constexpr, ROUND_SCALE: tl.constexpr,
             GPU: tl.constexpr):
    """Cast one bf16 row of ``HIDDEN`` channels to e4m3: returns the bytes as uint8
    [GROUPS_PAD, 128] (channel ``128 g + i`` at [g, i]; pad groups hold junk) and the float32
    scales [GROUPS_PAD], one per 128 channels. Where ``present`` is False nothing is loaded
    (the row may not exist) and the result is junk.

    The row is loaded straight into a [groups, 128] tile, so a group's amax is a reduction over
    the last axis with no reshape (reshapes of whole rows made the compiler shuffle registers
    through shared memory)."""
    columns = tl.arange(0, GROUPS_PAD)[:, None] * 128 + tl.arange(0, 128)[None, :]
    values = tl.load(row_ptr + columns, mask=(columns < HIDDEN) & present, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(values), axis=1), 1e-4)
    scales = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
    if ROUND_SCALE:
        # 2**ceil(log2(scale)): bump the exponent unless the mantissa is already zero.
        scale_bits = scales.to(tl.int32, bitcast=True)
        scales = ((scale_bits + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)
        factors = tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), scales)   # exact
    else:
        factors = tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), amax) * 448.0
    # One division per group, then products (IEEE, like the CPU backend's): a division per
    # channel cost more than the rest of the cast.
    scaled = values * factors[:, None]
    if GPU:
        fp8_bytes = scaled.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        fp8_bytes = _e4m3_bits_exact(scaled).to(tl.uint8)
    return fp8_bytes, scales


@triton.jit
def pack_bytes(byte_values, ROWS: tl.constexpr, COLUMNS: tl.constexpr):
    """int32 [ROWS, COLUMNS] holding bytes -> int32 [ROWS, COLUMNS // 4], column 4i+j in byte j."""
    quads = tl.reshape(byte_values & 0xFF, (ROWS, COLUMNS // 4, 4))
    shifts = (tl.arange(0, 4) * 8)[None, None, :]
    return tl.sum(quads << shifts, axis=2)
