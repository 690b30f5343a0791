"""FP8 (e4m3) quantisation of a tile of rows, inside a Triton kernel.

The same rules as ``tritonep.fp8.cast_to_fp8`` (the CPU backend's): per row, per 128
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
def cast_rows_to_messages(x_ptr, tokens, x_row_stride, row_ok, messages, HIDDEN: tl.constexpr,
                          SCALES_AT: tl.constexpr, ROUND_SCALE: tl.constexpr, GROUPS: tl.constexpr,
                          GPU: tl.constexpr):
    """Cast bf16 rows ``tokens`` of ``x`` to e4m3 and write them into ``messages`` (int32 [ROWS]
    pointers, one message each): channel c as byte c of the message, the float32 scale of
    group g as word ``SCALES_AT + g``. Rows with ``row_ok`` False are skipped.

    The row is walked in chunks of ``GROUPS`` groups of 128 channels, loaded straight into a
    [ROWS, GROUPS, 128] tile: the amax of a group is a reduction over the last axis, with no
    reshape (reshapes of whole rows made the compiler shuffle registers through shared memory).
    Whole rows in one chunk measured fastest (more loads in flight); smaller chunks are there
    for wider rows or tighter register budgets."""
    lanes = tl.arange(0, 128)
    group_in_chunk = tl.arange(0, GROUPS)
    sources = x_ptr + tokens.to(tl.int64)[:, None, None] * x_row_stride
    # Messages start on 16-byte boundaries (whole 4-word units in 4096-aligned slots): saying so
    # lets the compiler store the bytes in wide vectors.
    destinations = tl.multiple_of(messages.to(tl.pointer_type(tl.uint8)), 16)[:, None, None]
    for chunk_start in range(0, HIDDEN, GROUPS * 128):
        columns = (chunk_start + group_in_chunk[:, None] * 128 + lanes[None, :])[None, :, :]
        ok = row_ok[:, None, None] & (columns < HIDDEN)
        values = tl.load(sources + columns, mask=ok, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(values), axis=2), 1e-4)
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
        scaled = values * factors[:, :, None]
        if GPU:
            fp8_bytes = scaled.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            fp8_bytes = _e4m3_bits_exact(scaled).to(tl.uint8)
        tl.store(destinations + columns, fp8_bytes, mask=ok)
        groups = chunk_start // 128 + group_in_chunk
        tl.store(messages[:, None] + SCALES_AT + groups[None, :], scales.to(tl.int32, bitcast=True),
                 mask=row_ok[:, None] & (groups < HIDDEN // 128)[None, :])


@triton.jit
def pack_bytes(byte_values, ROWS: tl.constexpr, COLUMNS: tl.constexpr):
    """int32 [ROWS, COLUMNS] holding bytes -> int32 [ROWS, COLUMNS // 4], column 4i+j in byte j."""
    quads = tl.reshape(byte_values & 0xFF, (ROWS, COLUMNS // 4, 4))
    shifts = (tl.arange(0, 4) * 8)[None, None, :]
    return tl.sum(quads << shifts, axis=2)
