"""How the benchmark times a call, the same way for every path and package.

* ``call_times_us`` / ``median_us``: one call at a time, on the GPU alone. The ranks are aligned
  by a small all-reduce, L2 is flushed, and the stream sleeps about 1 ms before the start event
  while the host enqueues the call: the events time the call's GPU work, not its host path
  (which has rows of its own: ``back_to_back_host_us``).
* ``back_to_back_us``: calls issued back to back, as DeepEP's own harness and a training or
  decode loop issue them; the time per call is the total over the calls divided by their
  number, the ranks aligned and L2 flushed once, outside the timed loop.
* ``graph_us``: calls captured in one CUDA graph and replayed: no host path at all.
* ``back_to_back_host_us`` / ``first_use_host_us``: the host's CPU time per call, of one call
  repeated, and of calls each made with a new argument (a handle used for the first time).
* ``profiled_gpu_us``: torch.profiler's device time per call (every kernel, memset and copy the
  call runs), after a discarded warm-up step, the ranks meeting at a host barrier first.

Every figure is the slowest rank's: a collective call is as slow as its slowest rank. On CPU
ranks (gloo) the same functions measure wall-clock time, so every mode runs without GPUs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

_L2_FLUSH: dict[int, torch.Tensor] = {}
_HOST_GROUPS: dict[str, dist.ProcessGroup] = {}
_SLEEP_KERNEL: list[str] = []

# GPU cycles the timed stream sleeps after the L2 flush, about 1 ms at 2 GHz: the host enqueues
# the timed call meanwhile, so that the events time the GPU, as in a training step where the host
# runs ahead. Shorter sleeps let a fresh dispatch's host path leak into its events (figures in
# docs/benchmarks).
HEAD_START_CYCLES = 2_000_000


def on_gpu(group: dist.ProcessGroup) -> bool:
    """Whether ``group``'s ranks time GPU work (NCCL); gloo ranks time wall-clock time."""
    return dist.get_backend(group) == "nccl"


def flush_l2() -> None:
    """Overwrite 256 MB (more than any current GPU's L2) so that the next timed call reads its
    inputs from HBM, as DeepEP's benchmarks do."""
    device = torch.cuda.current_device()
    if device not in _L2_FLUSH:
        _L2_FLUSH[device] = torch.empty(256 << 20, dtype=torch.int8, device=torch.device("cuda", device))
    _L2_FLUSH[device].zero_()


def host_head_start() -> None:
    """Keep the current stream busy for ``HEAD_START_CYCLES`` while the host enqueues what follows."""
    torch.cuda._sleep(HEAD_START_CYCLES)


def align(group: dist.ProcessGroup) -> None:
    """A one-element all-reduce: on GPUs, every rank's stream passes it at about the same time."""
    dist.all_reduce(torch.zeros(1, device="cuda" if on_gpu(group) else "cpu"), group=group)


def host_barrier(group: dist.ProcessGroup) -> None:
    """The ranks' hosts meet, with no work on the GPU (a gloo group beside an NCCL one)."""
    if not on_gpu(group):
        dist.barrier(group=group)
        return
    if group.group_name not in _HOST_GROUPS:   # every rank reaches this at the same call
        _HOST_GROUPS[group.group_name] = dist.new_group(dist.get_process_group_ranks(group), backend="gloo")
    dist.barrier(group=_HOST_GROUPS[group.group_name])


def slowest(group: dist.ProcessGroup, value: float) -> float:
    """The largest ``value`` over the ranks."""
    tensor = torch.tensor([value], dtype=torch.float64, device="cuda" if on_gpu(group) else "cpu")
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return float(tensor)


def call_times_us(group: dist.ProcessGroup, fns: list[Callable[[], object]], iters: int,
                  warmup: int = 3) -> list[list[float]]:
    """This rank's microseconds for each call of each ``fn``, the fns called in turn ``iters``
    times, each call on its own (see the module's docstring)."""
    gpu = on_gpu(group)
    for _ in range(warmup):
        for fn in fns:
            fn()
    marks: list[list] = [[] for _ in fns]
    for _ in range(iters):
        for fn, fn_marks in zip(fns, marks):
            # Align first, then flush and sleep: the host gets the flush's and the sleep's time
            # to enqueue the call, so a call whose kernels are shorter than its host path still
            # has its GPU time measured.
            align(group)
            if gpu:
                flush_l2()
                host_head_start()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                fn_marks.append((start, end))
            else:
                begin = time.perf_counter()
                fn()
                fn_marks.append((time.perf_counter() - begin) * 1e6)
    if not gpu:
        return marks
    torch.cuda.synchronize()
    return [[start.elapsed_time(end) * 1e3 for start, end in fn_marks] for fn_marks in marks]


