"""V2's dispatch and combine as requests to one backend, plus the plain-torch work around them.

A fresh V2 dispatch is a V1 dispatch of the same routing (``get_dispatch_layout``, then
``dispatch`` with ``num_worst_tokens = R * T`` when there is no CPU sync; on the NVLink backend
the dispatch's count exchange works the layout out itself, with no launch or tensors of its
own, since V2 returns none of them) and the handle's
fields (:mod:`tritonep.core.expert_layout` defines them): on the NVLink backend its dispatch's
receivers write them (``DispatchRequest.handle_fields``), except for the expanded layout, which,
like every field on the other backends, the backend works out from what its dispatch left
(``Backend.expert_layout``: one launch on the NVLink backend, plain torch on the collective
one); and, for ``do_expand``, the rows copied to
their expanded places (:mod:`tritonep.v2.expand`). A cached dispatch is the engine's cached
dispatch, or, when it also carries top-k weights (which an engine's cached dispatch does not
move), a fresh engine dispatch of the handle's top-k. Combine asks the backend for V2's
weights (``OwnSlots``: each slot's weight from its expert's rank only) and, expanded, first sums
each token's expert rows. Everything runs inside the caller's stream
scope (``runtime/streams.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tritonep.backends.base import Backend, CombineRequest, DispatchRequest, DispatchResult, OwnSlots
from tritonep.core.config import Config
from tritonep.core.expert_layout import ExpertLayoutRequest, HandleFieldsRequest, expand_weights
from tritonep.core.replay import ReplayTable, handle_replay, learn_handle_replay
from tritonep.v2 import expand
from tritonep.v2.checks import CombineCall, DispatchCall
from tritonep.v2.event import EventOverlap
from tritonep.v2.handle import EPHandle, HandleState

# Replay keys of the calls made with an engine handle (its ReplayTable; see core/replay.py).
_CACHED_DISPATCH, _COMBINE = "v2_cached_dispatch", "v2_combine"

# TMA-aligned column-major scales: each column's stride is a multiple of 4 packs (16 bytes).
_SF_COLUMN_PACKS = 4


@dataclass
class Engine:
    """What the calls need of their ElasticBuffer."""

    backend: Backend
    rank: int
    num_ranks: int
    num_scaleup_ranks: int
    buffer_id: int
    configs: dict[int, Config] = field(default_factory=dict)   # per num_sms: the backends only read them
    # The latest cached dispatch and combine replays of any engine handle, by their keys: a new
    # handle's first such call rebinds one (core/replay.py).
    handle_replays: ReplayTable = field(default_factory=ReplayTable)

    def config(self, num_sms: int) -> Config:
        """The engine Config for ``num_sms`` programs, made once per count."""
        config = self.configs.get(num_sms)
        if config is None:
            config = self.configs[num_sms] = Config(num_sms=num_sms)
        return config


@dataclass
class Options:
    """A dispatch's options that do not change the routing."""

    num_sms: int
    do_zero_padding: bool = False
    do_handle_copy: bool = True
    col_major_sf: bool = False
    stats: torch.Tensor | None = None
    before_epilogue: EventOverlap | None = None


@dataclass
class Received:
    """A dispatch's outputs (recv_x split from its scales)."""

    x: torch.Tensor
    scales: torch.Tensor | None
    topk_idx: torch.Tensor | None
    topk_weights: torch.Tensor | None
    handle: EPHandle

    def outputs(self, event: EventOverlap) -> tuple:
        """dispatch's return value: (recv_x, recv_topk_idx, recv_topk_weights, handle, event)."""
        recv_x = self.x if self.scales is None else (self.x, self.scales)
        return recv_x, self.topk_idx, self.topk_weights, self.handle, event

    def tensors(self) -> tuple:
        """Every tensor made on the communication stream that the caller's stream may read: the
        outputs and the handle's (``runtime.streams`` records them on the caller's stream)."""
        handle, state = self.handle, self.handle._state
        return (self.x, self.scales, self.topk_idx, self.topk_weights, handle.topk_idx, state.layout.block,
                state.recv_topk_idx)


