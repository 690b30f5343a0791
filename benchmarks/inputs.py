"""The problems every mode measures, made the same way in every mode and package: DeepEP's
normal-mode routing (random scores, top-k experts, random weights) and its decode batch."""

from __future__ import annotations

import torch


def routing(tokens: int, hidden: int, experts: int, topk: int, rank: int,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x bf16 [tokens, hidden], topk_idx [tokens, topk], topk_weights float32) for one rank."""
    generator = torch.Generator().manual_seed(1234 + rank)
    cpu32 = dict(generator=generator, dtype=torch.float32, device="cpu")
    x = torch.randn(tokens, hidden, **cpu32).to(torch.bfloat16)
    topk_idx = (torch.randn(tokens, experts, **cpu32).abs() + 1).topk(topk, dim=-1).indices
    topk_weights = torch.rand(tokens, topk, **cpu32)
    return x.to(device), topk_idx.to(device), topk_weights.to(device)


def decode_batch(tokens: int, hidden: int, experts: int, topk: int, rank: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The low-latency problem for one rank: (x bf16 [tokens, hidden], topk_idx, weights)."""
    generator = torch.Generator().manual_seed(7 + rank)
    cpu32 = dict(generator=generator, dtype=torch.float32, device="cpu")
    x = torch.randn(tokens, hidden, **cpu32).to(torch.bfloat16)
    topk_idx = torch.rand(tokens, experts, **cpu32).topk(topk, dim=1).indices
    weights = torch.rand(tokens, topk, **cpu32)
    return x.to(device), topk_idx.to(device), weights.to(device)


def expert_output(packed_shape: torch.Size, rank: int, device: torch.device) -> torch.Tensor:
    """Random bf16 rows standing for the experts' output, the combine's input in low-latency mode."""
    generator = torch.Generator().manual_seed(11 + rank)
    return torch.randn(packed_shape, generator=generator, dtype=torch.float32).to(torch.bfloat16).to(device)


def nvl_bytes(tokens: int, hidden: int, num_ranks: int) -> int:
    """``num_nvl_bytes`` for a normal-mode Buffer where every rank may receive every rank's tokens:
    dispatch and combine rows of ``hidden`` bf16 channels with room for their metadata, and slack."""
    return 2 * tokens * num_ranks * (hidden * 2 + 256) + (64 << 20)
