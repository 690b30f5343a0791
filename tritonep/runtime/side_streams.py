"""Side streams: the work of a call that runs beside its kernels (copy-engine copies, one stream
per peer; the send half of dispatch).

A ``cudaMemcpyAsync`` between two GPUs' memory runs on a copy engine: no SM is involved, and
one copy streams at close to the link's speed (docs/findings.md). Copies on one stream run one
after another, so each peer gets a stream of its own. ``fork`` starts the jobs after the work
already queued on the current stream (or after an earlier point of it, taken with ``mark``); the
caller then queues its kernels, which run beside the jobs, and ``join`` makes the current stream
wait for the jobs (so that the caching allocator never reuses their inputs too early). Streams
and events are made once; switching streams goes through torch's raw setter
(``torch.cuda.stream`` costs microseconds per use), and with cuda-bindings' driver module the
events are raw driver events, recorded and waited on through the driver (torch's event methods
cost several driver calls each). Without a GPU (the interpreter tests) the
jobs simply run, in order, when forked.

Side work that repeats exactly (same operations, same addresses, same values) can be captured
once as a CUDA graph (``capture``) and forked as one graph launch (``fork_graph``): every
operation a job issues costs the host microseconds, a graph launch costs about one. The graph
runs on the first side stream, in order with the jobs forked there. Graphs and their fork and
join go through the CUDA driver (cuda-bindings' ``driver`` module, given at construction), with
raw events made once and the caller's stream read through the launcher's raw lookup: torch's
``current_stream()`` costs several times a driver call (docs/findings.md).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import torch

from tritonep.runtime.launcher import current_stream as raw_current_stream
from tritonep.runtime.streams import current_stream, current_stream_ids, set_stream

_EVENT_DISABLE_TIMING = 0x2   # CU_EVENT_DISABLE_TIMING


def driver_result(result: tuple, what: str) -> Any:
    """The value a cuda-bindings driver call returned (None when it returns only its status);
    raises if the call failed."""
    if result[0] != 0:   # CUresult.CUDA_SUCCESS
        raise RuntimeError(f"{what} failed: {result[0]!r}")
    return result[1] if len(result) > 1 else None


class PeerStreams:
    """Side streams reused by every call of one backend. ``driver``: cuda-bindings' driver
    module, or None (no graphs)."""

    def __init__(self, device: torch.device, driver: Any = None) -> None:
        self._gpu = device.type == "cuda"
        self._streams: list[torch.cuda.Stream] = []
        # Per side stream, the event its jobs' end is recorded in: torch's, or with ``driver`` a
        # raw driver event (a driver call costs a fraction of torch's event methods).
        self._done: list[Any] = []
        self.driver = driver if self._gpu else None
        self._ready: Any = None if not self._gpu else self._new_event()
        self._forked = 0
        self._branch: torch.cuda.Stream | None = None    # a captured graph's second stream
        self._graph_events: tuple | None = None          # (start, done): raw driver events
        self._graph_forked = False
        self.capture_error: str | None = None   # why a capture failed: no more graphs then

    def _new_event(self) -> Any:
        if self.driver is None:
            return torch.cuda.Event()
        return driver_result(self.driver.cuEventCreate(_EVENT_DISABLE_TIMING), "event creation")

    def _ensure_streams(self, count: int) -> None:
        while len(self._streams) < count:
            self._streams.append(torch.cuda.Stream())
            self._done.append(self._new_event())

    def mark(self) -> Any:
        """Record, now, the point of the current stream that a later ``fork(after=...)`` starts
        from (an event, torch's or the driver's: only ``fork`` reads it)."""
        if not self._gpu:
            return None
        if self.driver is not None:
            driver_result(self.driver.cuEventRecord(self._ready, raw_current_stream()), "event record")
        else:
            self._ready.record(current_stream())
        return self._ready

    def fork(self, jobs: list[Callable[[], None]], after: Any = None) -> None:
        """Run each job with a side stream of its own as the current stream, after everything
        already queued on the current stream, or only after the point ``mark`` returned."""
        if not self._gpu:
            for job in jobs:
                job()
            return
        self._ensure_streams(len(jobs))
        current = current_stream_ids()
        if after is None:
            after = self.mark()
        driver = self.driver
        for job, stream, done in zip(jobs, self._streams, self._done):
            if driver is not None:
                driver_result(driver.cuStreamWaitEvent(stream.cuda_stream, after, 0), "stream wait")
            else:
                stream.wait_event(after)
            set_stream(stream)
            try:
                job()
            finally:
                set_stream(current)
            if driver is not None:
                driver_result(driver.cuEventRecord(done, stream.cuda_stream), "event record")
            else:
                done.record(stream)
        self._forked = max(self._forked, len(jobs))

    @property
    def captures(self) -> bool:
        """Whether ``capture`` can make graphs: the driver path on a GPU, and no capture failed."""
        return self.driver is not None and self.capture_error is None

    def capture(self, body: Callable[[torch.cuda.Stream], None], what: str) -> Any:
        """The work ``body`` issues, captured (not run) as an executable CUDA graph for
        ``fork_graph``. ``body`` runs with the first side stream current, and is handed a second
        stream it may fork to with events (and must join back). Capture is local to this thread:
        other threads' CUDA calls are not affected. None if the driver refused the capture: then,
        with a warning naming ``what``, these streams make no more graphs and the side work goes
        op by op (same results, more host time)."""
        try:
            return self._capture(body)
        except RuntimeError as error:
            self.capture_error = str(error)
            warnings.warn(f"tritonep: {what} could not be captured as a CUDA graph ({error}); it is issued op by "
                          f"op from now on", RuntimeWarning, stacklevel=3)
            return None

    def _capture(self, body: Callable[[torch.cuda.Stream], None]) -> Any:
        driver = self.driver
        self._ensure_streams(1)
        if self._branch is None:
            self._branch = torch.cuda.Stream()
        stream = self._streams[0]
        current = current_stream_ids()
        driver_result(driver.cuStreamBeginCapture(
            stream.cuda_stream, driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "graph capture")
        try:
            set_stream(stream)
            body(self._branch)
        finally:
            set_stream(current)
            # Ends the capture whatever happened, so the stream is usable again.
            graph = driver_result(driver.cuStreamEndCapture(stream.cuda_stream), "graph capture")
        try:
            return driver_result(driver.cuGraphInstantiate(graph, 0), "graph instantiation")
        finally:
            driver_result(driver.cuGraphDestroy(graph), "graph destruction")

    def fork_graph(self, graph: Any, after: Any = None) -> None:
        """Launch ``graph`` (from ``capture``) on the first side stream, after everything already
        queued on the current stream (four driver calls), or only after the point ``mark``
        returned (three)."""
        driver = self.driver
        if self._graph_events is None:
            self._graph_events = (self._new_event(), self._new_event())
        start, done = self._graph_events
        side = self._streams[0].cuda_stream
        if after is None:
            driver_result(driver.cuEventRecord(start, raw_current_stream()), "event record")
            after = start
        driver_result(driver.cuStreamWaitEvent(side, after, 0), "stream wait")
        driver_result(driver.cuGraphLaunch(graph, side), "graph launch")
        driver_result(driver.cuEventRecord(done, side), "event record")
        self._graph_forked = True

    def drop_graph(self, graph: Any) -> None:
        """Free ``graph`` (a launch still running finishes first: the driver frees it after)."""
        driver_result(self.driver.cuGraphExecDestroy(graph), "graph destruction")

    def join(self) -> None:
        """The current stream waits for every job and graph forked since the last ``join``."""
        if self._gpu and self._forked:
            if self.driver is not None:
                caller = raw_current_stream()
                for done in self._done[: self._forked]:
                    driver_result(self.driver.cuStreamWaitEvent(caller, done, 0), "stream wait")
            else:
                stream = current_stream()
                for done in self._done[: self._forked]:
                    stream.wait_event(done)
        self._forked = 0
        if self._graph_forked:
            caller = raw_current_stream()
            driver_result(self.driver.cuStreamWaitEvent(caller, self._graph_events[1], 0), "stream wait")
            self._graph_forked = False


class SideGraphs:
    """The captured side work of one replayed call, by the addresses it was captured with (the
    call's inputs or outputs). A graph is captured the second time in a row that a call comes
    with the same addresses: a training step's calls with one handle mostly come with new
    tensors, and a capture costs far more than the calls it saves once, while a loop over the
    same tensors (a benchmark, a layer re-run on blocks the caching allocator hands back) gets
    the graph from its third call on. At most ``limit`` are kept, the oldest dropped first."""

    __slots__ = ("streams", "limit", "graphs", "last")

    def __init__(self, streams: PeerStreams, limit: int) -> None:
        self.streams, self.limit = streams, limit
        self.graphs: dict[tuple, Any] = {}
        self.last: tuple | None = None

    def get(self, addresses: tuple, capture: Callable[[], Any]) -> Any:
        """The graph for ``addresses``: known, or made now by ``capture`` (which may return None)
        when the last call came with the same addresses; else None (issue the work op by op)."""
        graph = self.graphs.get(addresses)
        repeated, self.last = addresses == self.last, addresses
        if graph is None and not (repeated and self.streams.captures):
            return None
        if torch.cuda.is_current_stream_capturing():
            return None   # a user's capture takes the ops as they are, never a graph of ours
        if graph is None:
            if len(self.graphs) == self.limit:
                self.streams.drop_graph(self.graphs.pop(next(iter(self.graphs))))
            graph = capture()
            if graph is not None:
                self.graphs[addresses] = graph
        return graph

    def __del__(self) -> None:
        # At interpreter exit the driver may be gone before the graphs: nothing left to free then.
        with contextlib.suppress(Exception):
            for graph in self.graphs.values():
                self.streams.drop_graph(graph)
