"""The count exchange from ``topk_idx`` alone (``notify_kernel``'s ``FROM_TOPK``, which V2's fresh
dispatch takes) gives what the exchange gives from ``get_dispatch_layout``'s tensors (worked out
by ``routing.dispatch_layout``): the same send plan, ``is_token_in_rank`` and counts, on Triton's
interpreter and on the GPUs. At sizes the dispatch cases do not reach: several tiles of tokens, a
top-k that is no power of two, a rank with no tokens, three ranks (no power of two), and ids out
of range, counted over all ranks and routed nowhere.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from nvlink_cases import make_buffer

from tritonep.core import routing

# (tokens on rank 0, top-k, experts per rank); rank r has 5 r tokens more (none if rank 0 has none).
SHAPES = [(0, 4, 4), (1, 1, 2), (37, 3, 4), (700, 8, 21), (1100, 6, 16), (300, 9, 8)]
# A key that stands for the engine's fixed arguments of the launches below (notify_dispatch's owner).
_OWNER = object()


def exchange_problems(group: dist.ProcessGroup, shapes: list[tuple[int, int, int]]) -> list[str]:
    from tritonep.backends.nvlink.normal.notify_kernel import check_word, notify_dispatch, source_expert_word

    R, rank = group.size(), group.rank()
    buffer = make_buffer(group, "nvlink", num_nvl_bytes=1 << 22, explicitly_destroy=True)
    engine = buffer.backend.normal
    state, counts = engine.state, engine.counts

    def exchange(in_rank: torch.Tensor | None, topk_idx: torch.Tensor, per_expert: torch.Tensor | None,
                 num_experts: int) -> list[torch.Tensor]:
        """Send plan, the result's words and is_token_in_rank of one exchange, on the CPU; the
        token lists cut to the tokens each holds (the rest is not written)."""
        state.notify_epoch += 1
        token_list, send_pos, result, in_rank = notify_dispatch(
            engine.memory, in_rank, topk_idx, per_expert, (64, 0, topk_idx.shape[1], num_experts, 0), False,
            counts.invalid_ids, state.notify_epoch, state.status.tensor, engine.timeout_ns, counts.mailbox,
            counts.layout_done, _OWNER)
        experts_per_rank = num_experts // R
        send_pos, in_rank = send_pos.cpu(), in_rank.cpu()
        lists = [token_list[r, :int(send_pos[-1, r])].cpu() for r in range(R)]
        words = result[: source_expert_word(R, experts_per_rank) + R * experts_per_rank].cpu()
        return [*lists, send_pos, words, in_rank]

    problems = []
    device = engine.memory.local.device
    # dtype and device explicit: GPU runs may set other torch defaults (tests/torch_defaults.py).
    cpu32 = dict(generator=torch.Generator().manual_seed(rank), dtype=torch.float32, device="cpu")
    try:
        for tokens, num_topk, experts_per_rank in shapes:
            num_tokens, num_experts = tokens + 5 * rank if tokens else 0, experts_per_rank * R
            topk_idx = torch.rand(num_tokens, num_experts, **cpu32).topk(min(num_topk, num_experts), dim=1).indices
            topk_idx[torch.rand(topk_idx.shape, **cpu32) < 0.2] = -1
            _, per_expert, in_rank = routing.dispatch_layout(topk_idx, num_experts, R)
            expected = exchange(in_rank.to(device), topk_idx.to(device), per_expert.to(device), num_experts)
            got = exchange(None, topk_idx.to(device), None, num_experts)
            if not all(torch.equal(a, b) for a, b in zip(got, expected)):
                problems.append(f"{(tokens, num_topk, experts_per_rank)} rank {rank}: {got} != {expected}")
            # Rank 0 sends two ids out of range: every rank's result counts both, and routes the
            # rest as if they were -1.
            bad = topk_idx.clone()
            if rank == 0 and num_tokens:
                bad[0, 0], bad[-1, -1] = num_experts, -2
            kept = bad.masked_fill((bad < -1) | (bad >= num_experts), -1)
            _, per_expert, in_rank = routing.dispatch_layout(kept, num_experts, R)
            expected = exchange(in_rank.to(device), kept.to(device), per_expert.to(device), num_experts)
            got = exchange(None, bad.to(device), None, num_experts)
            invalid = int(got[-2][check_word(R, experts_per_rank) + 1])
            got[-2][check_word(R, experts_per_rank) + 1] = 0
            counted = min(2, tokens * min(num_topk, num_experts))   # (rank 0's two are one if it has one id)
            if invalid != counted or not all(torch.equal(a, b) for a, b in zip(got, expected)):
                problems.append(f"{(tokens, num_topk, experts_per_rank)} rank {rank}, ids out of range: counted "
                                f"{invalid}, {got} != {expected}")
    finally:
        buffer.destroy()
    return problems


def test_exchange_from_topk_matches_layout(interpreter_pools) -> None:
    assert interpreter_pools(3).run(exchange_problems, SHAPES) == [[]] * 3


@pytest.mark.gpu(min_gpus=1)
def test_gpu_exchange_from_topk_matches_layout(gpu_pool) -> None:
    problems = gpu_pool.run(exchange_problems, SHAPES + [(16384, 8, 32)])
    assert problems == [[]] * gpu_pool.num_ranks
