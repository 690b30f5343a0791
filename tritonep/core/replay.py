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

Training routes anew every step, so most handles serve one combine and one cached dispatch:
their calls never repeat. A handle's replay therefore also offers ``rebind(handle)``: the same
call made with another handle of its engine (what differs is the handle's tensors and row
counts), or None where the general path must decide. The Buffer keeps the latest handle
replay of each key (``latest``), and a new handle's first call rebinds it (``handle_replay``).
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


def handle_replay(latest: ReplayTable, key: Hashable, handle: Any, *rebind_args: Any) -> Replay | None:
    """The replay of a call made with ``handle`` (a normal-mode handle, whose ``replays`` is its
    table): the one under ``key``, else the latest one of another handle (``latest``) rebound
    to this handle (``rebind(handle, *rebind_args)``), which the handle then keeps; None when
    neither exists or the rebinding refuses."""
    replay = handle.replays.get(key)
    if replay is None:
        template = latest.get(key)
        if template is not None:
            handle.replays.learn(key, template.rebind(handle, *rebind_args))
            replay = handle.replays.get(key)
    return replay


def learn_handle_replay(latest: ReplayTable, key: Hashable, handle: Any, replay: Replay | None) -> None:
    """Keep ``handle``'s ``replay`` under ``key`` in its table and as the latest of that key."""
    handle.replays.learn(key, replay)
    latest.learn(key, replay)
