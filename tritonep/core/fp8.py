"""FP8 (e4m3) casts shared by every backend, ``utils`` and the tests.

One definition of the rounding rules means the CPU backend, the NVLink kernels and the test
references cannot drift apart. Plain torch, so it runs on CPU and CUDA tensors alike.

Layout: per token, per group of 128 channels, ``scale = max(amax, 1e-4) / 448`` (float32),
``x_fp8 = x * ((1 / max(amax, 1e-4)) * 448)`` cast to e4m3: one reciprocal per group, then
products, as DeepEP's ``per_token_cast_to_fp8`` computes it (``448.0 / amax`` in torch). With ``round_scale`` the scale
is rounded *up* to a power of two and the factor is its exact inverse, so ``x * factor`` never
exceeds 448. With ``use_ue8m0`` (power-of-two scales
only) each scale ``2**k`` is stored as the byte ``k + 127`` and four bytes are packed into one
int32, group 0 in the lowest byte (DeepEP's UE8M0 layout).
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
GROUP = 128
MIN_AMAX = 1e-4


def _row_major(tensor: torch.Tensor) -> torch.Tensor:
    """A row-major copy for dtype views. ``.contiguous()`` is not enough: it keeps any stride on
    size-1 dimensions (a column-major [N, 1] scale tensor counts as contiguous)."""
    return tensor.clone(memory_format=torch.contiguous_format)


def _groups(x: torch.Tensor) -> torch.Tensor:
    """[..., H] -> [..., H/128, 128] float32 view of the channel groups."""
    hidden = x.shape[-1]
    if hidden % GROUP != 0:
        raise ValueError(f"fp8 casts need hidden to be a multiple of {GROUP}, got {hidden}")
    return x.float().reshape(*x.shape[:-1], hidden // GROUP, GROUP)


def round_up_to_power_of_two(scale: torch.Tensor) -> torch.Tensor:
    """``2**ceil(log2(scale))`` computed exactly for positive float32 ``scale``.

    ``frexp`` gives ``scale = m * 2**e`` with m in [0.5, 1): the answer is ``2**(e-1)`` when m is
    exactly 0.5 (already a power of two), else ``2**e``. A float ``log2`` can round a value just
    above a power of two down onto it, which would let ``x * (1 / scale)`` overflow 448.
    """
    mantissa, exponent = torch.frexp(scale)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    # ldexp computes 2**exponent in the default dtype for an integer exponent (bf16 for callers
    # that set it; exact for powers of two, but nothing here should depend on the default).
    return torch.ldexp(torch.ones_like(scale), exponent.to(scale.dtype))


def pack_ue8m0(scales: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 scales [..., G] -> int32 [..., ceil(G/4)], 4 exponent bytes each.

    Byte ``k + 127`` encodes ``2**k``; group 4*i + j sits in byte j (j=0 lowest) of int32 i.
    Missing groups (G not a multiple of 4) are padded with byte 0.
    """
    _, exponent = torch.frexp(scales)
    biased = (exponent.to(torch.int32) - 1 + 127).clamp(0, 255)
    groups = scales.shape[-1]
    padded = (groups + 3) // 4 * 4
    if padded != groups:
        pad = torch.zeros(*scales.shape[:-1], padded - groups, dtype=biased.dtype, device=biased.device)
        biased = torch.cat([biased, pad], dim=-1)
    # Little-endian byte order (x86, ARM, NVIDIA GPUs): byte 0 of an int32 is its lowest byte.
    return _row_major(biased.to(torch.uint8)).view(torch.int32)


def unpack_ue8m0(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., C] packed exponents -> float32 scales [..., 4*C] (``2**(byte - 127)``).

    Accepts any strides (the low-latency scales are column-major).
    """
    exponent_bytes = _row_major(packed).view(torch.uint8)
    return torch.exp2(exponent_bytes.float() - 127.0)


def cast_to_fp8(
    x: torch.Tensor, round_scale: bool = False, use_ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x`` [..., H] (any float dtype) to e4m3 with one scale per 128 channels.

    Returns ``(x_fp8 [..., H] float8_e4m3fn, scales)`` where scales is float32 [..., H/128], or
    with ``use_ue8m0`` int32 [..., ceil(H/512)] packed exponents (implies power-of-two scales).
    """
    grouped = _groups(x)
    amax = grouped.abs().amax(dim=-1).clamp(min=MIN_AMAX)
    scale = amax / FP8_MAX
    if round_scale or use_ue8m0:
        scale = round_up_to_power_of_two(scale)
        factor = 1.0 / scale   # exact: scale is a power of two
    else:
        # What ``448.0 / amax`` evaluates to in torch (a reciprocal, then a product), as DeepEP's
        # per_token_cast_to_fp8 writes it; spelt out so the kernels can match it bit for bit.
        factor = amax.reciprocal() * FP8_MAX
    x_fp8 = (grouped * factor.unsqueeze(-1)).to(FP8_DTYPE).reshape(x.shape)
    if use_ue8m0:
        return x_fp8, pack_ue8m0(scale)
    return x_fp8, scale


def scales_as_float(scales: torch.Tensor, hidden: int) -> torch.Tensor:
    """float32 [..., H/128] scales from float32 or packed-int32 ``scales``."""
    groups = hidden // GROUP
    if scales.dtype == torch.int32:
        return unpack_ue8m0(scales)[..., :groups]
    return scales.float()


def cast_back(x_fp8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Dequantise ``x_fp8`` [..., H] with float32 [..., H/128] or packed int32 scales -> bf16."""
    hidden = x_fp8.shape[-1]
    grouped = _groups(x_fp8)
    factors = scales_as_float(scales, hidden)
    return (grouped * factors.unsqueeze(-1)).reshape(x_fp8.shape).to(torch.bfloat16)