def wait_for(event: EventOverlap | None) -> None:
    """The current stream waits for ``event`` (V2's ``previous_event_before_epilogue``)."""
    if event is not None and event.event is not None:
        torch.cuda.current_stream().wait_event(event.event)


def _col_major(scales: torch.Tensor | None, enabled: bool) -> torch.Tensor | None:
    """V2's ``use_tma_aligned_col_major_sf`` layout: token stride 1, column stride a multiple of 4."""
    if scales is None or not enabled:
        return scales
    rows, columns = scales.shape
    stride = (rows + _SF_COLUMN_PACKS - 1) // _SF_COLUMN_PACKS * _SF_COLUMN_PACKS
    out = torch.empty_strided((rows, columns), (1, max(stride, 1)), dtype=scales.dtype, device=scales.device)
    return out.copy_(scales)


def _engine_dispatch(engine: Engine, call: DispatchCall, weights: torch.Tensor, num_worst_tokens: int,
                     num_sms: int, pad_outputs: bool = True,
                     handle_fields: HandleFieldsRequest | None = None) -> DispatchResult:
    """A fresh engine dispatch of ``call.topk_idx`` (layout, then dispatch; the layout within the
    dispatch where the backend works it out itself, ``Backend.layout_in_dispatch``). The engine learns T,
    which it compares across ranks, so that padding to R x T needs no later check.
    ``pad_outputs``, ``handle_fields``: as ``DispatchRequest``'s (``pad_outputs`` False only
    with the handle's fields to follow or asked for)."""
    backend = engine.backend
    per_rank = per_expert = in_rank = None   # V2 has no use for them: the backend may work them out
    if not backend.layout_in_dispatch:
        per_rank, per_expert, in_rank = backend.get_dispatch_layout(call.topk_idx, call.num_experts)
    return backend.dispatch(DispatchRequest(
        x=call.x, x_scales=call.scales, topk_idx=call.topk_idx, topk_weights=weights, is_token_in_rank=in_rank,
        num_tokens_per_rank=per_rank, num_tokens_per_expert=per_expert, num_experts=call.num_experts,
        expert_alignment=call.expert_alignment, num_worst_tokens=num_worst_tokens, cached_handle=None,
        config=engine.config(num_sms), num_max_tokens_per_rank=call.num_max_tokens_per_rank, pad_outputs=pad_outputs,
        handle_fields=handle_fields))


def fresh_dispatch(engine: Engine, call: DispatchCall, options: Options) -> Received:
    """A dispatch without a handle: the engine's, with the handle's fields written by the
    dispatch itself where the backend can (the NVLink backend, not expanded), else from the
    backend's ``expert_layout`` after it; expanded, then the rows in their expanded places."""
    R, T = engine.num_ranks, call.num_max_tokens_per_rank
    num_tokens, num_topk = call.topk_idx.shape
    experts_per_rank = call.num_experts // R
    # The engines move top-k weights with top-k ids; V2 lets a dispatch go without weights.
    weights = call.topk_weights if call.topk_weights is not None else \
        torch.zeros(num_tokens, num_topk, dtype=torch.float32, device=call.x.device)
    # Without a CPU sync the outputs are padded to R * T rows: whatever writes the handle's
    # fields writes the padding's empty values too (``DispatchRequest.pad_outputs``).
    in_dispatch = None if call.do_expand else HandleFieldsRequest(engine.num_scaleup_ranks, options.do_handle_copy,
                                                                  options.stats)
    result = _engine_dispatch(engine, call, weights, 0 if call.do_cpu_sync else R * T, options.num_sms,
                              pad_outputs=False, handle_fields=in_dispatch)
    wait_for(options.before_epilogue)
    engine_handle, recv_idx, recv_weights = result.handle, result.recv_topk_idx, result.recv_topk_weights
    assert recv_idx is not None and recv_weights is not None
    rows = engine_handle.num_recv_rows
    if call.do_cpu_sync:
        expert_list = result.num_recv_tokens_per_expert_list or []
        # Not expanded, the handle sums the counts when its num_expanded_tokens is first read.
        num_recv, num_expanded = rows, sum(expert_list) if call.do_expand else None
    else:
        expert_list = []
        num_recv = R * T
        num_expanded = expand.worst_expanded_rows(R, T, num_topk, experts_per_rank, call.expert_alignment)
    fields = result.layout if result.layout is not None else engine.backend.expert_layout(ExpertLayoutRequest(
        engine_handle, call.topk_idx, recv_idx, recv_weights, experts_per_rank, call.expert_alignment, T,
        engine.num_scaleup_ranks, num_expanded if call.do_expand else None, options.do_handle_copy, options.stats))
    recv_x, recv_scales = result.recv_x, result.recv_x_scales
    if call.do_expand:
        assert fields.expanded_source is not None
        recv_x = expand.expand_rows(recv_x, fields.expanded_source, options.do_zero_padding)
        if recv_scales is not None:
            recv_scales = expand.expand_rows(recv_scales, fields.expanded_source, options.do_zero_padding)
        recv_weights = fields.expanded_weights
    state = HandleState(engine.buffer_id, engine_handle, recv_idx, fields, rows, call.x.shape[1], experts_per_rank)
    handle = EPHandle(
        do_expand=call.do_expand, num_experts=call.num_experts, expert_alignment=call.expert_alignment,
        num_max_tokens_per_rank=T, num_sms=options.num_sms, num_recv_tokens=num_recv,
        num_expanded_tokens=num_expanded, num_recv_tokens_per_expert_list=expert_list, state=state)
    return Received(recv_x, _col_major(recv_scales, options.col_major_sf), None if call.do_expand else recv_idx,
                    recv_weights if call.topk_weights is not None else None, handle)


