"""get_dispatch_layout on the GPU: one launch, no host synchronisation, no zeroed outputs.

Program r owns rank r: it reads every token's top-k ids, tile by tile, and counts what lands
on rank r (each of its experts, and each token once however many of its experts are there),
writing column r of ``is_token_in_rank`` on the way. Every count then has exactly one writer,
so the outputs need no zeroing and no atomics: the host allocates them empty and makes one
launch. The tiles are wide (``BLOCK_N * TOPK_PAD`` ids, thousands) and the next one is loaded
while this one is counted, so the programs' walk over ``topk_idx`` is short for the token
counts of a training step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tritonep.runtime import kernel_names
from tritonep.runtime.launcher import FastLauncher, aligned, current_stream, next_power_of_2

# Ids per tile: about 16 per thread of LAYOUT_WARPS warps.
LAYOUT_TILE_IDS, LAYOUT_WARPS = 4096, 8


@triton.jit
def _load_ids(topk_idx_ptr, tokens, slots, num_tokens, NUM_TOPK: tl.constexpr):
    mask = (tokens < num_tokens)[:, None] & (slots < NUM_TOPK)[None, :]
    return tl.load(topk_idx_ptr + tokens[:, None].to(tl.int64) * NUM_TOPK + slots[None, :], mask=mask, other=-1)


@kernel_names.jit("tritonep::intranode::layout", do_not_specialize=["num_tokens"])
def dispatch_layout_kernel(
    topk_idx_ptr, num_tokens, num_tokens_per_rank_ptr, num_tokens_per_expert_ptr, is_token_in_rank_ptr,
    invalid_ids_ptr, num_experts,
    NUM_TOPK: tl.constexpr, TOPK_PAD: tl.constexpr, NUM_RANKS: tl.constexpr, EXPERTS_PER_RANK: tl.constexpr,
    EXPERTS_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rank = tl.program_id(0)
    first_expert = rank * EXPERTS_PER_RANK
    offsets = tl.arange(0, BLOCK_N)
    slots = tl.arange(0, TOPK_PAD)
    per_expert = tl.zeros([EXPERTS_PAD], dtype=tl.int32)
    tokens_here = tl.zeros([BLOCK_N], dtype=tl.int32)
    invalid = tl.zeros([BLOCK_N, TOPK_PAD], dtype=tl.int32)
    next_ids = _load_ids(topk_idx_ptr, offsets, slots, num_tokens, NUM_TOPK)
    for start in range(0, num_tokens, BLOCK_N):
        ids = next_ids   # padding reads as -1: no expert
        next_ids = _load_ids(topk_idx_ptr, start + BLOCK_N + offsets, slots, num_tokens, NUM_TOPK)
        tokens = start + offsets
        local = ids - first_expert
        hit = (local >= 0) & (local < EXPERTS_PER_RANK)   # ids outside [-1, E) land nowhere
        # The histogram takes the ids in any order (can_reorder); the misses ride along as -1
        # in the same tensor, so the mask is read from the reordered values themselves.
        flat = tl.reshape(tl.where(hit, local, -1).to(tl.int32), [BLOCK_N * TOPK_PAD], can_reorder=True)
        per_expert += tl.histogram(tl.maximum(flat, 0), EXPERTS_PAD, mask=flat >= 0)
        in_rank = tl.max(hit.to(tl.int32), axis=1)
        tl.store(is_token_in_rank_ptr + tokens.to(tl.int64) * NUM_RANKS + rank, in_rank != 0, mask=tokens < num_tokens)
        tokens_here += in_rank
        invalid += ((ids < -1) | (ids >= num_experts)).to(tl.int32)
    experts = tl.arange(0, EXPERTS_PAD)
    tl.store(num_tokens_per_expert_ptr + first_expert + experts, per_expert, mask=experts < EXPERTS_PER_RANK)
    tl.store(num_tokens_per_rank_ptr + rank, tl.sum(tokens_here, axis=0))
    if rank == 0:   # every program saw every id: one of them counts the bad ones (dispatch refuses to run)
        tl.atomic_add(invalid_ids_ptr, tl.sum(tl.sum(invalid, axis=1), axis=0))


def layout_constants(num_topk: int, num_experts: int, num_ranks: int) -> dict[str, int]:
    """The layout kernel's constexprs for these sizes."""
    topk_pad, experts_per_rank = next_power_of_2(num_topk), num_experts // num_ranks
    return dict(NUM_TOPK=num_topk, TOPK_PAD=topk_pad, NUM_RANKS=num_ranks, EXPERTS_PER_RANK=experts_per_rank,
                EXPERTS_PAD=next_power_of_2(experts_per_rank), BLOCK_N=max(16, LAYOUT_TILE_IDS // topk_pad))


# The changing arguments lead the signature, so a learnt launch's raw list starts with them.
_LAYOUT = FastLauncher(dispatch_layout_kernel, changing=(
    "topk_idx_ptr", "num_tokens", "num_tokens_per_rank_ptr", "num_tokens_per_expert_ptr", "is_token_in_rank_ptr",
    "invalid_ids_ptr"))


class DispatchLayout:
    """get_dispatch_layout for one engine: its out-of-range id counter, and the launch learnt
    per (top-k, experts) on the first call, which later calls repeat with their own addresses
    (the launch's other arguments and constants follow from that key and the rank count)."""

    def __init__(self, num_ranks: int, invalid_ids: torch.Tensor) -> None:
        self.num_ranks, self.invalid_ids = num_ranks, invalid_ids
        self._learnt: dict[tuple[int, int], list] = {}   # (K, E) -> [compiled launch, its raw argument list]

    def __call__(self, topk_idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Same result as :func:`tritonep.core.routing.dispatch_layout`; ``invalid_ids`` (int32
        [1]) grows by the number of ids outside [-1, E)."""
        R, device = self.num_ranks, topk_idx.device
        num_tokens, num_topk = topk_idx.shape
        per_rank = torch.empty(R, dtype=torch.int32, device=device)
        per_expert = torch.empty(num_experts, dtype=torch.int32, device=device)
        in_rank = torch.empty(num_tokens, R, dtype=torch.bool, device=device)
        addresses = (topk_idx.data_ptr(), num_tokens, per_rank.data_ptr(), per_expert.data_ptr(), in_rank.data_ptr())
        learnt = self._learnt.get((num_topk, num_experts))
        # A learnt launch assumed 16-byte aligned pointers (Triton specialises on it); num_tokens
        # is not specialised on, so any count repeats it.
        if learnt is not None and aligned(addresses[0], *addresses[2:]):
            launch, args = learnt
            args[:5] = addresses
            launch(current_stream(), args)
            return per_rank, per_expert, in_rank
        launch = _LAYOUT(R, (num_topk, num_experts, R),
                         (topk_idx, num_tokens, per_rank, per_expert, in_rank, self.invalid_ids, num_experts),
                         lambda: layout_constants(num_topk, num_experts, R), LAYOUT_WARPS)
        if launch is not None and aligned(addresses[0], *addresses[2:]) and launch.args[:5] == list(addresses):
            self._learnt[num_topk, num_experts] = [launch, list(launch.args)]
        return per_rank, per_expert, in_rank
