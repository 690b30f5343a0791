"""Where a GPU test's time goes, as the GPU log shows it: compiling kernels, loading them from
Triton's disk cache, setting their modules up (NVSHMEM), or the test's own work.

``CompileClock`` counts, in one rank process, the kernels Triton compiled and those it found in
its disk cache (the kernel list warmed them: ``kernel_cache.py``), with their seconds, and the
seconds the post-compile chain took after them (torch's NVSHMEM module set-up for NVSHMEM
kernels). ``TimedPool`` wraps a GPU pool: every ``run`` goes to the ranks under a clock, and
the parent keeps, per test, how many runs it made, their wall time, and the slowest rank's
compile figures; ``summary_lines`` prints them at the end of the session (conftest.py), beside
the pool start-ups the fixtures note with ``note_start``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from tritonep.rank_pool import RankPool


class CompileClock:
    """Counts the Triton kernels compiled (or loaded from Triton's disk cache) in this process
    while it is entered, and the seconds they took: Triton's compile hooks and its compilation
    listener, chained.

    ``count``/``seconds``: every kernel the JIT asked for, from the cache hook to the end of the
    post-compile chain. Of those, ``cached``/``cached_seconds`` came from Triton's disk cache and
    ``built``/``built_seconds`` were compiled here; ``setup_seconds`` is what ran in the
    post-compile chain before the clock's hook (torch's NVSHMEM module set-up).

    A hook installed while the clock runs may chain to the clock's (tritonep wraps NVSHMEM
    kernels on their first launch, and torch's NVSHMEM set-up must then run for every module
    compiled later). So on exit the clock puts the earlier hooks back only where its own are
    still in place; elsewhere its hooks stay in the chain and just pass the call on."""

    def __init__(self) -> None:
        self.count, self.seconds = 0, 0.0
        self.cached, self.cached_seconds = 0, 0.0
        self.built, self.built_seconds = 0, 0.0
        self.setup_seconds = 0.0
        self._start = self._loaded = 0.0
        self._counting = False

    def __enter__(self) -> CompileClock:
        from triton import knobs

        self._saved = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
        self._saved_listener = knobs.compilation.listener
        self._counting = True

        def before(**kwargs: Any) -> bool:
            if self._counting:
                self._start = self._loaded = time.perf_counter()
            return bool(self._saved[0] and self._saved[0](**kwargs))

        def listener(**kwargs: Any) -> None:   # at the end of triton.compile, hit or miss
            if self._counting:
                self._loaded = time.perf_counter()
                spent = self._loaded - self._start
                if kwargs.get("cache_hit"):
                    self.cached, self.cached_seconds = self.cached + 1, self.cached_seconds + spent
                else:
                    self.built, self.built_seconds = self.built + 1, self.built_seconds + spent
            if self._saved_listener:
                self._saved_listener(**kwargs)

        def after(**kwargs: Any) -> Any:
            if self._counting:
                now = time.perf_counter()
                self.count += 1
                self.seconds += now - self._start
                self.setup_seconds += now - self._loaded
            return self._saved[1](**kwargs) if self._saved[1] else None

        self._hooks = before, after, listener
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = before, after
        knobs.compilation.listener = listener
        return self

    def __exit__(self, *exc: object) -> None:
        from triton import knobs

        self._counting = False
        before, after, listener = self._hooks
        if knobs.runtime.jit_cache_hook is before:
            knobs.runtime.jit_cache_hook = self._saved[0]
        if knobs.runtime.jit_post_compile_hook is after:
            knobs.runtime.jit_post_compile_hook = self._saved[1]
        if knobs.compilation.listener is listener:
            knobs.compilation.listener = self._saved_listener

    def figures(self) -> dict[str, float]:
        return {"compile": self.seconds, "compiles": self.count, "cached": self.cached,
                "cached_s": self.cached_seconds, "built": self.built, "built_s": self.built_seconds,
                "setup_s": self.setup_seconds}


def describe_compiles(figures: dict[str, float]) -> str:
    """``figures`` (``CompileClock.figures``) in words, for the summary."""
    return (f"compiling {figures['compile']:5.1f} s: {int(figures['compiles'])} kernels, "
            f"{int(figures['built'])} built {figures['built_s']:.1f} s, "
            f"{int(figures['cached'])} from Triton's cache {figures['cached_s']:.1f} s, "
            f"module set-up {figures['setup_s']:.1f} s")


class Timed:
    """``fn`` run in a rank under a ``CompileClock``: returns ``(fn's result, timings)``.
    Picklable where ``fn`` is; named as ``fn``, so a hang is reported under its name."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", repr(fn))

    def __call__(self, group: Any, *args: Any, **kwargs: Any) -> tuple[Any, dict[str, float]]:
        start = time.perf_counter()
        with CompileClock() as clock:
            result = self.fn(group, *args, **kwargs)
        return result, {"wall": time.perf_counter() - start, **clock.figures()}


@dataclass
class TestTimes:
    runs: int = 0
    wall: float = 0.0
    functions: set[str] = field(default_factory=set)
    slowest: dict[str, float] = field(default_factory=dict)   # summed over runs, the slowest rank's each run

    def add(self, name: str, wall: float, per_rank: list[dict[str, float]]) -> None:
        self.runs += 1
        self.wall += wall
        self.functions.add(name)
        if per_rank:
            slowest = max(per_rank, key=lambda times: times["compile"])
            for key, value in slowest.items():
                self.slowest[key] = self.slowest.get(key, 0.0) + value


TESTS: dict[str, TestTimes] = {}
STARTS: list[str] = []   # pool start-ups, in words


def current_test() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]


class TimedPool:
    """A RankPool whose runs are timed (see the module doc); everything else is the pool's."""

    def __init__(self, pool: RankPool) -> None:
        self.pool = pool

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pool, name)

    def run(self, fn: Callable[..., Any], *args: Any, may_exit: Collection[int] = (), **kwargs: Any) -> list[Any]:
        start = time.perf_counter()
        replies = self.pool.run(Timed(fn), *args, may_exit=may_exit, **kwargs)
        per_rank = [times for _, times in filter(None, replies)]   # (a rank that exited: None)
        name = getattr(fn, "__name__", repr(fn))
        TESTS.setdefault(current_test(), TestTimes()).add(name, time.perf_counter() - start, per_rank)
        return [reply[0] if reply is not None else None for reply in replies]


def note_start(what: str, pool: RankPool, ready: Callable[..., Any]) -> None:
    """Wait until ``pool``'s ranks have started and answer (``ready`` on each), and note how
    long it took from now: process start, CUDA and the process group."""
    start = time.perf_counter()
    pool.run(ready)
    STARTS.append(f"{what}: {pool.num_ranks} ranks answered after {time.perf_counter() - start:.1f} s")


def summary_lines(most: int = 30) -> list[str]:
    """Pool start-ups, then a line for each of the ``most`` tests that spent longest in pool
    runs: runs, wall time, and the slowest rank's compile figures."""
    slowest = sorted(TESTS.items(), key=lambda item: -item[1].wall)[:most]
    return STARTS + [f"{times.wall:7.1f} s {times.runs:3d} pool runs, in the ranks {times.slowest.get('wall', 0):6.1f} "
                     f"s, {describe_compiles(times.slowest) if times.slowest else 'no timings'}  {test} "
                     f"({', '.join(sorted(times.functions))})"
                     for test, times in slowest]