def replayed_dispatch(engine: Engine, handle: EPHandle, x: torch.Tensor, scales: torch.Tensor | None, num_sms: int,
                      do_zero_padding: bool, col_major_sf: bool) -> tuple | None:
    """A cached dispatch without top-k weights, on the caller's stream, through the replay its
    engine handle learnt (or another handle's, rebound to it): dispatch's return value
    (``Received.outputs``), or None when there is no replay yet or ``x`` does not fit it (the
    general path then checks everything)."""
    state = handle._state
    replay = handle_replay(engine.handle_replays, (_CACHED_DISPATCH, num_sms, scales is None), state.engine_handle)
    replayed = replay(x, scales) if replay is not None else None
    if replayed is None:
        return None
    if handle.do_expand or (col_major_sf and scales is not None):
        recv_x, recv_scales = replayed if scales is not None else (replayed, None)
        return _cached_outputs(handle, recv_x, recv_scales, None, handle.do_expand, do_zero_padding,
                               col_major_sf).outputs(EventOverlap())
    # The usual repeat (every layer's backward): what _cached_outputs gives, without its calls;
    # the replay returns recv_x as dispatch does (with its scales: a pair).
    return replayed, state.recv_topk_idx, None, handle, EventOverlap()


def cached_dispatch(engine: Engine, call: DispatchCall, options: Options) -> Received:
    """A dispatch with a handle: the same rows to the same places, no count exchange."""
    handle = call.handle
    assert handle is not None
    state = handle._state
    engine_handle = state.engine_handle
    recv_weights = None
    if call.topk_weights is None:
        result = engine.backend.dispatch(DispatchRequest(
            x=call.x, x_scales=call.scales, topk_idx=None, topk_weights=None,
            is_token_in_rank=engine_handle.is_token_in_rank, num_tokens_per_rank=None, num_tokens_per_expert=None,
            num_experts=0, expert_alignment=call.expert_alignment, num_worst_tokens=0,
            cached_handle=engine_handle, config=engine.config(options.num_sms)))
        learn_handle_replay(engine.handle_replays, (_CACHED_DISPATCH, options.num_sms, call.scales is None),
                            engine_handle, result.replay)
        recv_x, recv_scales = result.recv_x, result.recv_x_scales
    else:
        # The rows come in the same order as the handle's (the engines' order is fixed by the
        # routing); padded to the worst case, so that no count is read back, then cut to the
        # handle's rows.
        result = _engine_dispatch(engine, call, call.topk_weights, engine.num_ranks * call.num_max_tokens_per_rank,
                                  options.num_sms)
        recv_x, recv_scales = result.recv_x[:state.rows], result.recv_x_scales
        if recv_scales is not None:
            recv_scales = recv_scales[:state.rows]
        assert result.recv_topk_weights is not None
        recv_weights = result.recv_topk_weights[:state.rows]
    wait_for(options.before_epilogue)
    return _cached_outputs(handle, recv_x, recv_scales, recv_weights, call.do_expand, options.do_zero_padding,
                           options.col_major_sf)


