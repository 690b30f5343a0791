"""Random routing shared by the collective-backend tests (each rank regenerates any rank's
inputs from ``(seed, rank)``, so references can be built for every source), and the stand-in
expert of the low-latency tests with its brute-force combine."""

from __future__ import annotations

import torch

from tritonep.core import fp8


def random_routing(generator: torch.Generator, num_tokens: int, num_experts: int, num_topk: int,
                   drop: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct top-k experts per token, a ``drop`` share of slots set to -1, and weights."""
    # dtype and device explicit: ranks may run under other torch defaults (tests/torch_defaults.py).
    cpu32 = dict(generator=generator, dtype=torch.float32, device="cpu")
    scores = torch.rand(num_tokens, num_experts, **cpu32)
    topk_idx = scores.topk(num_topk, dim=1).indices if num_tokens else torch.zeros(0, num_topk, dtype=torch.int64)
    topk_idx = torch.where(torch.rand(num_tokens, num_topk, **cpu32) < drop, -1, topk_idx)
    weights = torch.rand(num_tokens, num_topk, **cpu32)
    return topk_idx, weights


def odd_strides_if_empty(x: torch.Tensor, hidden: int) -> torch.Tensor:
    """Empty tensors may carry any strides (here 0): the backend must cope."""
    return torch.zeros(0, 1, dtype=x.dtype).expand(0, hidden) if x.shape[0] == 0 else x


def dequantised(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 rows from e4m3 ``data`` [..., H] and float32 ``scales`` [..., H/128]."""
    return (data.float().view(*data.shape[:-1], data.shape[-1] // 128, 128) * scales.unsqueeze(-1)).view(data.shape)


def dispatched_rows(x: torch.Tensor, use_fp8: bool) -> torch.Tensor:
    """float32: the rows of ``x`` as a low-latency dispatch hands them to the experts, through
    the e4m3 cast (tritonep.core.fp8's rounding, default scales) and back with ``use_fp8``."""
    return dequantised(*fp8.cast_to_fp8(x)) if use_fp8 else x.float()


def stand_in_expert(packed, use_fp8: bool, me: int) -> torch.Tensor:
    """Low-latency expert outputs: each (dequantised) row times (its global expert id + 1), so
    rows given to the wrong expert show. ``packed`` is packed_recv_x ([E/R, R*T, H]; with fp8
    the (data, float32 scales) pair)."""
    rows = dequantised(*packed) if use_fp8 else packed.float()
    per_rank = rows.shape[0]
    factor = torch.arange(1, per_rank + 1, dtype=torch.float32, device="cpu").view(-1, 1, 1) + me * per_rank
    return (rows * factor).bfloat16()


def brute_force_combine(x: torch.Tensor, topk_idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """float32 sum over k of weights[t, k] * stand-in expert topk_idx[t, k] applied to x[t] (the
    rows as dispatched: ``dispatched_rows``)."""
    total = torch.zeros(x.shape, dtype=torch.float32, device="cpu")
    for t in range(x.shape[0]):
        for k in range(topk_idx.shape[1]):
            e = int(topk_idx[t, k])
            if e >= 0:
                total[t] += weights[t, k] * (x[t].float() * (e + 1)).bfloat16().float()
    return total
