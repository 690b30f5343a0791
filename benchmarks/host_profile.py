"""Where a call's host time goes, function by function (``--api v2 --host-profile``).

Each row's V1 and V2 calls run under cProfile, one call at a time with the GPU idle before it
and the ranks started together, and each function's own time per call is kept; the report
lists the functions whose own time differs most between the two APIs. cProfile slows every
Python call, so the figures are larger than the host times the bench measures without it: they
say where a difference sits, not its size.
"""

from __future__ import annotations

import cProfile
import pstats
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from . import timing

WARMUP_CALLS = 3


def own_us_per_call(group: dist.ProcessGroup, fn: Callable[[], object], calls: int) -> dict[str, float]:
    """{function (folder/file:line(name)): its own (not its callees') microseconds per call of
    ``fn``} on this rank."""
    for _ in range(WARMUP_CALLS):
        fn()
    profile = cProfile.Profile()
    for _ in timing.idle_starts(group, calls):
        profile.enable()
        fn()
        profile.disable()
    return _own_us(profile, calls)


def own_us_per_first_use(group: dist.ProcessGroup, make: Callable[[], object], use: Callable[[object], object],
                         calls: int) -> dict[str, float]:
    """As ``own_us_per_call``, of ``use(made)`` with each call the first made with its argument
    (``make``'s, made before the profile): a handle's first cached dispatch or combine."""
    for _ in range(WARMUP_CALLS):
        use(make())
    made = [make() for _ in range(calls)]
    profile = cProfile.Profile()
    for argument, _ in zip(made, timing.idle_starts(group, calls)):
        profile.enable()
        use(argument)
        profile.disable()
    return _own_us(profile, calls)


def _own_us(profile: cProfile.Profile, calls: int) -> dict[str, float]:
    stats = pstats.Stats(profile).stats   # {(file, line, name): (calls, primitive calls, own s, total s, callers)}
    return {f"{_where(file)}:{line}({name})": own / calls * 1e6
            for (file, line, name), (_, _, own, _, _) in stats.items()}


def _where(file: str) -> str:
    """``folder/file.py`` of a Python function (``v1/buffer.py`` and ``v2/buffer.py`` apart), or
    cProfile's ``~`` for a built-in."""
    path = Path(file)
    return f"{path.parent.name}/{path.name}" if path.parent.name else path.name


# torch.distributed's waits and collectives, the C functions and their Python wrappers
# (``distributed/distributed_c10d.py``, and the logging decorator around them,
# ``distributed/c10d_logger.py``), whose own time can hold the C call's: their time is spent
# waiting for the other ranks (the CPU backend's gloo exchanges), which moves with the ranks'
# skew, not with either API's host work, and can crowd every front-end difference out.
_PEER_WAITS = ("distributed_c10d", "c10d_logger")


def largest_differences(v1: dict[str, float], v2: dict[str, float], top: int = 12) -> list[tuple[str, float, float]]:
    """(function, V1 us, V2 us) of the ``top`` functions whose own time per call differs most,
    waits on other ranks left out (``largest`` still lists them)."""
    rows = [(name, v1.get(name, 0.0), v2.get(name, 0.0)) for name in set(v1) | set(v2)
            if not any(wait in name for wait in _PEER_WAITS)]
    return sorted(rows, key=lambda row: abs(row[2] - row[1]), reverse=True)[:top]


def largest(own: dict[str, float], top: int = 12) -> list[tuple[str, float]]:
    """(function, us) of the ``top`` functions with the most own time per call: where a call's
    host time goes, shared parts included (those cancel out of ``largest_differences``)."""
    return sorted(own.items(), key=lambda item: item[1], reverse=True)[:top]


def print_differences(name: str, profiled: dict) -> None:
    """One row's report: the largest differences, then each API's largest own times."""
    print(f"\n{name}: own host us per call under cProfile, V1 {profiled['v1_us']:.1f}, V2 {profiled['v2_us']:.1f}")
    for function, v1_us, v2_us in profiled["largest_differences"]:
        print(f"  {v2_us - v1_us:+9.1f}  v1 {v1_us:8.1f}  v2 {v2_us:8.1f}  {function}")
    for api in ("v1", "v2"):
        print(f"  largest own times, {api}: " + ", ".join(f"{function} {us:.1f}"
                                                         for function, us in profiled.get(f"{api}_largest", [])))
