"""The decode-time path of the low-latency calls: a repeat costs a few attribute reads and one launch.

A decode server makes the same low-latency call (same options, same tensor shapes) twice per
MoE layer per step. The general path (``Buffer`` checks, request objects, the launch variant's
lookup, ``FastLauncher``'s conversion of every changing argument) costs several times the
launch itself in Python, which a decode step pays on its critical path.

A ``LowLatencyDispatchReplay`` / ``LowLatencyCombineReplay`` stands for one such call shape.
The general path fills it as it runs (``learn``): per receive slot, the compiled launches it
made (``launcher._Setup``: the kernel and its raw argument list, tensors as addresses) and the
outputs it reused. A repeat then checks its tensors (dtype, contiguity, device, 16-byte
alignment: what those launches were compiled for; the shapes are part of the key that found
the replay), writes the addresses that change into the argument lists and launches them. The
call order (slots, pending hooks), the status word and the zero-copy buffer index live in the
``LowLatencyCalls`` the engine shares with its replays, so the two paths interleave freely.
Anything unusual (a slot not learnt yet, a pending hook on the slot, a time-out report, a tensor
that does not fit) returns None, and the caller takes the general path, which checks
everything and raises with the message.

Under Triton's interpreter ``FastLauncher`` makes no compiled launches, so nothing is learnt and
every call takes the general path; ``tests/test_low_latency_fast.py`` checks the arguments a
replay writes against the general path's with the launches recorded instead of run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tritonep.backends.nvlink.low_latency.call_order import CallOrder, LowLatencyCalls
from tritonep.backends.nvlink.low_latency.combine_kernel import low_latency_combine_kernel
from tritonep.backends.nvlink.low_latency.dispatch_kernel import low_latency_dispatch_kernel
from tritonep.backends.nvlink.low_latency.outputs import DispatchOutputs
from tritonep.core.event import NO_EVENT
from tritonep.core.handles import LowLatencyHandle
from tritonep.runtime.launcher import argument_positions, current_stream

_BF16, _INT64, _INT32, _FLOAT32 = torch.bfloat16, torch.int64, torch.int32, torch.float32

# Where a repeat writes its call's values in the learnt argument lists. Call shapes that differ
# only in the number of tokens share compiled launches: each call writes its own.
_D_X, _D_TOPK_IDX, _D_TOKENS, _D_RECV_STATS, _D_WAIT_STATS = argument_positions(
    low_latency_dispatch_kernel, "x_ptr", "topk_idx_ptr", "num_tokens", "recv_stats_ptr", "wait_stats_ptr")
_COMBINE_CHANGES = argument_positions(
    low_latency_combine_kernel, "x_ptr", "src_info_ptr", "topk_slot_ptr", "layout_range_ptr", "topk_idx_ptr",
    "topk_weights_ptr", "out_ptr", "dispatch_mask_ptr", "wait_stats_ptr", "num_tokens")
# NVSHMEM's combines put from the zero-copy buffer of the call (None with plain stores).
_C_SEND_AREA, = argument_positions(low_latency_combine_kernel, "send_area")


def _fits(tensor: torch.Tensor, dtype: torch.dtype, device_index: int) -> bool:
    """dtype, contiguity and device (the shape was part of the key that found the call shape)."""
    return tensor.dtype is dtype and tensor.is_contiguous() and tensor.get_device() == device_index


def _stats_fit(stats: torch.Tensor | None, dtype: torch.dtype, shape: tuple[int], device_index: int) -> bool:
    return stats is None or (type(stats) is torch.Tensor and stats.shape == shape
                             and _fits(stats, dtype, device_index))


class _Slots:
    """What the general path learnt per receive slot: [first launch, receive launch] (the
    receive launch only with a hook) and the outputs."""

    def __init__(self) -> None:
        self.launches: list[list[Any]] = [[None, None], [None, None]]
        self.outputs: list[Any] = [None, None]

    def learn(self, slot: int, first: Any, outputs: Any) -> None:
        if first is not None:
            self.launches[slot][0] = first
            self.outputs[slot] = outputs

    def learn_receive(self, slot: int, receive: Any) -> None:
        if receive is not None:
            self.launches[slot][1] = receive


def _receive_hook(calls: LowLatencyCalls, order: CallOrder, call: int, slot: int, receive: Any,
                  changes: tuple[tuple[int, int], ...], after: Callable[[], None] | None,
                  keep: tuple) -> Callable[[], None]:
    """The receive hook of a replayed call: the general hook's checks, then the learnt receive
    launch with this call's addresses. ``keep``: the call's tensors, alive until the hook (as
    the general path's hook keeps them): the receive half reads some of them (a combine's
    top-k weights), and a caller may drop its references before running the hook."""
    def hook() -> None:
        calls.check_status()
        order.finish(call, slot)
        raw = receive.args
        for index, value in changes:
            raw[index] = value
        receive(current_stream())
        if after is not None:
            after()
    hook.keep_alive = keep   # type: ignore[attr-defined]
    return hook


class LowLatencyDispatchReplay:
    """One low-latency dispatch shape: (x shape, top-k shape, T, E, fp8 options, hook, which
    statistics are given)."""

    def __init__(self, calls: LowLatencyCalls, hook: bool, num_max_tokens: int, hidden: int, num_experts: int,
                 num_ranks: int) -> None:
        self.calls, self.hook = calls, hook
        # The same objects for the engine's life (cleaning resets them in place): read once.
        self.order, self.status_view = calls.dispatch_order, calls.status.view
        self.num_max_tokens, self.hidden, self.num_experts = num_max_tokens, hidden, num_experts
        self.buffer_id, self.device_index = calls.buffer_id, calls.device_index
        self.local_shape, self.rank_shape = (num_experts // num_ranks,), (num_ranks,)
        self.slots = _Slots()
        self.results: list[tuple | None] = [None, None]

    def _result(self, slot: int, received: bool) -> tuple:
        """(packed_recv_x, packed_recv_count, handle, event) of a call in ``slot``."""
        outputs: DispatchOutputs = self.slots.outputs[slot]
        handle = outputs.handle(self.num_max_tokens, self.hidden, self.num_experts, self.buffer_id, received)
        return outputs.packed, outputs.packed_count, handle, NO_EVENT

    def __call__(self, x: torch.Tensor, topk_idx: torch.Tensor, recv_stats: torch.Tensor | None,
                 wait_stats: torch.Tensor | None) -> tuple | None:
        """Buffer.low_latency_dispatch's return value, or None: take the general path. (Written
        for few Python operations, as LowLatencyCombineReplay's.)"""
        order, device = self.order, self.device_index
        slot = order.sent & 1
        first, receive = self.slots.launches[slot]
        if (first is None or (self.hook and receive is None) or slot in order.pending or self.status_view[0]
                or x.dtype is not _BF16 or not x.is_contiguous() or x.get_device() != device
                or topk_idx.dtype is not _INT64 or not topk_idx.is_contiguous() or topk_idx.get_device() != device
                or not _stats_fit(recv_stats, _INT32, self.local_shape, device)
                or not _stats_fit(wait_stats, _INT64, self.rank_shape, device)):
            return None
        x_address, topk_address = x.data_ptr(), topk_idx.data_ptr()
        recv_stats_address = 0 if recv_stats is None else recv_stats.data_ptr()
        wait_stats_address = 0 if wait_stats is None else wait_stats.data_ptr()
        if (x_address | topk_address | recv_stats_address | wait_stats_address) & 15:
            return None
        # CallOrder.start, its check done above.
        call = order.sent = order.sent + 1
        raw = first.args
        raw[_D_X], raw[_D_TOPK_IDX], raw[_D_TOKENS] = x_address, topk_address, x.shape[0]
        if recv_stats is not None:
            raw[_D_RECV_STATS] = recv_stats_address
        if wait_stats is not None:
            raw[_D_WAIT_STATS] = wait_stats_address
        first(current_stream())
        if not self.hook:   # every such call of a slot returns the same, received: made once
            result = self.results[slot]
            if result is None:
                result = self.results[slot] = self._result(slot, True)[:4] + (None,)
            return result
        order.pending[slot] = call
        packed, packed_count, handle, _ = self._result(slot, False)
        state = handle.backend_state

        def received() -> None:
            state.received = True

        changes = [(_D_X, x_address), (_D_TOPK_IDX, topk_address), (_D_TOKENS, x.shape[0])]
        if recv_stats is not None:
            changes.append((_D_RECV_STATS, recv_stats_address))
        if wait_stats is not None:
            changes.append((_D_WAIT_STATS, wait_stats_address))
        return packed, packed_count, handle, NO_EVENT, _receive_hook(
            self.calls, order, call, slot, receive, tuple(changes), received, (x, topk_idx, recv_stats, wait_stats))