def median_us(group: dist.ProcessGroup, fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    """Median of ``iters`` calls of ``fn`` timed on their own; the slowest rank's."""
    return slowest(group, statistics.median(call_times_us(group, [fn], iters, warmup)[0]))


def extra_us(group: dist.ProcessGroup, fn: Callable[[], object], base: Callable[[], object], iters: int) -> float:
    """Median over pairs of (``fn``'s time - ``base``'s), the two called in turn: a difference
    that the host's speed drifting over seconds moves far less than two separate medians."""
    fn_times, base_times = call_times_us(group, [fn, base], iters)
    return slowest(group, statistics.median(a - b for a, b in zip(fn_times, base_times)))


def back_to_back_us(group: dist.ProcessGroup, fn: Callable[[], object], calls: int, warmup: int = 10) -> float:
    """Microseconds per call of ``calls`` calls issued back to back (total / calls), the ranks
    aligned and L2 flushed before the timed loop, not inside it; the slowest rank's. The host
    runs ahead of the GPU wherever it can, so a call's host path hides behind earlier kernels."""
    for _ in range(warmup):
        fn()
    gpu = on_gpu(group)
    if gpu:
        torch.cuda.synchronize()
    align(group)
    if not gpu:
        begin = time.perf_counter()
        for _ in range(calls):
            fn()
        return slowest(group, (time.perf_counter() - begin) * 1e6 / calls)
    flush_l2()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return slowest(group, start.elapsed_time(end) * 1e3 / calls)


def back_to_back_host_us(fn: Callable[[], object], calls: int = 20, rounds: int = 15) -> float:
    """CPU microseconds per call of ``fn`` made back to back: the median round of ``calls``
    calls, after 5 warm-up calls. The GPU is synchronised between rounds, so that a slower GPU
    never fills the launch queue and makes the host wait."""
    gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
    for _ in range(5):
        fn()
    samples = [_round_us(fn, calls, gpu) for _ in range(rounds)]
    if gpu:
        torch.cuda.synchronize()
    return statistics.median(samples)


def _round_us(fn: Callable[[], object], calls: int, gpu: bool) -> float:
    """CPU microseconds per call of ``calls`` calls of ``fn`` made back to back, the GPU (when
    ``gpu``) synchronised first."""
    if gpu:
        torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - begin) / calls * 1e6


def paired_back_to_back_host_us(first: Callable[[], object], second: Callable[[], object], calls: int = 10,
                                pairs: int = 5) -> dict[str, list[float]]:
    """``back_to_back_host_us`` of two calls side by side: ``pairs`` pairs of rounds of ``calls``
    calls, the first's and the second's round in turn (the order swapped every pair), the GPU
    synchronised before each. Returns {"first", "second"}: CPU microseconds per call of each
    round, in pair order, so that a difference is taken between rounds a few milliseconds apart
    (the host's speed drifts over seconds)."""
    gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
    for fn in (first, second):
        for _ in range(5):
            fn()
    times: dict[str, list[float]] = {"first": [], "second": []}
    rounds = (("first", first), ("second", second))
    for pair in range(pairs):
        for name, fn in rounds if pair % 2 == 0 else rounds[::-1]:
            times[name].append(_round_us(fn, calls, gpu))
    if gpu:
        torch.cuda.synchronize()
    return times


def first_use_host_us(make: Callable[[], object], use: Callable[[object], object], calls: int = 8,
                      rounds: int = 3) -> float:
    """CPU microseconds per call of ``use(made)`` when every call is the first made with its
    argument: each round makes ``calls`` arguments with ``make`` (not timed), then uses each once,
    back to back; the median round. This is what a training step's calls with a handle cost: with
    new routing every step, each handle serves one combine and one cached dispatch, so nothing a
    library learns from a repeated call (a replay, a captured graph) helps them."""
    gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
    samples = []
    for _ in range(rounds):
        made = [make() for _ in range(calls)]
        if gpu:
            torch.cuda.synchronize()
        begin = time.perf_counter()
        for argument in made:
            use(argument)
        samples.append((time.perf_counter() - begin) / calls * 1e6)
        del made
    if gpu:
        torch.cuda.synchronize()
    return statistics.median(samples)


def idle_starts(group: dist.ProcessGroup, calls: int) -> Iterator[None]:
    """Yields ``calls`` times, each time with this rank's GPU idle and the ranks together: the
    start of a call whose host time is measured alone."""
    for _ in range(calls):
        if on_gpu(group):
            torch.cuda.synchronize()
        dist.barrier(group=group)
        yield


