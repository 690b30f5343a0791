"""Learn once, replay cheaply: the host path of calls that repeat.

Training repeats the calls made with a handle (a combine per layer, a cached dispatch in every
layer's backward); decode servers repeat low-latency calls of one shape twice per layer per
step. The general path of such a call checks every argument and works out its launches: tens of
microseconds of Python beside launches of a few.

A *replay* stands for one call shape. An engine makes it as a by-product of a general call, from
the compiled launches that call made, and hands it back with the call's result. Called with the
next call's tensors, a replay checks that they fit what it learnt (dtype, layout, alignment, the
engine's state) and launches, returning what the call returns; or it returns None, and the
caller takes the general path, which checks everything and raises where it must.

The front end owns the keys and the tables: a Buffer keeps one table for its low-latency calls,
keyed by their options and shapes, and each normal-mode handle keeps one for the calls made with
it, keyed by the call's kind and options. Engines never see a key; the front end never sees a
launch. A general call is given the replay already under its key, if any, so an engine may
complete it (a low-latency replay learns one receive slot per call).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

# Called with a repeat's tensors: the call's return value, or None (take the general path).
Replay = Callable[..., Any]


class ReplayTable:
    """Replays by the front end's call keys. ``get`` is the dict's own (a repeat's one lookup)."""

    __slots__ = ("_replays", "get")

    def __init__(self) -> None:
        self._replays: dict[Hashable, Replay] = {}
        self.get = self._replays.get

    def learn(self, key: Hashable, replay: Replay | None) -> None:
        """Keep ``replay`` under ``key`` (None keeps what is there)."""
        if replay is not None:
            self._replays[key] = replay

    def clear(self) -> None:
        """Forget every replay (their launches point into memory that is being released)."""
        self._replays.clear()