def _cached_outputs(handle: EPHandle, recv_x: torch.Tensor, recv_scales: torch.Tensor | None,
                    recv_weights: torch.Tensor | None, do_expand: bool, do_zero_padding: bool,
                    col_major_sf: bool) -> Received:
    """A cached dispatch's outputs from the engine's rows: expanded by the handle's slots, or
    with the handle's local expert ids. Those are the tensor the fresh dispatch returned, not a
    copy: the routing is the handle's, and no call ever writes that tensor again."""
    state = handle._state
    recv_idx = None
    if do_expand:
        assert state.slots is not None and state.expanded_source is not None
        recv_x = expand.expand_rows(recv_x, state.expanded_source, do_zero_padding)
        if recv_scales is not None:
            recv_scales = expand.expand_rows(recv_scales, state.expanded_source, do_zero_padding)
        if recv_weights is not None:
            recv_weights = expand_weights(recv_weights, state.slots, handle.num_expanded_tokens)
    else:
        recv_idx = state.recv_topk_idx
    return Received(recv_x, _col_major(recv_scales, col_major_sf), recv_idx, recv_weights, handle)


def replayed_combine(engine: Engine, handle: EPHandle, x: torch.Tensor, topk_weights: torch.Tensor | None,
                     num_sms: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """A combine of a non-expanded handle without bias, on the caller's stream, through the
    replay its engine handle learnt: (combined_x, combined_topk_weights), or None as in
    ``replayed_dispatch``. ``topk_weights``: a tensor, which the replay compares with those it
    learnt from a checked call (dtype, shape, strides, device).
    A replay with weights applies the ``OwnSlots`` it was learnt with, which read the handle's
    ``topk_idx`` as it was made (a new handle's first such combine rebinds them to its own): a
    handle whose ``topk_idx`` was replaced takes the general path."""
    state = handle._state
    if topk_weights is not None and handle.topk_idx is not state.topk_idx:
        return None
    key = (_COMBINE, num_sms, topk_weights is None)
    replay = handle_replay(engine.handle_replays, key, state.engine_handle) if topk_weights is None else \
        handle_replay(engine.handle_replays, key, state.engine_handle, state.topk_idx, state.experts_per_rank)
    if replay is None:
        return None
    return replay(x, topk_weights)


def own_slots(handle: EPHandle) -> OwnSlots:
    """V2 gives each slot k the weight from the rank of k's expert, where the engines sum a
    token's weights over ranks: what the backend is asked to do instead."""
    state = handle._state
    return OwnSlots(handle.topk_idx, state.experts_per_rank, state.recv_topk_idx)


def combine(engine: Engine, call: CombineCall, num_sms: int,
            before_epilogue: EventOverlap | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Expert outputs back to their tokens: (combined_x, combined_topk_weights)."""
    handle = call.handle
    state = handle._state
    wait_for(before_epilogue)
    weights = call.topk_weights
    if handle.do_expand:
        assert state.slots is not None
        rows = expand.reduce_rows(call.x, state.slots)
        if weights is not None:
            weights = expand.gather_weights(weights, state.slots)
        slots_of_rank = None
    else:
        rows = call.x
        slots_of_rank = own_slots(handle) if weights is not None else None
    no_bias = call.bias[0] is None and call.bias[1] is None
    result = engine.backend.combine(CombineRequest(rows, state.engine_handle, weights, call.bias,
                                                   engine.config(num_sms), slots_of_rank))
    # A replay with weights reads the topk_idx it learnt with; only the handle's own is kept alive.
    if no_bias and (slots_of_rank is None or slots_of_rank.topk_idx is state.topk_idx):
        learn_handle_replay(engine.handle_replays, (_COMBINE, num_sms, weights is None), state.engine_handle,
                            result.replay)
    return result.combined_x, result.combined_topk_weights
