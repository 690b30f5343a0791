"""The host state every low-latency call of one engine shares, made by the general path or a replay.

Calls of a kind alternate between two slots of receive memory (double buffering), so two calls
of each kind may await their receive hooks at once (two micro-batches in flight, as in DeepEP),
and the hooks may run in any order: each half finds its slot's use counter on the GPU. The host
only picks the slot and remembers which sends still await their hook (``CallOrder``). Rules,
each raising InputError instead of hanging or corrupting: a call may not reuse the slot of a
call still awaiting its hook (a third pending call), and a hook runs once.

``LowLatencyCalls`` holds that bookkeeping for both kinds with the rest of the state the two
paths share: the status word the kernels report time-outs in, which zero-copy buffer the next
combine sends from, and what a replay checks a call against (the Buffer, the device). The
engine and its replays hold the same object, so the two paths interleave freely.
"""

from __future__ import annotations

import warnings

import torch

from tritonep.core.checks import InputError
from tritonep.device.status_codes import MASKED_BIT
from tritonep.runtime.status import StatusWord, masked_after_timeout_message, timeout_error


class CallOrder:
    """Host bookkeeping for one kind of call: the slot each call uses (they alternate) and the
    sends still awaiting their receive hook."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.reset()

    def reset(self) -> None:
        self.sent = 0
        self.pending: dict[int, int] = {}   # slot -> call whose receive hook was not run yet

    @property
    def next_slot(self) -> int:
        return self.sent % 2

    def start(self, with_hook: bool) -> tuple[int, int]:
        """(call number, slot) of the next call."""
        slot = self.next_slot
        if slot in self.pending:
            raise InputError(f"{self.kind}: call {self.pending[slot]} still awaits its receive hook and holds receive "
                             f"slot {slot}, which this call would reuse (calls alternate between two slots, so at "
                             f"most two may await their hooks); run that hook first")
        self.sent += 1
        if with_hook:
            self.pending[slot] = self.sent
        return self.sent, slot

    def finish(self, call: int, slot: int) -> None:
        if self.pending.get(slot) != call:
            raise InputError(f"{self.kind}: this receive hook was already called")
        del self.pending[slot]


class LowLatencyCalls:
    """The state low-latency calls share on the host (see the module's docstring).

    ``combine_buffer_index``: the zero-copy buffer ``get_next_low_latency_combine_buffer``
    returns now; each combine sends from it and flips it. ``device_index``: the CUDA device's
    index, -1 on the CPU (what ``Tensor.get_device()`` returns for tensors on it).
    """

    __slots__ = ("dispatch_order", "combine_order", "status", "combine_buffer_index", "buffer_id", "device_index",
                 "rank", "timeout_ns", "ranks_per_node")

    def __init__(self, buffer_id: int, rank: int, device: torch.device, timeout_ns: int,
                 ranks_per_node: int | None = None) -> None:
        self.dispatch_order = CallOrder("low_latency_dispatch")
        self.combine_order = CallOrder("low_latency_combine")
        # Kernels that time out write (phase, peer) straight into this pinned host word, so
        # checking it costs no copy and no sync.
        self.status = StatusWord()
        self.combine_buffer_index = 0
        self.buffer_id, self.rank, self.timeout_ns = buffer_id, rank, timeout_ns
        self.ranks_per_node = ranks_per_node   # a group split into nodes: errors name them
        self.device_index = device.index if device.type == "cuda" else -1

    @property
    def hooks_pending(self) -> bool:
        return bool(self.dispatch_order.pending or self.combine_order.pending)

    def reset(self) -> None:
        """Both kinds restart at call 0, slot 0 (``clean_low_latency_buffer``)."""
        self.dispatch_order.reset()
        self.combine_order.reset()

    def check_status(self) -> None:
        """Raise if a kernel gave up waiting on a peer; in shrink mode, where the kernel masked
        that peer and the calls went on, warn once instead."""
        code = self.status.code
        if code:
            if code & MASKED_BIT.value:
                self.status.clear()
                warnings.warn(masked_after_timeout_message(code, self.rank, self.timeout_ns), RuntimeWarning,
                              stacklevel=4)
                return
            raise timeout_error(code, self.rank, self.timeout_ns, "low-latency calls", self.ranks_per_node)
