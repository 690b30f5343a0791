"""What a normal-mode dispatch works out once per call shape.

``DispatchShape``: everything dispatches of one (x dtype and hidden, scales, top-k, experts,
num_sms) share: the staging regions, the program split, the kernel constants, the launches'
setup keys and fixed argument groups, and the rows the latest fresh dispatch of the shape
received, from which the next one sizes its outputs before its counts are known
(``guess_rows``). ``dispatch_outputs`` allocates a dispatch's outputs, and
``handle_fields_arguments`` those of V2's handle fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton

from tritonep.backends.base import DispatchRequest
from tritonep.backends.nvlink.memory import MAX_CHANNELS, StagingLayout, SymmetricBuffer
from tritonep.backends.nvlink.tuning import Tuning, split_programs, tile_block, tile_shape
from tritonep.core.expert_layout import HandleFieldsRequest, LayoutSizes
from tritonep.runtime.launcher import DeviceAddress
from tritonep.runtime.platform import GPU_KERNELS


class Placeholders:
    """One-element tensors passed for absent outputs: the kernel's branches that store to
    staging or to the output must see pointers of the same element type. Made once per dtype,
    not on every call."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._made: dict[torch.dtype, torch.Tensor] = {}

    def __call__(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._made:
            self._made[dtype] = torch.empty(1, dtype=dtype, device=self._device)
        return self._made[dtype]


@dataclass
class DispatchShape:
    """What every dispatch of one shape shares, worked out once per engine and tuning."""

    x_words: int
    scale_words: int
    num_topk: int
    experts_per_rank: int
    capacity: int
    senders: int
    receivers: int
    send_constants: dict
    receive_constants: dict
    send_setup: tuple
    receive_setup: tuple
    # One launch of both halves, senders first (a dispatch whose counts are on the GPU already);
    # with one rank, which sends nothing, the receive half alone.
    both_programs: int
    both_constants: dict
    both_setup: tuple
    # The cached dispatch whose copy engines receive: senders only, all num_sms of them (they also
    # copy our own rows; dispatch_copy_engine.py).
    copy_programs: int
    copy_constants: dict
    copy_setup: tuple
    unused_outputs: tuple   # the send half's outputs group: placeholders of the right types
    no_fields: tuple        # the handle fields' group of a launch without them (placeholders, zeros)
    staging: tuple          # the kernel's staging-area group (dispatch_kernel.py)
    last_fresh_rows: int | None = None   # rows the latest fresh dispatch of this shape received
    _fields_constants: dict = field(default_factory=dict)
    _fields_layouts: dict = field(default_factory=dict)

    @property
    def row_bytes(self) -> int:
        return 4 * self.x_words

    @staticmethod
    def make(key: tuple, x_words: int, scale_words: int, num_topk: int, num_experts: int, num_sms: int, *,
             tuning: Tuning, memory: SymmetricBuffer, staging: StagingLayout, placeholders: Placeholders,
             launch_generation: int) -> DispatchShape:
        """The shape of dispatches keyed ``key`` (rows of ``x_words`` 4-byte words) on ``memory``'s
        rank; ``launch_generation`` goes into the setup keys (``NormalState``)."""
        R, t = memory.num_ranks, tuning
        capacity, regions = staging.dispatch(x_words, scale_words, num_topk)
        senders, receivers = split_programs(num_sms, t.sender_fraction)
        if R == 1:   # nothing to send (no send half is launched): every program copies our own rows
            receivers += senders
        constants = dict(
            TAIL_WORD=memory.signals.dispatch_tail, DONE_WORD=memory.signals.dispatch_done,
            ARRIVED_WORD=memory.signals.dispatch_arrived, COPY_RECEIVE=False,
            MAX_CHANNELS=MAX_CHANNELS, NUM_RANKS=R, NUM_SENDERS=senders, NUM_RECEIVERS=receivers,
            HAS_SCALES=scale_words > 0, HAS_TOPK=num_topk > 0, NUM_TOPK=max(num_topk, 1),
            TOPK_PAD=triton.next_power_of_2(max(num_topk, 1)), SCALE_PAD=triton.next_power_of_2(max(scale_words, 1)),
            GPU=GPU_KERNELS, **tile_shape(t.rows, 4 * x_words),
            # V2's handle fields: off, their shapes unused (``fields_constants`` sets them), so that
            # every other launch compiles as one variant whatever they would be.
            LAYOUT=False, PAD_ROWS=False, RANKS_PAD=1, SCALEUP_RANKS=1, SCALEUP_PAD=1, EXPERTS_PAD=1, META_PAD=1)
        constants["BLOCK"] = tile_block(t.block, constants["ROWS"], x_words)
        unused = placeholders(torch.int32)
        send, receive = dict(constants, SEND=True, RECEIVE=False), dict(constants, SEND=False, RECEIVE=True)
        send_setup, receive_setup = (launch_generation, key, "send"), (launch_generation, key, "receive")
        both = (senders + receivers, dict(constants, SEND=True, RECEIVE=True), (launch_generation, key, "both")) \
            if R > 1 else (receivers, receive, receive_setup)
        everyone = max(1, min(num_sms, MAX_CHANNELS))
        copy = (everyone, dict(constants, NUM_SENDERS=everyone, SEND=True, RECEIVE=False, COPY_RECEIVE=True),
                (launch_generation, key, "copy"))
        return DispatchShape(
            x_words, scale_words, num_topk, max(num_experts // R, 1), capacity, senders, receivers,
            send, receive, send_setup, receive_setup, *both, *copy,
            (unused, unused, placeholders(torch.int64), placeholders(torch.float32), unused, 0, 0),
            (unused, placeholders(torch.int64), unused, unused, 0, 0, 1, 0, 0),
            (memory.peer_base_ptrs, memory.rank, *regions, capacity))

    def fields_constants(self, constants: dict, num_scaleup_ranks: int, pad_rows: bool) -> dict:
        """``constants`` (a receiving launch's) with V2's handle fields on, made once per kind."""
        key = (id(constants), num_scaleup_ranks, pad_rows)
        made = self._fields_constants.get(key)
        if made is None:
            pow2 = triton.next_power_of_2
            made = self._fields_constants[key] = dict(
                constants, LAYOUT=True, PAD_ROWS=pad_rows, RANKS_PAD=pow2(constants["NUM_RANKS"]),
                SCALEUP_RANKS=num_scaleup_ranks, SCALEUP_PAD=pow2(num_scaleup_ranks),
                EXPERTS_PAD=pow2(self.experts_per_rank), META_PAD=pow2(constants["NUM_TOPK"] + 2))
        return made

    def fields_layout(self, rows: int, num_tokens: int, num_scaleup_ranks: int, copy_topk_idx: bool
                     ) -> tuple[LayoutSizes, int, int | None]:
        """V2's handle fields for ``rows`` rows and ``num_tokens`` tokens of this shape: their
        ``LayoutSizes``, the words of their block and where it holds the topk_idx copy (None:
        no copy), worked out once per kind (a fresh dispatch's host time is mostly such work)."""
        key = (rows, num_tokens, num_scaleup_ranks, copy_topk_idx)
        made = self._fields_layouts.get(key)
        if made is None:
            if len(self._fields_layouts) >= 64:   # token and row counts that vary from call to call
                self._fields_layouts.clear()
            sizes = LayoutSizes(self.experts_per_rank, num_scaleup_ranks, rows, self.num_topk, num_tokens, None)
            made = self._fields_layouts[key] = (sizes, sizes.block_words(copy_topk_idx),
                                               sizes.topk_copy_at() if copy_topk_idx else None)
        return made


def guess_rows(shape: DispatchShape, tuning: Tuning) -> int | None:
    """Rows to allocate for a fresh dispatch before its counts are known: the previous fresh
    dispatch's count of this shape with some room, at most what staging holds; None (allocate
    after the read-back) for the first one, or when the tuning says so."""
    last, t = shape.last_fresh_rows, tuning
    # (Not when the send half waits for the read-back: it would queue behind this receive,
    # which waits for the peers' send halves, queued behind their receives.)
    if last is None or not t.receive_before_sync or not t.send_before_sync:
        return None
    return min(shape.capacity, last + int(last * t.fresh_slack) + 64)


def dispatch_outputs(x: torch.Tensor, scales: torch.Tensor | None, shape: DispatchShape, has_topk: bool, rows: int,
                     pad: bool, device: torch.device, recv_src: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor | None, ...]:
    """(recv_x, recv_scales, recv_idx, recv_weights, recv_src) of ``rows`` rows; with ``pad``
    (``num_worst_tokens``) rows past what arrives read as empty: source -1, expert -1, weight 0.
    ``recv_src``: int32 [rows] to use instead of a new one (a cached dispatch's scratch)."""
    recv_x = torch.empty(rows, x.shape[1], dtype=x.dtype, device=device)
    recv_scales = None if scales is None else torch.empty(rows, shape.scale_words, dtype=scales.dtype, device=device)
    recv_idx = torch.empty(rows, shape.num_topk, dtype=torch.int64, device=device) if has_topk else None
    recv_weights = torch.empty(rows, shape.num_topk, dtype=torch.float32, device=device) if has_topk else None
    if recv_src is None:
        recv_src = torch.empty(rows, dtype=torch.int32, device=device)
    if pad:
        recv_src.fill_(-1)
        if has_topk:
            recv_idx.fill_(-1)
            recv_weights.zero_()
    return recv_x, recv_scales, recv_idx, recv_weights, recv_src


def handle_fields_arguments(request: DispatchRequest, fields: HandleFieldsRequest, shape: DispatchShape,
                            send_pos: torch.Tensor, rows: int, placeholders: Placeholders, device: torch.device
                            ) -> tuple[tuple, torch.Tensor, int | None]:
    """The dispatch kernel's handle-fields group for a launch into ``rows`` output rows, the
    block it writes and where the block holds the topk_idx copy (None: no copy). A block sized
    for ``rows`` holds every field of fewer rows in place (``LayoutSizes``); the copy follows
    the fields. ``send_pos``: the send plan's positions (notify_kernel.py)."""
    num_tokens = request.topk_idx.shape[0]
    copy_topk = fields.copy_topk_idx
    _, words, copy_at = shape.fields_layout(rows, num_tokens, fields.num_scaleup_ranks, copy_topk)
    block = torch.empty(words, dtype=torch.int32, device=device)
    stats = fields.stats
    args = (block, DeviceAddress(block, 4 * copy_at, torch.int64) if copy_topk else placeholders(torch.int64),
            stats if stats is not None else placeholders(torch.int32), send_pos, num_tokens,
            request.num_max_tokens_per_rank, request.expert_alignment, int(stats is not None), int(copy_topk))
    return args, block, copy_at
