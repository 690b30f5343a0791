"""What the normal mode's calls share from one call to the next.

``NormalState`` is the engine's host state between calls: the call epochs, the staging-release
counters, the status word, the side streams, the launch generation and the one check a
``num_worst_tokens`` dispatch leaves to the next call. The engine (the general path) and the
replays it hands out (``replay.py``) both read and advance it, so the two paths interleave
freely: a replay is a shortcut through the same state, never a copy of it.

``SendPlan`` is what a handle carries from the dispatch that made it, for the cached
dispatches and combines made with it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch

from tritonep.backends.nvlink.normal.combine_copy_engine import combine_copies
from tritonep.core.routing import count_rows_from_prefix
from tritonep.runtime.side_streams import PeerStreams
from tritonep.runtime.status import StatusWord

# Launch generations are distinct across engines and tunings: the kernels' launchers are shared
# by every engine of the process, and a generation is part of every setup key they are given.
_GENERATIONS = itertools.count()


class NormalState:
    """The normal mode's host state between calls, shared by the engine and its replays.

    Epochs number the calls of each kind (every rank counts alike, so a rank's epoch names the
    same call on every peer); the kernels stamp their signals with it. The release counters are
    the receiver (reducer) programs of all earlier dispatches (combines): each one adds 1 to
    every peer's done word, so a sender knows when the staging it writes into is free again.
    ``dispatch_arrived`` counts the sender programs of all copy-engine dispatches
    (``dispatch_copy_engine.py``): each adds 1 to every peer's arrived word for this rank.
    ``dispatch_release_due``: of the receivers counted, those whose release this rank still owes
    every source (a copy-engine receive's), which the next dispatch launch with senders adds.
    """

    __slots__ = ("device", "notify_epoch", "dispatch_epoch", "combine_epoch", "dispatch_released",
                 "combine_released", "dispatch_arrived", "dispatch_release_due", "status", "send_stream",
                 "peer_streams", "launch_generation", "unchecked_padding")

    def __init__(self, device: torch.device, driver: Any = None) -> None:
        self.device = device
        self.notify_epoch = 0
        self.dispatch_epoch = 0
        self.combine_epoch = 0
        self.dispatch_released = 0
        self.combine_released = 0
        self.dispatch_arrived = 0
        self.dispatch_release_due = 0
        # A kernel that gives up waiting on a peer writes (phase, peer) here (runtime/status.py).
        self.status = StatusWord()
        # The dispatch's send half runs on a side stream beside its receive half; the copy-engine
        # combine sends each peer's rows on a side stream of its own.
        self.send_stream = PeerStreams(device)
        # ``driver`` (cuda-bindings', or None) lets the latter replay captured graphs.
        self.peer_streams = PeerStreams(device, driver)
        # Stands for the kernel shapes (the engine's Tuning) and this engine's fixed launch
        # arguments in every setup key: launches learnt under another generation are not reused.
        self.launch_generation = next(_GENERATIONS)
        # A num_worst_tokens dispatch does not sync, so whether its padding was large enough is
        # checked when the next call starts: (its exchange's epoch, num_worst_tokens).
        self.unchecked_padding: tuple[int, int] | None = None

    def new_launch_generation(self) -> None:
        """Kernel shapes changed: no launch learnt so far may be reused."""
        self.launch_generation = next(_GENERATIONS)


@dataclass
class SendPlan:
    """What a cached dispatch and the combine reuse from the dispatch that made the handle."""

    token_list: torch.Tensor        # [R, N] int32: tokens sent to each rank, in order
    send_pos: torch.Tensor          # [N + 1, R] int32: position of each token in each list
    exchange: torch.Tensor          # int32: the count exchange's result (notify_kernel.notify_dispatch)
    host_prefix: list[int] | None = None    # rank_prefix_matrix row-major, when read back
    # Worked out from host_prefix by the first combine (not on the fresh dispatch's path):
    counts: list[list[int]] | None = None   # [s][d]: rows rank s sends to rank d
    max_send_rows: int | None = None        # largest number of rows any rank sends
    # The copy engines' blocks (combine_copy_engine.combine_copies): what the combine returns to
    # each peer, which is also the block each peer's dispatch rows fill here.
    combine_copies: list[tuple[int, int, int, int]] | None = None
    # Cached dispatches of this handle: where their receive half writes the source indices,
    # which a cached dispatch does not return (made by the first one).
    cached_recv_src: torch.Tensor | None = None

    def copy_blocks(self, rank: int) -> list[tuple[int, int, int, int]]:
        """``combine_copies``, worked out from ``counts`` (``host_counts`` first) the first time."""
        if self.combine_copies is None:
            assert self.counts is not None
            self.combine_copies = combine_copies(self.counts, rank)
        return self.combine_copies

    def recv_src_scratch(self, rows: int, device: torch.device) -> torch.Tensor:
        """Where a cached dispatch's receive half writes the source indices it does not return:
        one scratch tensor per handle (every such call writes the same values)."""
        if self.cached_recv_src is None:
            self.cached_recv_src = torch.empty(rows, dtype=torch.int32, device=device)
        return self.cached_recv_src

    def on_copy_engines(self, tuned: bool, num_ranks: int) -> bool:
        """Whether a call made with this plan moves its rows on the copy engines: when the
        tuning sends them there (``tuned``) and the dispatch's counts are on the host (which this
        works out first, ``host_counts``)."""
        return self.host_counts(num_ranks) is not None and tuned

    def host_counts(self, num_ranks: int) -> list[list[int]] | None:
        """``counts`` (and ``max_send_rows``), worked out from ``host_prefix`` the first time; None
        when the dispatch did not read its counts back (num_worst_tokens)."""
        if self.counts is None and self.host_prefix is not None:
            self.counts = count_rows_from_prefix(self.host_prefix, num_ranks)
            self.max_send_rows = max(map(sum, self.counts))
        return self.counts
