"""The layout kernel (tritonep/backends/nvlink/normal/layout_kernel.py) equals
``routing.dispatch_layout`` on Triton's interpreter, at sizes the NVLink cases do not reach:
several tiles of tokens, a top-k that is no power of two, up to 8 ranks, ids out of range.

The kernel needs no process group (each program owns a rank number), so one CPU rank of the
interpreter pools runs every shape; on the GPUs each rank runs them too, the later calls of a
shape through the launch the first one learnt.
"""

from __future__ import annotations

import pytest
import torch

from tritonep.core import routing

# (tokens, top-k, experts, ranks): one tile, a partial tile, several tiles (BLOCK_N tokens each).
SHAPES = [(0, 4, 8, 2), (1, 1, 4, 4), (37, 3, 12, 3), (700, 8, 64, 4), (1100, 6, 48, 8), (300, 9, 16, 1)]


def layout_problems(group: object, shapes: list[tuple[int, int, int, int]]) -> list[str]:
    from tritonep.backends.nvlink.normal.layout_kernel import DispatchLayout

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def layout_of(layout: DispatchLayout, topk_idx: torch.Tensor, num_experts: int) -> list[torch.Tensor]:
        return [tensor.cpu() for tensor in layout(topk_idx.to(device), num_experts)]

    problems = []
    # dtype and device explicit: GPU runs may set other torch defaults (tests/torch_defaults.py).
    cpu32 = dict(generator=torch.Generator().manual_seed(0), dtype=torch.float32, device="cpu")
    for num_tokens, num_topk, num_experts, num_ranks in shapes:
        topk_idx = torch.rand(num_tokens, num_experts, **cpu32).topk(num_topk, dim=1).indices
        topk_idx[torch.rand(num_tokens, num_topk, **cpu32) < 0.2] = -1
        expected = routing.dispatch_layout(topk_idx, num_experts, num_ranks)
        invalid_ids = torch.zeros(1, dtype=torch.int32, device=device)
        layout = DispatchLayout(num_ranks, invalid_ids)
        for call in range(2):   # the second call runs on what the first left in the outputs' memory
            got = layout_of(layout, topk_idx, num_experts)
            if not all(torch.equal(a, b) for a, b in zip(got, expected)) or int(invalid_ids) != 0:
                problems.append(f"{(num_tokens, num_topk, num_experts, num_ranks)} call {call}: {got} != {expected}")
        if num_tokens:   # bad ids are counted and routed nowhere
            bad = topk_idx.clone()
            bad[0, 0], bad[-1, -1] = num_experts, -2
            kept = bad.clone()
            kept[0, 0], kept[-1, -1] = -1, -1
            got, expected = layout_of(layout, bad, num_experts), routing.dispatch_layout(kept, num_experts, num_ranks)
            counted = int((bad != kept).sum())
            if not all(torch.equal(a, b) for a, b in zip(got, expected)) or int(invalid_ids) != counted:
                problems.append(f"{(num_tokens, num_topk, num_experts, num_ranks)} bad ids: counted "
                                f"{int(invalid_ids)}, {got} != {expected}")
    return problems


def test_layout_kernel_matches_routing(interpreter_pools) -> None:
    assert interpreter_pools(1).run(layout_problems, SHAPES) == [[]]


@pytest.mark.gpu(min_gpus=1)
def test_gpu_layout_kernel_matches_routing(gpu_pool) -> None:
    assert all(problems == [] for problems in gpu_pool.run(layout_problems, SHAPES + [(16384, 8, 256, 8)]))
