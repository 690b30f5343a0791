"""Checks that need every rank: a Buffer's ranks were given the same arguments, and a local step
(an allocation, a mapping) worked on every rank, before any rank goes on to the next collective.

Building a Buffer is collective: symmetric memory is exchanged, barriers are passed. A rank
whose allocation fails (CUDA out of memory, say) raises there, and without these checks its
peers wait in the next collective for a rank that never comes: a hang, not an error. And ranks
given different sizes would compute different layouts of memory they share, so a sender would
write where the receiver does not read: silent corruption, which no later check catches.
Each check is one ``all_gather_object`` over the group, made while the Buffer is built, never
per call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from tritonep.core.checks import InputError

Result = TypeVar("Result")

# Shown per rank in a message; past this many ranks the message names the first ones only.
_RANKS_SHOWN = 8


def _gather(group: dist.ProcessGroup, value: object) -> list:
    gathered: list = [None] * group.size()
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def check_same_arguments(group: dist.ProcessGroup, arguments: dict[str, object]) -> None:
    """Raise InputError on every rank, naming each argument and its value per rank, unless every
    rank of ``group`` passed the same ``arguments`` (compared by ``repr``). Collective."""
    gathered = _gather(group, {name: repr(value) for name, value in arguments.items()})
    differing = [name for name in arguments if len({ranks_arguments[name] for ranks_arguments in gathered}) > 1]
    if differing:
        details = "; ".join(
            f"{name}: " + ", ".join(f"rank {rank} {ranks_arguments[name]}"
                                    for rank, ranks_arguments in enumerate(gathered[:_RANKS_SHOWN]))
            for name in differing)
        raise InputError(f"Buffer needs the same {', '.join(differing)} on every rank of its group, got {details}")


def raise_if_any_rank_failed(group: dist.ProcessGroup, error: BaseException | None, what: str) -> None:
    """Collective: if ``what`` failed on any rank (``error`` there), raise on every rank, naming
    the ranks and their errors; otherwise return on every rank."""
    gathered = _gather(group, None if error is None else f"{type(error).__name__}: {error}")
    failed = [(rank, message) for rank, message in enumerate(gathered) if message is not None]
    if failed:
        details = "; ".join(f"rank {rank}: {message}" for rank, message in failed[:_RANKS_SHOWN])
        raise RuntimeError(f"{what} failed on {len(failed)} of {len(gathered)} rank(s), so no rank goes on "
                           f"({details})") from error


def on_every_rank(group: dist.ProcessGroup, step: Callable[[], Result], what: str) -> Result:
    """Run ``step`` (local work, no communication) and return its result once it worked on every
    rank of ``group``; if it raised anywhere, every rank raises (``raise_if_any_rank_failed``).
    Collective: it also serves as a barrier after ``step``."""
    try:
        result, error = step(), None
    except (RuntimeError, OSError, MemoryError) as caught:   # CUDA out of memory is a RuntimeError
        result, error = None, caught
    raise_if_any_rank_failed(group, error, what)
    return result   # type: ignore[return-value]
