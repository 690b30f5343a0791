"""Timing pieces shared by the benchmark's normal-mode and low-latency parts: the L2 flush
before each timed call, the slowest rank's figure, and finding DeepEP for ``--vs-deepep``."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

_L2_FLUSH: dict = {}


def flush_l2() -> None:
    """Overwrite 256 MB (more than an H100/H200's 50-60 MB of L2) so that the next timed call
    reads its inputs from HBM, as DeepEP's benchmarks do between calls."""
    device = torch.cuda.current_device()
    if device not in _L2_FLUSH:
        _L2_FLUSH[device] = torch.empty(256 << 20, dtype=torch.int8, device=torch.device("cuda", device))
    _L2_FLUSH[device].zero_()


# GPU cycles the timed stream sleeps after the L2 flush, about 1 ms at an H100's or H200's
# 1.98 GHz: the host's time to enqueue the timed call, so that the events time the GPU, as in
# a training step where the host runs ahead. A cached dispatch costs a slow host 64-130 us,
# an EP8 combine issues copies for ~200 us, and a fresh dispatch enqueues its exchange and both
# halves in 150-200 us on an H100 host (docs/benchmarks/2026-11-24-h200x1-s6,
# 2026-11-24-h100x1-s8); with 200 us of sleep the fresh dispatch was still timed by its host.
# The host's own time is reported in rows of its own.
HEAD_START_CYCLES = 2_000_000


def host_head_start() -> None:
    """Keep the current stream busy for ``HEAD_START_CYCLES`` (after the flush, before the start event)."""
    torch.cuda._sleep(HEAD_START_CYCLES)


def slowest(group: dist.ProcessGroup, value: float) -> float:
    """The largest ``value`` over the ranks: a collective call is as slow as its slowest rank."""
    on_gpu = dist.get_backend(group) == "nccl"
    tensor = torch.tensor([value], dtype=torch.float64, device="cuda" if on_gpu else "cpu")
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return float(tensor)


def load_deepep() -> tuple[object | None, str]:
    """(DeepEP's ``deep_ep`` module, "") when it imports and is DeepEP itself, else (None, why)."""
    try:
        import deep_ep as module
    except ImportError as error:
        return None, f"DeepEP not found (import deep_ep: {error})"
    if getattr(module, "__name__", "") != "deep_ep" or hasattr(module, "InputError"):
        return None, "import deep_ep gave tritonep, not DeepEP"
    return module, ""


def back_to_back_host_us(fn: Callable[[], object], calls: int = 20, rounds: int = 15) -> float:
    """CPU time per call of ``fn`` made back to back, as a decode loop makes them: the median
    round of ``calls`` calls, the GPU synchronised between rounds (so that a slower GPU never
    fills the launch queue and makes the host wait), after 5 warm-up calls."""
    for _ in range(5):
        fn()
    samples = []
    for _ in range(rounds):
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        begin = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - begin) / calls * 1e6)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return statistics.median(samples)
