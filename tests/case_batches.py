"""Many cases per launch of the pool, the CPU oracle of the next case running beside this one.

A GPU case compares the NVLink backend with the CPU backend on the same inputs. The oracle
(inputs made on the CPU, the CPU backend on a gloo group) is CPU work only: run in line, it
leaves the GPU idle for as long as it takes, at the race loops' sizes longer than the GPU side.
So a rank takes a batch of cases in one ``pool.run`` and a thread of its own works ahead on the
oracle (``ahead``), on a gloo group of its own (``oracle_group``), while the rank's main thread
runs the NVLink side of the case before and compares on the GPU. Only verdicts and timings go
back to the parent (``check_batch``), which fails naming the case and the rank, and keeps the
timings for the summary pytest prints at the end (conftest.py).
"""

from __future__ import annotations

import contextlib
import datetime
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from rank_timing import CompileClock, current_test

from tritonep.rank_pool import leave_after_this_run

_groups: dict[str, dist.ProcessGroup] = {}


def oracle_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A gloo group over ``group``'s ranks for the CPU backend, made once per process: never the
    group the NVLink side uses (ranks sharing GPUs join a gloo group), since the two sides'
    collectives run at the same time, in different threads."""
    if "oracle" not in _groups:
        # Bounded: a collective that a peer never joins raises (gloo names the peer) instead of
        # waiting gloo's default half hour. Ranks' oracle threads may drift apart by as much as
        # a case's GPU side takes (kernels compiled on the way): minutes are plenty.
        _groups["oracle"] = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=ORACLE_TIMEOUT_S))
    return _groups["oracle"]


ORACLE_TIMEOUT_S = 300


def ahead(produce: Callable[[Any], Any], items: Iterable[Any], times: list[dict]) -> Iterator[tuple[Any, Any]]:
    """Yield ``(item, produce(item))`` in order, ``produce`` running in a thread ahead of the
    caller: while the caller uses one item, the next waits done and the one after may be under
    way. ``times[i]`` gets "oracle" (seconds in ``produce``) and "waited" (seconds
    the caller waited for it). An exception in ``produce`` reaches the caller at its item,
    naming it.

    ``produce`` runs collectives: every rank must ask for the same items. The thread runs under
    the caller's thread-local torch state (default device, current CUDA device)."""
    items = list(items)
    results: queue.Queue = queue.Queue(maxsize=1)
    stop = threading.Event()
    default_device = torch.get_default_device()
    cuda_device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def work() -> None:
        if cuda_device is not None:
            torch.cuda.set_device(cuda_device)
        if default_device.type != "cpu":
            torch.set_default_device(default_device)
        for item in items:
            start = time.perf_counter()
            try:
                value, error = produce(item), None
            except BaseException as caught:  # noqa: BLE001 - handed to the caller at this item
                value, error = None, caught
            outcome = (value, error, time.perf_counter() - start)
            while not stop.is_set():
                try:
                    results.put(outcome, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if error is not None or stop.is_set():
                return

    thread = threading.Thread(target=work, name="oracle", daemon=True)
    thread.start()
    try:
        for index, item in enumerate(items):
            start = time.perf_counter()
            value, error, spent = results.get()
            times[index].update(oracle=spent, waited=time.perf_counter() - start)
            if error is not None:
                raise RuntimeError(f"{item}, oracle: {type(error).__name__}: {error}") from error
            yield item, value
    finally:
        stop.set()
        thread.join(timeout=THREAD_STOP_S)
        if thread.is_alive():
            # Stuck in a collective that a peer's oracle thread, stopped after a failure, never
            # joins: this rank's next oracle would meet it, so the pool replaces the ranks.
            leave_after_this_run()


# How long a batch that ends early waits for its oracle thread to finish the item it is on.
THREAD_STOP_S = 5.0


def run_batch(group: dist.ProcessGroup, cases: list[Any], oracle: Callable[[Any], Any],
              compare: Callable[[Any, Any], list[str]]) -> tuple[list[list[str]], list[dict]]:
    """On one rank: ``oracle(case)`` (CPU only, collectives on ``oracle_group``) one case ahead of
    ``compare(case, oracle's result)`` (the NVLink side and the comparison). Returns the
    mismatches and the timings of each case; an exception names its case."""
    times = [{} for _ in cases]
    problems = []
    # closing: when a case fails, the oracle thread is stopped before the error goes back.
    with CompileClock() as clock, contextlib.closing(ahead(oracle, cases, times)) as results:
        for index, (case, expected) in enumerate(results):
            start, compiled = time.perf_counter(), clock.seconds
            try:
                problems.append(compare(case, expected))
            except Exception as error:
                raise RuntimeError(f"{case}: {type(error).__name__}: {error}") from error
            times[index].update(gpu=time.perf_counter() - start, compile=clock.seconds - compiled)
    if times:
        times[-1]["compiles"] = clock.count
    return problems, times


# ------------------------------------------------------------------------------ parent side
# (test id, cases, wall seconds, per-rank timings) of every batch this session ran.
BATCHES: list[tuple[str, int, float, list[list[dict]]]] = []


def check_batch(pool: Any, fn: Callable[..., tuple[list[list[str]], list[dict]]], cases: list[Any],
                *args: Any) -> None:
    """Run ``fn(group, cases, *args)`` (a ``run_batch``) on every rank; fail naming each case and
    rank that found a mismatch. The batch's timings are kept for the session's summary."""
    start = time.perf_counter()
    results = pool.run(fn, cases, *args)
    BATCHES.append((current_test(), len(cases), time.perf_counter() - start, [times for _, times in results]))
    failures = [f"{case} on rank {rank}: {per_rank[0][index]}"
                for index, case in enumerate(cases) for rank, per_rank in enumerate(results) if per_rank[0][index]]
    assert not failures, "\n".join(failures)


def summary_lines(most: int = 30) -> list[str]:
    """The batches' totals, then a line for each of the ``most`` slowest tests: cases, wall
    time, and per phase the seconds summed over its cases (the slowest rank's): the GPU side
    (of it, compiling kernels), the oracle thread, and what the GPU side waited for the oracle."""
    if not BATCHES:
        return []
    totals: dict[str, list[float]] = {}
    for test, count, wall, per_rank in BATCHES:
        line = totals.setdefault(test, [0.0] * 7)
        line[0] += count
        line[1] += wall
        for slot, key in enumerate(("gpu", "compile", "oracle", "waited"), start=2):
            line[slot] += max(sum(times.get(key, 0.0) for times in cases) for cases in per_rank)
        line[6] += max((cases[-1].get("compiles", 0) for cases in per_rank if cases), default=0)
    everything = [sum(column) for column in zip(*totals.values())]
    slowest = sorted(totals.items(), key=lambda item: -item[1][1])[:most]
    return [f"{wall:7.1f} s {int(count):4d} cases: GPU side {gpu:6.1f} s (compiling {compile_s:5.1f} s, "
            f"{int(compiles)} kernels), oracle {oracle:6.1f} s, GPU side waited {waited:5.1f} s  {test}"
            for test, (count, wall, gpu, compile_s, oracle, waited, compiles)
            in [(f"all {len(totals)} tests", everything), *slowest]]