def idle_host_us(group: dist.ProcessGroup, fn: Callable[[], object], iters: int) -> float:
    """Median CPU microseconds for ``fn`` to return when the GPU is idle before the call and the
    ranks start together; the slowest rank's."""
    times = []
    for _ in idle_starts(group, iters + 3):
        begin = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - begin) / 1e3)
    return slowest(group, statistics.median(times[3:]))


def idle_paired_host_us(group: dist.ProcessGroup, first: Callable[[], object], second: Callable[[], object],
                        pairs: int, waited_ns: Callable[[], int]) -> dict[str, list[float]]:
    """Two calls' host times side by side, on this rank: ``pairs`` calls of each, in turn (the
    order swapped every pair), each with the GPU idle before it and the ranks started together
    (``idle_starts``). Per call its CPU microseconds, and its host work: that time less what it
    spent waiting on the GPU (``waited_ns``: a running total in nanoseconds,
    ``internals.count_waits``). Returns {"first", "second", "first_work", "second_work"}: lists
    in pair order, the first 3 pairs (warm-up) left out.

    One such call's time spreads widely (on H200 hosts, by over a hundred microseconds: it
    waits on the GPU, the peers and a CPU that idled), so a difference of a few microseconds
    shows only in the median of the per-pair differences, not in the difference of two medians."""
    times: dict[str, list[float]] = {"first": [], "second": [], "first_work": [], "second_work": []}
    calls = (("first", first), ("second", second))
    for pair in range(pairs + 3):
        for name, fn in calls if pair % 2 == 0 else calls[::-1]:
            for _ in idle_starts(group, 1):
                waited = waited_ns()
                begin = time.perf_counter_ns()
                fn()
                elapsed = time.perf_counter_ns() - begin
                if pair >= 3:
                    times[name].append(elapsed / 1e3)
                    times[f"{name}_work"].append((elapsed - (waited_ns() - waited)) / 1e3)
    return times


def graph_us(group: dist.ProcessGroup, fn: Callable[[], object], iters: int, calls: int = 10) -> float:
    """GPU microseconds per call with no host path: ``calls`` calls captured in one CUDA graph,
    the replay timed as one call (``median_us``) and divided by ``calls``."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    try:
        return median_us(group, graph.replay, iters) / calls
    finally:
        del graph


def _sleep_kernel_name() -> str:
    """The name torch.profiler gives ``host_head_start``'s kernel, learnt once by profiling it
    ("" if the profiler did not show exactly one kernel)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if not _SLEEP_KERNEL:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            torch.cuda._sleep(1000)
            torch.cuda.synchronize()
        names = {event.name for event in prof.events() if event.device_type == DeviceType.CUDA}
        _SLEEP_KERNEL.append(names.pop() if len(names) == 1 else "")
    return _SLEEP_KERNEL[0]


def profiled_gpu_us(group: dist.ProcessGroup, fn: Callable[[], object], calls: int) -> float:
    """Device microseconds per call of ``fn`` in torch.profiler: every kernel, memset and copy it
    runs, summed over ``calls`` calls issued back to back, divided by ``calls``; the slowest
    rank's. Whatever a Buffer's kernels are called, they count.

    Two profiler steps, the first discarded: the profiler's start-up (which takes each rank a
    different time) falls in it. Before each step the hosts meet at a barrier, then the stream
    sleeps while the calls are enqueued, so that a kernel waiting for its peers' data does not
    also wait for their hosts. On CPU ranks: the CPU time of the ops the calls run."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, schedule

    gpu = on_gpu(group)
    # Without the sleep kernel's name its time could not be left out: then no head start.
    sleep_kernel = _sleep_kernel_name() if gpu else ""
    fn()
    activity, device = (ProfilerActivity.CUDA, DeviceType.CUDA) if gpu else (ProfilerActivity.CPU, DeviceType.CPU)
    with profile(activities=[activity], schedule=schedule(wait=0, warmup=1, active=1, repeat=1)) as prof:
        for _ in range(2):
            if gpu:
                torch.cuda.synchronize()
            host_barrier(group)
            if sleep_kernel:
                host_head_start()
            for _ in range(calls):
                fn()
            if gpu:
                torch.cuda.synchronize()
            prof.step()
    events = [event for event in prof.events() if event.device_type == device]
    if gpu:
        total = sum(event.time_range.elapsed_us() for event in events if event.name != sleep_kernel)
    else:
        total = sum(event.self_cpu_time_total for event in events if not event.name.startswith("ProfilerStep"))
    return slowest(group, total / calls)
