"""What the GPU ranks carry from one test module to the next: one pool serves the session
(conftest.py ``gpu_pool``), so each module starts from the state the ranks had when first
prepared: the environment restored (modules set ``TRITONEP_GPUS_PER_NODE``, ``TRITONEP_BACKEND``
in their ranks), the Buffers the case modules keep dropped."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

_environment: dict[str, str] = {}   # this rank's, when first prepared
_recording: set[str] = set()        # the kernel lists this process appends to


def prepare_ranks(group: dist.ProcessGroup, threads: int, kernels_out: str | None = None) -> None:
    """At a module's start, on every GPU rank: torch's CPU operators get ``threads`` threads
    (RankPool starts ranks with one), for the oracle's large copies and sums on a host with
    cores to spare; with ``kernels_out``, the kernels this process compiles are listed there
    (kernel_cache.record)."""
    if not _environment:
        _environment.update(os.environ)
    torch.set_num_threads(threads)
    if kernels_out and kernels_out not in _recording:
        from kernel_cache import record

        record(group, kernels_out)
        _recording.add(kernels_out)


def answer(group: dist.ProcessGroup) -> None:
    """Nothing: a run that returns once every rank is up (``rank_timing.note_start``)."""


def restore_environment(group: dist.ProcessGroup) -> None:
    """The environment as ``prepare_ranks`` found it (modules set ``TRITONEP_GPUS_PER_NODE``,
    ``TRITONEP_BACKEND`` ... in their ranks)."""
    if _environment:   # (a rank started after a failure mid-module was never prepared)
        os.environ.clear()
        os.environ.update(_environment)


def reset_ranks(group: dist.ProcessGroup) -> None:
    """At a module's end, on every GPU rank of the session's pool: the environment restored, and
    no Buffer kept by the case modules (their GPU memory given back)."""
    from low_latency_cases import release_buffers

    restore_environment(group)
    release_buffers(group)
