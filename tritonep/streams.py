"""Where a call's work runs, and the event it hands back (DeepEP's stream contract).

On a backend with a communication stream, a call waits for ``previous_event`` (or for the
current stream), runs on the communication stream, and then either returns an event
(``async_finish=True``) or makes the current stream wait for it. Tensors that cross streams
are recorded on the stream that uses them so the caching allocator does not recycle them early.
On a backend without streams (the CPU), work is finished when the call returns.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from .event import EventOverlap


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


@contextmanager
def on_comm_stream(
    comm_stream: torch.cuda.Stream | None,
    previous_event: EventOverlap | None,
    async_finish: bool,
    inputs: tuple = (),
) -> Iterator[StreamScope]:
    scope = StreamScope()
    if comm_stream is None:
        yield scope
        return
    compute_stream = torch.cuda.current_stream()
    if previous_event is not None and previous_event.event is not None:
        comm_stream.wait_event(previous_event.event)
    else:
        comm_stream.wait_stream(compute_stream)
    with torch.cuda.stream(comm_stream):
        yield scope
    if async_finish:
        # Inputs stay in use on the communication stream after we return.
        for tensor in _flatten(inputs):
            tensor.record_stream(comm_stream)
        event = torch.cuda.Event()
        event.record(comm_stream)
        scope.event = EventOverlap(event, extra_tensors=tuple(_flatten(inputs)))
    else:
        compute_stream.wait_stream(comm_stream)
    for tensor in scope.outputs:
        tensor.record_stream(compute_stream)


def _flatten(items: object) -> list[torch.Tensor]:
    if isinstance(items, torch.Tensor):
        return [items]
    if isinstance(items, (tuple, list)):
        return [t for item in items for t in _flatten(item)]
    return []
