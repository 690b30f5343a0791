"""FP8 (e4m3) quantisation of a tile of rows, inside a Triton kernel.

The same rules as ``tritonep.fp8.cast_to_fp8`` (the CPU backend's): per row, per 128
channels, ``scale = max(amax, 1e-4) / 448``, optionally rounded up to a power of two, and
``x / scale`` rounded to nearest-even e4m3. Both divisions are IEEE-exact (``div_rn``), so
the GPU kernels and the CPU backend produce the same bytes.

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
def quantize_rows(values, ROWS: tl.constexpr, HIDDEN_PAD: tl.constexpr, ROUND_SCALE: tl.constexpr,
                  GPU: tl.constexpr):
    """float32 [ROWS, HIDDEN_PAD] -> (int32 [ROWS, HIDDEN_PAD // 4] packed e4m3 bytes, channel 4i+j
    in byte j of word i; float32 [ROWS, HIDDEN_PAD // 128] scales). Padding columns must be 0."""
    GROUPS: tl.constexpr = HIDDEN_PAD // 128
    grouped = tl.reshape(values, (ROWS, GROUPS, 128))
    amax = tl.maximum(tl.max(tl.abs(grouped), axis=2), 1e-4)
    scales = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
    if ROUND_SCALE:
        # 2**ceil(log2(scale)): bump the exponent unless the mantissa is already zero.
        scale_bits = scales.to(tl.int32, bitcast=True)
        scales = ((scale_bits + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)
    scaled = tl.math.div_rn(grouped, tl.broadcast_to(scales[:, :, None], (ROWS, GROUPS, 128)))
    scaled = tl.reshape(scaled, (ROWS, HIDDEN_PAD))
    if GPU:
        fp8_bytes = scaled.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        fp8_bytes = _e4m3_bits_exact(scaled)
    return pack_bytes(fp8_bytes, ROWS, HIDDEN_PAD), scales


@triton.jit
def pack_bytes(byte_values, ROWS: tl.constexpr, COLUMNS: tl.constexpr):
    """int32 [ROWS, COLUMNS] holding bytes -> int32 [ROWS, COLUMNS // 4], column 4i+j in byte j."""
    quads = tl.reshape(byte_values & 0xFF, (ROWS, COLUMNS // 4, 4))
    shifts = (tl.arange(0, 4) * 8)[None, None, :]
    return tl.sum(quads << shifts, axis=2)
