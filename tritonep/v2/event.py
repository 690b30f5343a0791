"""The events DeepEP V2's calls take and return.

V2 waits on an ``EventHandle`` (``ElasticBuffer.capture()``: an event recorded on the current
stream) and returns an ``EventOverlap`` that can also run a hook once it has been waited on and
drop its event (``release_handle``). Both build on the shared :class:`tritonep.core.event.EventOverlap`,
so the stream helpers of ``runtime/streams.py`` accept them as they are. On the CPU backend every
call has finished when it returns: the events hold nothing and waiting only runs the hook.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tritonep.core import event as core_event


class EventOverlap(core_event.EventOverlap):
    """An event after a call's communication (``event`` is None when there is nothing to wait
    for), with V2's extras: a hook run after the first wait, and ``release_handle``.

    Arguments:
        event: a ``torch.cuda.Event`` to wait on, or None.
        extra_tensors: tensors kept alive until the event is waited on.
    """

    # Class-level defaults, set on an instance only when used: every call returns an event, and
    # the base class's constructor alone is one Python frame fewer per call.
    hook_after_wait: Callable[[], None] | None = None
    _release_on_exit = False

    def current_stream_wait(self, release_handle: bool = False) -> None:
        """Make the current stream wait for the event, then run the registered hook (once).

        Arguments:
            release_handle: drop the event afterwards (the tensors it kept alive go with it).
        """
        super().current_stream_wait()
        hook, self.hook_after_wait = self.hook_after_wait, None
        if hook is not None:
            hook()
        if release_handle:
            self.event, self.extra_tensors = None, None

    def register_hook_after_wait(self, hook_after_wait: Callable[[], None]) -> None:
        """Run ``hook_after_wait`` after the next ``current_stream_wait`` (one hook at a time)."""
        if self.hook_after_wait is not None:
            raise RuntimeError("this EventOverlap already has a hook registered")
        self.hook_after_wait = hook_after_wait

    def __call__(self, release_handle: bool = False) -> EventOverlap:
        """``with event(release_handle=True): ...`` waits on exit and then drops the event."""
        self._release_on_exit = release_handle
        return self

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        release, self._release_on_exit = self._release_on_exit, False
        self.current_stream_wait(release_handle=release)


class EventHandle(EventOverlap):
    """An event recorded on the current stream when made (empty when CUDA is not in use): what
    V2's ``capture()`` returns and its ``previous_event`` arguments take."""

    def __init__(self) -> None:
        super().__init__(core_event.capture_event().event)


def wrap(event: core_event.EventOverlap) -> EventOverlap:
    """The V2 event for a scope's event (``runtime.streams``)."""
    return EventOverlap(event.event, event.extra_tensors)
