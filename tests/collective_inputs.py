"""Random routing shared by the collective-backend tests (each rank regenerates any rank's
inputs from ``(seed, rank)``, so references can be built for every source)."""

from __future__ import annotations

import torch


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
