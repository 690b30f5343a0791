"""get_dispatch_layout on the GPU: one pass over ``topk_idx``, no host synchronisation.

Each program takes ``BLOCK_N`` tokens, marks the ranks their experts live on (a token counts
once per rank however many of its experts are there), writes its rows of ``is_token_in_rank``
and adds its counts to the per-rank and per-expert totals with atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tritonep.runtime import kernel_names
from tritonep.runtime.launcher import FastLauncher


@kernel_names.jit("tritonep::intranode::layout")
def dispatch_layout_kernel(
    topk_idx_ptr, num_tokens, num_tokens_per_rank_ptr, num_tokens_per_expert_ptr, is_token_in_rank_ptr,
    invalid_ids_ptr, num_experts, experts_per_rank,
    NUM_TOPK: tl.constexpr, TOPK_PAD: tl.constexpr, NUM_RANKS: tl.constexpr, RANKS_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    token_mask = tokens < num_tokens
    slots = tl.arange(0, TOPK_PAD)
    mask = token_mask[:, None] & (slots < NUM_TOPK)[None, :]
    experts = tl.load(topk_idx_ptr + tokens[:, None].to(tl.int64) * NUM_TOPK + slots[None, :], mask=mask, other=-1)
    # Ids outside [-1, E) are counted (dispatch then refuses to run) and routed nowhere.
    invalid = mask & ((experts < -1) | (experts >= num_experts))
    tl.atomic_add(invalid_ids_ptr, tl.sum(tl.sum(invalid.to(tl.int32), axis=1), axis=0))
    valid = (experts >= 0) & (invalid == 0)
    tl.atomic_add(num_tokens_per_expert_ptr + tl.where(valid, experts, 0), 1, mask=valid)

    target_rank = tl.where(valid, experts // experts_per_rank, -1)
    ranks = tl.arange(0, RANKS_PAD)
    hits = (target_rank[:, :, None] == ranks[None, None, :]).to(tl.int32)
    in_rank = tl.max(hits, axis=1)                                   # [BLOCK_N, RANKS_PAD]
    rank_mask = ranks < NUM_RANKS
    tl.store(is_token_in_rank_ptr + tokens[:, None].to(tl.int64) * NUM_RANKS + ranks[None, :], in_rank != 0,
             mask=token_mask[:, None] & rank_mask[None, :])
    tl.atomic_add(num_tokens_per_rank_ptr + ranks, tl.sum(in_rank, axis=0), mask=rank_mask)


# The grid, K, E, R and the block are the setup (its constexprs are built only when it is new);
# a call converts only these (launcher.py).
_LAYOUT = FastLauncher(dispatch_layout_kernel, changing=(
    "topk_idx_ptr", "num_tokens", "num_tokens_per_rank_ptr", "num_tokens_per_expert_ptr", "is_token_in_rank_ptr",
    "invalid_ids_ptr"))


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int,
                    invalid_ids: torch.Tensor | None = None, block_n: int = 128
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same result as :func:`tritonep.core.routing.dispatch_layout`, in one kernel.

    ``invalid_ids`` (int32 [1]) is incremented by the number of ids outside [-1, E).
    """
    if invalid_ids is None:
        invalid_ids = torch.zeros(1, dtype=torch.int32, device=topk_idx.device)
    num_tokens, num_topk = topk_idx.shape
    counts = torch.zeros(num_ranks + num_experts, dtype=torch.int32, device=topk_idx.device)
    num_tokens_per_rank, num_tokens_per_expert = counts[:num_ranks], counts[num_ranks:]
    is_token_in_rank = torch.empty(num_tokens, num_ranks, dtype=torch.bool, device=topk_idx.device)
    if num_tokens > 0:
        grid = -(-num_tokens // block_n)   # (triton.cdiv's JIT wrapper costs microseconds per call)
        _LAYOUT(grid, (grid, num_topk, num_experts, num_ranks, block_n),
                (topk_idx, num_tokens, num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank, invalid_ids,
                 num_experts, num_experts // num_ranks),
                lambda: dict(NUM_TOPK=num_topk, TOPK_PAD=triton.next_power_of_2(num_topk), NUM_RANKS=num_ranks,
                             RANKS_PAD=triton.next_power_of_2(num_ranks), BLOCK_N=block_n), 4)
    return num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank
