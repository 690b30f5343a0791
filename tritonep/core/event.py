"""``EventOverlap``: a handle on work queued on the communication stream.

On the GPU it wraps a ``torch.cuda.Event`` recorded after the communication kernels; the
caller makes its compute stream wait on it (``current_stream_wait``) or uses it as a context
manager around compute that may overlap the communication. On the CPU backend every call
finishes before it returns, so the event is empty and waiting is a no-op.
"""

from __future__ import annotations

from typing import Any

import torch


class EventOverlap:
    """Arguments:
        event: a ``torch.cuda.Event`` to wait on, or None when the work already finished.
        extra_tensors: tensors kept alive until the event is waited on (their memory is in use
            by the communication stream).
    """

    def __init__(self, event: torch.cuda.Event | None = None, extra_tensors: tuple | None = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Make the current stream wait for the communication to finish."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        self.current_stream_wait()


# Holds nothing: one object serves every call that returns no event.
NO_EVENT = EventOverlap(None)


def capture_event() -> EventOverlap:
    """An event recorded on the current stream now (empty when CUDA is not in use)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        return EventOverlap(event)
    return EventOverlap(None)
