"""Side streams: the work of a call that runs beside its kernels (copy-engine copies, one stream
per peer; the send half of dispatch).

A ``cudaMemcpyAsync`` between two GPUs' memory runs on a copy engine: no SM is involved, and
one copy streams at close to the link's speed (docs/findings.md). Copies on one stream run one
after another, so each peer gets a stream of its own. ``fork`` starts the jobs after the work
already queued on the current stream (or after an earlier point of it, taken with ``mark``); the
caller then queues its kernels, which run beside the jobs, and ``join`` makes the current stream
wait for the jobs (so that the caching allocator never reuses their inputs too early). Streams
and events are made once; switching streams goes through torch's raw setter
(``torch.cuda.stream`` costs microseconds per use). Without a GPU (the interpreter tests) the
jobs simply run, in order, when forked.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tritonep.runtime.streams import current_stream, current_stream_ids, set_stream


class PeerStreams:
    """Side streams reused by every call of one backend."""

    def __init__(self, device: torch.device) -> None:
        self._gpu = device.type == "cuda"
        self._streams: list[torch.cuda.Stream] = []
        self._done: list[torch.cuda.Event] = []
        self._ready = torch.cuda.Event() if self._gpu else None
        self._forked = 0

    def mark(self) -> torch.cuda.Event | None:
        """Record, now, the point of the current stream that a later ``fork(after=...)`` starts from."""
        if not self._gpu:
            return None
        self._ready.record(current_stream())
        return self._ready

    def fork(self, jobs: list[Callable[[], None]], after: torch.cuda.Event | None = None) -> None:
        """Run each job with a side stream of its own as the current stream, after everything
        already queued on the current stream, or only after the point ``mark`` returned."""
        if not self._gpu:
            for job in jobs:
                job()
            return
        while len(self._streams) < len(jobs):
            self._streams.append(torch.cuda.Stream())
            self._done.append(torch.cuda.Event())
        current = current_stream_ids()
        if after is None:
            after = self.mark()
        for job, stream, done in zip(jobs, self._streams, self._done):
            stream.wait_event(after)
            set_stream(stream)
            try:
                job()
            finally:
                set_stream(current)
            done.record(stream)
        self._forked = max(self._forked, len(jobs))

    def join(self) -> None:
        """The current stream waits for every job forked since the last ``join``."""
        if self._gpu and self._forked:
            stream = current_stream()
            for done in self._done[: self._forked]:
                stream.wait_event(done)
        self._forked = 0
