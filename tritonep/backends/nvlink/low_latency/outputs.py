"""The tensors low-latency calls return, and what a dispatch's handle carries for its combine.

Outputs are made once per call shape and receive slot and reused by every second call: the
SPEC allows two low-latency results alive at once, no more (calls alternate between two
slots), and allocating a call's outputs costs a large part of a decode-time call's host time.
A caller who keeps a result longer passes ``out`` (combine) or copies it.
"""

from __future__ import annotations

import torch

from tritonep.core import fp8
from tritonep.core.handles import LowLatencyHandle


class DispatchOutputs:
    """One dispatch shape's outputs in one slot: what the call returns (``packed``: the bf16 rows,
    or (e4m3 rows, scales); ``packed_count``), what its handle holds (``src_info``,
    ``layout_range``, ``topk_slot``, ``dispatch_mask``) and the kernel's views of the rows
    (``packed_words``: int32 words; ``scales_storage``: the scales' storage, the rows where
    there are none). ``addresses``: those of the handle's tensors, which a replayed combine
    writes into its launch."""

    __slots__ = ("packed", "packed_words", "scales_storage", "packed_count", "src_info", "layout_range",
                 "topk_slot", "dispatch_mask", "addresses")

    def __init__(self, num_max_tokens: int, hidden: int, num_ranks: int, num_experts: int, use_fp8: bool,
                 use_ue8m0: bool, device: torch.device) -> None:
        experts_local, rows = num_experts // num_ranks, num_ranks * num_max_tokens
        if use_fp8:
            packed_x = torch.empty(experts_local, rows, hidden, dtype=fp8.FP8_DTYPE, device=device)
            scale_columns = hidden // 512 if use_ue8m0 else hidden // 128
            scale_dtype = torch.int32 if use_ue8m0 else torch.float32
            # Column-major in the last two dims, as DeepEP's kernels write them.
            self.scales_storage = torch.empty(experts_local, scale_columns, rows, dtype=scale_dtype, device=device)
            self.packed: torch.Tensor | tuple[torch.Tensor, torch.Tensor] = (
                packed_x, self.scales_storage.transpose(1, 2))
        else:
            packed_x = torch.empty(experts_local, rows, hidden, dtype=torch.bfloat16, device=device)
            self.scales_storage = packed_x
            self.packed = packed_x
        self.packed_words = packed_x.view(torch.int32)
        self.packed_count = torch.empty(experts_local, dtype=torch.int32, device=device)
        self.src_info = torch.empty(experts_local, rows, dtype=torch.int32, device=device)
        self.layout_range = torch.empty(experts_local, num_ranks, dtype=torch.int64, device=device)
        self.topk_slot = torch.empty(experts_local, rows, dtype=torch.int8, device=device)
        self.dispatch_mask = torch.zeros(num_ranks, dtype=torch.int32, device=device)
        self.addresses = (self.src_info.data_ptr(), self.topk_slot.data_ptr(), self.layout_range.data_ptr(),
                          self.dispatch_mask.data_ptr())

    def handle(self, num_max_tokens: int, hidden: int, num_experts: int, buffer_id: int,
               received: bool) -> LowLatencyHandle:
        """The handle of a dispatch into these outputs."""
        return LowLatencyHandle(self.src_info, self.layout_range, num_max_tokens, hidden, num_experts, buffer_id,
                                HandleState(self, received))


class HandleState:
    """What a low-latency handle carries for its combine besides its five elements:
    ``topk_slot`` (int8 [E/R, R*T]: which top-k entry of its token each row is),
    ``dispatch_mask`` (int32 [R]: the ranks the dispatch skipped, shrink mode), ``received``
    (the dispatch's receive half ran: a combine needs it) and ``addresses``, those of
    (src_info, topk_slot, layout_range, dispatch_mask)."""

    __slots__ = ("topk_slot", "dispatch_mask", "received", "addresses")

    def __init__(self, outputs: DispatchOutputs, received: bool) -> None:
        self.topk_slot, self.dispatch_mask, self.addresses = outputs.topk_slot, outputs.dispatch_mask, \
            outputs.addresses
        self.received = received


class CombineOutputs:
    """The bf16 [T, H] output of combines made without ``out``, one per (slot, T, H)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._outputs: dict[tuple[int, int, int], torch.Tensor] = {}

    def rows(self, slot: int, num_max_tokens: int, hidden: int, num_tokens: int) -> torch.Tensor:
        """The first ``num_tokens`` rows of ``slot``'s output for (T, H)."""
        output = self._outputs.get((slot, num_max_tokens, hidden))
        if output is None:
            output = self._outputs[(slot, num_max_tokens, hidden)] = torch.empty(
                num_max_tokens, hidden, dtype=torch.bfloat16, device=self.device)
        return output[:num_tokens]

    def clear(self) -> None:
        self._outputs.clear()
