"""Where a call's work runs, and the event it hands back (DeepEP's stream contract).

On a backend with a communication stream, a call waits for ``previous_event`` (or for the
current stream), runs on the communication stream, and then either returns an event
(``async_finish=True``) or makes the current stream wait for it. Tensors that cross streams
are recorded on the stream that uses them so the caching allocator does not recycle them early.
On a backend without streams (the CPU), work is finished when the call returns.

A call with neither ``previous_event`` nor ``async_finish`` runs on the current stream
itself: waiting for it, running on the communication stream and making it wait back orders
the work exactly as running it there does, and costs two event records, two waits, two
stream switches and a ``record_stream`` per output on the host.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import torch

from tritonep.core.event import EventOverlap


class StreamScope:
    def __init__(self) -> None:
        self.event: EventOverlap = EventOverlap(None)
        self.outputs: list[torch.Tensor] = []

    def keep(self, *tensors: object) -> None:
        """Outputs made on the communication stream and handed to the caller."""
        for item in tensors:
            if isinstance(item, torch.Tensor):
                self.outputs.append(item)
            elif isinstance(item, (tuple, list)):
                self.keep(*item)


def current_stream_ids() -> tuple[int, int, int]:
    """(stream id, device index, device type) of the current stream, without a Stream object."""
    return tuple(torch._C._cuda_getCurrentStream(torch._C._cuda_getDevice()))


def set_stream(stream: torch.cuda.Stream | tuple[int, int, int]) -> None:
    """Make ``stream`` (a Stream or its ids) current, and its device: torch's raw setter, which
    costs far less than ``torch.cuda.stream``'s context manager."""
    ids = stream if isinstance(stream, tuple) else (stream.stream_id, stream.device_index, stream.device_type)
    torch._C._cuda_setStream(stream_id=ids[0], device_index=ids[1], device_type=ids[2])


_STREAMS: dict[tuple[int, int, int], torch.cuda.Stream] = {}


def current_stream() -> torch.cuda.Stream:
    """The current CUDA stream as a Stream object made once per stream (``torch.cuda.current_stream``
    makes a new one on every call, several microseconds of Python)."""
    ids = current_stream_ids()
    stream = _STREAMS.get(ids)
    if stream is None:
        stream = _STREAMS[ids] = torch.cuda.Stream(stream_id=ids[0], device_index=ids[1], device_type=ids[2])
    return stream


class _StreamSwitch:
    """What ``on_comm_stream`` needs per communication stream, made once: ``torch.cuda.stream``,
    ``current_stream`` and ``wait_stream`` are Python-heavy and create an event per call, tens
    of microseconds for a host path that should cost a few. The two events are re-recorded
    every call (a wait takes the event's state at the time of the wait)."""

    def __init__(self) -> None:
        self.to_comm, self.to_compute = torch.cuda.Event(), torch.cuda.Event()


class _SameStream:
    """The scope of a call that runs on the current stream: nothing to switch, record or keep.
    A plain object, because entering a generator-based context manager costs microseconds of
    host time on every call."""

    def __enter__(self) -> _SameStream:
        return self

    def __exit__(self, *exception: object) -> None:
        return None

    def keep(self, *tensors: object) -> None:
        return None

    @property
    def event(self) -> EventOverlap:
        return EventOverlap(None)


_SAME_STREAM = _SameStream()


def on_comm_stream(
    comm_stream: torch.cuda.Stream | None,
    previous_event: EventOverlap | None,
    async_finish: bool,
    inputs: tuple = (),
) -> _SameStream | AbstractContextManager[StreamScope]:
    """The scope a call's work runs in (see the module doc); ``inputs``: the tensors the work reads."""
    waits_for_event = previous_event is not None and previous_event.event is not None
    if comm_stream is None or not (waits_for_event or async_finish):
        return _SAME_STREAM
    return _on_comm_stream(comm_stream, previous_event, async_finish, inputs, waits_for_event)


@contextmanager
def _on_comm_stream(
    comm_stream: torch.cuda.Stream,
    previous_event: EventOverlap | None,
    async_finish: bool,
    inputs: tuple,
    waits_for_event: bool,
) -> Iterator[StreamScope]:
    scope = StreamScope()
    switch = getattr(comm_stream, "_tritonep_switch", None)   # made once, lives with the stream
    if switch is None:
        switch = comm_stream._tritonep_switch = _StreamSwitch()
    compute_ids, compute_stream = current_stream_ids(), current_stream()
    if waits_for_event:
        comm_stream.wait_event(previous_event.event)
    else:
        switch.to_comm.record(compute_stream)
        comm_stream.wait_event(switch.to_comm)
    set_stream(comm_stream)
    try:
        yield scope
    finally:   # (also makes the compute stream's device current again)
        set_stream(compute_ids)
    if async_finish:
        # Inputs stay in use on the communication stream after we return.
        for tensor in _flatten(inputs):
            tensor.record_stream(comm_stream)
        event = torch.cuda.Event()
        event.record(comm_stream)
        scope.event = EventOverlap(event, extra_tensors=tuple(_flatten(inputs)))
    else:
        switch.to_compute.record(comm_stream)
        compute_stream.wait_event(switch.to_compute)
    for tensor in scope.outputs:
        tensor.record_stream(compute_stream)


def _flatten(items: object) -> list[torch.Tensor]:
    if isinstance(items, torch.Tensor):
        return [items]
    if isinstance(items, (tuple, list)):
        return [t for item in items for t in _flatten(item)]
    return []