class LowLatencyCombineReplay:
    """One low-latency combine shape: (T, H, E, top-k shape, zero copy, hook, wait statistics
    given); with or without ``out`` alike (without, the output is the engine's per-slot one).
    ``zero_copy_addresses``: the two zero-copy send buffers' (the general path makes a view of
    one)."""

    def __init__(self, calls: LowLatencyCalls, hook: bool, zero_copy: bool, num_max_tokens: int, hidden: int,
                 num_experts: int, num_ranks: int, zero_copy_addresses: tuple[int, int]) -> None:
        self.calls, self.hook, self.zero_copy = calls, hook, zero_copy
        # The same objects for the engine's life (cleaning resets them in place): read once.
        self.order, self.status_view = calls.combine_order, calls.status.view
        self.hidden, self.buffer_id, self.device_index = hidden, calls.buffer_id, calls.device_index
        self.x_shape = (num_experts // num_ranks, num_ranks * num_max_tokens, hidden)
        self.rank_shape = (num_ranks,)
        self.slots = _Slots()
        self.zero_copy_addresses = zero_copy_addresses

    def __call__(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: LowLatencyHandle,
                 out: torch.Tensor | None, wait_stats: torch.Tensor | None) -> tuple | None:
        """Buffer.low_latency_combine's return value, or None: take the general path. (Written
        for few Python operations: this runs twice per MoE layer per decode step.)"""
        calls, order, device = self.calls, self.order, self.device_index
        slot = order.sent & 1
        first, receive = self.slots.launches[slot]
        state = handle.backend_state
        if (first is None or (self.hook and receive is None) or slot in order.pending or self.status_view[0]
                or handle.buffer_id != self.buffer_id or not state.received
                or x.dtype is not _BF16 or x.shape != self.x_shape or not x.is_contiguous() or x.get_device() != device
                or topk_idx.dtype is not _INT64 or not topk_idx.is_contiguous() or topk_idx.get_device() != device
                or type(topk_weights) is not torch.Tensor or topk_weights.dtype is not _FLOAT32
                or topk_weights.shape != topk_idx.shape or not topk_weights.is_contiguous()
                or topk_weights.get_device() != device
                or not (out is None or (type(out) is torch.Tensor and out.shape == (topk_idx.shape[0], self.hidden)
                                        and _fits(out, _BF16, device)))
                or not _stats_fit(wait_stats, _INT64, self.rank_shape, device)):
            return None
        # The handle's tensors and the engine's outputs are the engine's own (16-byte aligned);
        # only the caller's may not be.
        src_info_address, topk_slot_address, layout_address, dispatch_mask_address = state.addresses
        source = self.zero_copy_addresses[calls.combine_buffer_index] if self.zero_copy else x.data_ptr()
        topk_address, weights_address = topk_idx.data_ptr(), topk_weights.data_ptr()
        out_address = self.slots.outputs[slot].data_ptr() if out is None else out.data_ptr()
        stats_address = layout_address if wait_stats is None else wait_stats.data_ptr()
        if (source | topk_address | weights_address | out_address | stats_address) & 15:
            return None
        raw = first.args
        if raw[_C_SEND_AREA] is not None:
            raw[_C_SEND_AREA] = self.zero_copy_addresses[calls.combine_buffer_index]
        calls.combine_buffer_index ^= 1
        # CallOrder.start, its check done above.
        call = order.sent = order.sent + 1
        x_arg, src_info_arg, topk_slot_arg, layout_arg, topk_arg, weights_arg, out_arg, mask_arg, stats_arg, \
            tokens_arg = _COMBINE_CHANGES
        raw[x_arg], raw[src_info_arg], raw[topk_slot_arg], raw[layout_arg] = \
            source, src_info_address, topk_slot_address, layout_address
        raw[topk_arg], raw[weights_arg], raw[out_arg], raw[mask_arg], raw[stats_arg], raw[tokens_arg] = \
            topk_address, weights_address, out_address, dispatch_mask_address, stats_address, topk_idx.shape[0]
        first(current_stream())
        if out is None:
            out = self.slots.outputs[slot]   # the engine's combine output for this slot
        if not self.hook:
            return out, NO_EVENT, None
        order.pending[slot] = call
        changes = tuple((index, raw[index]) for index in _COMBINE_CHANGES)
        return out, NO_EVENT, _receive_hook(calls, order, call, slot, receive, changes, None,
                                             (x, topk_idx, topk_weights, out, wait_stats))
