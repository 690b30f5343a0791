"""A Buffer's life on GPUs: built only when every rank agrees and every rank's memory could be
had (tritonep/rank_agreement.py), and giving its GPU memory back when it goes.

The same checks run on CPU ranks in test_buffer_constructor.py; here they run through the GPU
paths of the NVLink backend's memory: torch symmetric memory with one GPU per rank, CUDA IPC
when ranks share GPUs (``TRITONEP_GPU_RANKS`` above the GPU count).
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
import torch.distributed as dist
from nvlink_cases import make_buffer, round_trip

import tritonep as deep_ep
from tritonep.rank_pool import SHARED_GPUS_VARIABLE, RankPool

GIB = 1 << 30


def _in_step(group: dist.ProcessGroup) -> bool:
    """Build, use and destroy a small Buffer: raises or hangs (the pool's time-out) if an
    earlier failure left the ranks out of step."""
    buffer = make_buffer(group, "nvlink", num_nvl_bytes=1 << 24, explicitly_destroy=True)
    layout = buffer.get_dispatch_layout(torch.zeros(4, 1, dtype=torch.int64, device="cuda"), group.size())
    ok = int(layout[0].sum()) == 4
    buffer.destroy()
    return ok


def different_nvl_bytes(group: dist.ProcessGroup) -> tuple[str, bool]:
    """Rank 1 asks for another num_nvl_bytes than the others: (this rank's error, in step after)."""
    nvl_bytes = (64 << 20) if group.rank() == 1 else (32 << 20)
    try:
        make_buffer(group, "nvlink", num_nvl_bytes=nvl_bytes)
        message = "no error"
    except deep_ep.InputError as error:
        message = str(error)
    return message, _in_step(group)


@pytest.mark.gpu
def test_gpu_ranks_given_different_sizes_all_raise(gpu_pool: RankPool) -> None:
    for message, in_step in gpu_pool.run(different_nvl_bytes):
        assert "Buffer needs the same num_nvl_bytes on every rank" in message, message
        assert "rank 0 33554432" in message and "rank 1 67108864" in message, message
        assert in_step


def last_rank_out_of_memory(group: dist.ProcessGroup) -> tuple[str, bool]:
    """The last rank cannot get the 1 GiB of a Buffer, really: with a GPU of its own it first
    fills that GPU (at one rank this is the only rank: symmetric memory's own out-of-memory must
    surface as the same error); sharing a GPU with its peers it lowers its own limit (the caching
    allocator's memory fraction), which leaves theirs alone. Returns (this rank's error, in step
    afterwards)."""
    shared = os.environ.get(SHARED_GPUS_VARIABLE) == "1"
    failing = group.rank() == group.size() - 1
    filler = None
    if failing:
        free, total = torch.cuda.mem_get_info()
        if shared:
            torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + (256 << 20)) / total)
        else:
            filler = torch.empty(free - (512 << 20), dtype=torch.uint8, device="cuda")
    try:
        make_buffer(group, "nvlink", num_nvl_bytes=GIB)
        message = "no error"
    except RuntimeError as error:
        message = str(error)
    finally:
        del filler
        if failing and shared:
            torch.cuda.set_per_process_memory_fraction(1.0)
        gc.collect()
        torch.cuda.empty_cache()
    return message, _in_step(group)


@pytest.mark.gpu(min_gpus=1)
def test_gpu_allocation_failing_on_one_rank_raises_on_every_rank(gpu_pool: RankPool) -> None:
    """Without the check, the rank out of memory raised and its peers waited for it in the next
    collective of the constructor."""
    R = gpu_pool.num_ranks
    for message, in_step in gpu_pool.run(last_rank_out_of_memory):
        assert f"failed on 1 of {R} rank(s)" in message and f"rank {R - 1}:" in message, message
        assert not any(f"rank {rank}:" in message for rank in range(R - 1)), message
        assert "memory" in message, message
        assert in_step


def used_after_rebuilds(group: dist.ProcessGroup, cycles: int, explicitly_destroy: bool) -> list[float]:
    """GiB used on this rank's GPU (every process's memory) after each of ``cycles`` Buffers of
    1 GiB normal-mode and 0.5 GiB low-latency memory was built, used once in each mode and
    destroyed (kept alive, as a user may keep a destroyed Buffer) or dropped; read with every
    rank at the same point."""
    readings, destroyed = [], []
    for _ in range(cycles):
        buffer = make_buffer(group, "nvlink", num_nvl_bytes=GIB, num_rdma_bytes=GIB // 2, low_latency_mode=True,
                             explicitly_destroy=explicitly_destroy)
        assert _use(buffer, group.size()), "normal-mode round trip not exact"
        if explicitly_destroy:
            buffer.destroy()
            destroyed.append(buffer)
        del buffer
        gc.collect()
        torch.cuda.synchronize()
        dist.barrier(group=group)
        free, total = torch.cuda.mem_get_info()
        readings.append((total - free) / GIB)
        dist.barrier(group=group)
    return readings


def _use(buffer: deep_ep.Buffer, num_ranks: int) -> bool:
    """One dispatch and combine in each mode (their outputs and cached launches included);
    whether the normal-mode round trip came back exact."""
    _, exact = round_trip(buffer, 64, 2048, seed=7)
    x = torch.randn(64, 2048, dtype=torch.bfloat16, device="cuda")
    topk_idx = torch.rand(64, 8 * num_ranks, dtype=torch.float32, device="cuda").topk(4, dim=1).indices
    weights = torch.rand(64, 4, dtype=torch.float32, device="cuda")
    packed, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, 64, 8 * num_ranks, use_fp8=False)
    buffer.low_latency_combine(packed, topk_idx, weights, handle)
    torch.cuda.synchronize()
    return exact


@pytest.mark.gpu(min_gpus=1)
@pytest.mark.parametrize("explicitly_destroy", [True, False], ids=["destroyed", "dropped"])
def test_gpu_buffers_give_their_memory_back(gpu_pool: RankPool, explicitly_destroy: bool) -> None:
    """Four Buffers built and used in turn, each destroyed (and kept) or dropped before the next:
    the GPU holds no more after the fourth than after the first (each Buffer kept would add
    1.5 GiB per rank). With 4 ranks sharing a GPU this failed: every Buffer's memory stayed
    allocated (memory.py, _map_ipc_handles; docs/benchmarks/2026-11-25-h100x1-s10, run 1)."""
    for readings in gpu_pool.run(used_after_rebuilds, 4, explicitly_destroy):
        assert readings[-1] - readings[0] < 0.25, readings
