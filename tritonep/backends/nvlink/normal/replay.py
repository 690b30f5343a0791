"""The replays of normal-mode calls made with a handle: a few attribute reads and the launches.

Training makes the same handle-based calls again and again: a combine per layer, and a cached
dispatch (``handle=``) in every layer's backward. The general path checks every argument,
builds the request, works out the call shape and converts every changing launch argument:
several times the host time of the launches themselves, which are a few microseconds each.

A ``CachedDispatchReplay`` / ``CombineReplay`` stands for one such call: the handle (its send
plan holds the objects), the input's dtype, shape and layout, and ``num_sms`` (the front end's
key, ``core/replay.py``). The engine makes it after a general call (``learn``) from the
compiled launches that call made (``launcher._Setup``): private copies of their raw argument
lists, in which a replay writes only what changes per call (the inputs, the new outputs, the
epoch, the staging-release target and the releases owed), after checking that the inputs still
fit what the launches were compiled for (dtype, shape, strides, device, 16-byte alignment).
``learn`` first checks that the lists hold this call's values at those places, so the two paths
cannot drift apart unnoticed. Anything else (a time-out report, an unchecked ``num_worst_tokens`` dispatch
before, other kernel shapes) returns None and the caller takes the general path, which raises
where it must.

A replay holds the engine's ``NormalState`` (the epochs and release counters it advances, the
status word, the side streams, the launch generation), never the engine, so the two paths
share one state; the combine's copy-engine side work is the engine's ``CombineCopier``, the
same object the general path calls; likewise a cached dispatch received on the copy engines
forks the engine's ``DispatchCopier``.

Both replays keep their copy-engine side work as CUDA graphs (``side_streams.SideGraphs``):
a combine's by its inputs' addresses (``x`` and the top-k weights), a cached dispatch's by its
outputs' (``recv_x`` and the scales); the rest of what a graph holds is the handle's and the
engine's. At most ``GRAPHS_PER_REPLAY`` each.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from tritonep.backends.nvlink.normal.combine_copy_engine import CombineCopier
from tritonep.backends.nvlink.normal.combine_kernel import combine_kernel
from tritonep.backends.nvlink.normal.dispatch_copy_engine import DispatchCopier, staged_ranges
from tritonep.backends.nvlink.normal.dispatch_kernel import dispatch_kernel
from tritonep.backends.nvlink.normal.state import NormalState
from tritonep.runtime.launcher import argument_positions, current_stream, respecialised
from tritonep.runtime.side_streams import SideGraphs

if TYPE_CHECKING:
    from tritonep.core.handles import DispatchHandle


# Where the per-call values go in the launches' argument lists. A cached dispatch passes no
# top-k, and a combine no bias, weights or expert ids, as x's address (never read). A combine's
# expert ids (V2's weights, ``OwnSlots``) are the handle's: learnt, not rewritten.
(_D_X, _D_SCALES, _D_TOPK_IDX, _D_TOPK_WEIGHTS, _D_OUT_X, _D_OUT_SCALES, _D_EPOCH, _D_RELEASED,
 _D_RELEASE_DUE) = argument_positions(dispatch_kernel, "x_ptr", "scales_ptr", "topk_idx_ptr", "topk_weights_ptr",
                                      "out_x_ptr", "out_scales_ptr", "epoch", "released_target", "release_due")
(_C_X, _C_X_WORDS, _C_BIAS0, _C_BIAS1, _C_WEIGHTS, _C_TOPK_IDX, _C_OUT, _C_OUT_WEIGHTS, _C_EPOCH,
 _C_RELEASED) = argument_positions(combine_kernel, "x_ptr", "x_words_ptr", "bias0_ptr", "bias1_ptr", "weights_ptr",
                                   "topk_idx_ptr", "out_ptr", "out_weights_ptr", "epoch", "released_target")
# And where the handle's values go, which ``rebind`` rewrites.
_D_TOKEN_LIST, _D_TOKEN_LIST_STRIDE, _D_PREFIX, _D_ROWS, _D_OUT_SRC = argument_positions(
    dispatch_kernel, "token_list_ptr", "token_list_stride", "prefix_ptr", "num_out_rows", "out_src_ptr")
_C_PREFIX, _C_IN_RANK, _C_SEND_POS, _C_TOKENS, _C_EXPERTS_PER_RANK = argument_positions(
    combine_kernel, "prefix_ptr", "is_token_in_rank_ptr", "send_pos_ptr", "num_tokens", "experts_per_rank")


# Graphs of copy-engine side work a replay keeps (each a few KB of driver memory).
GRAPHS_PER_REPLAY = 4


def _holds(launch: Any, values: dict[int, int]) -> bool:
    """``launch``'s argument list holds ``values`` (position -> value)."""
    return all(launch.args[position] == value for position, value in values.items())


def _layout(tensor: torch.Tensor | None) -> tuple | None:
    """What a learnt launch was compiled for, besides alignment."""
    if tensor is None:
        return None
    return tensor.dtype, tensor.shape, tensor.stride(), tensor.get_device()


def _with_rows(layout: tuple | None, rows: int) -> tuple | None:
    """``layout`` (of a row-major tensor) with ``rows`` rows: the strides stay."""
    if layout is None:
        return None
    dtype, shape, stride, device = layout
    return dtype, torch.Size((rows, *shape[1:])), stride, device


class Rebinding(NamedTuple):
    """What a replay checks before it makes its call with another handle (``rebind``), as the
    general path would: this rank, the rank count, the rows the staging area holds for the
    call's rows, and whether the engine's tuning sends them over the copy engines when the
    handle's counts are on the host."""

    rank: int
    num_ranks: int
    capacity: int
    copy_engine: bool


# Every slot of each replay class, its bases' included (what ``_copy`` copies), made on first use.
_SLOTS: dict[type, list[str]] = {}


class _HandleReplay:
    """What both replays check first: the engine's state and the input layout they learnt."""

    __slots__ = ("state", "launch_generation", "status_view", "device", "layout", "rebinding")

    def __init__(self, state: NormalState, main: torch.Tensor, other: torch.Tensor | None,
                 rebinding: Rebinding) -> None:
        self.state, self.launch_generation = state, state.launch_generation
        self.status_view, self.device = state.status.view, state.device
        self.layout = (_layout(main), _layout(other))
        self.rebinding = rebinding

    def _copy(self) -> Any:
        """A shallow copy (what ``rebind`` starts from)."""
        cls = type(self)
        names = _SLOTS.get(cls)
        if names is None:
            names = _SLOTS[cls] = [name for klass in cls.__mro__ for name in getattr(klass, "__slots__", ())]
        copy = object.__new__(cls)
        for name in names:
            setattr(copy, name, getattr(self, name))
        return copy

    def fitting_addresses(self, main: torch.Tensor, other: torch.Tensor | None) -> tuple[int, int] | None:
        """(main's address, other's or else main's) when a call with these inputs fits what this
        replay learnt, else None: another layout, a misaligned input, or an engine state that
        sends every call through the general path (other kernel shapes, a time-out to report, a
        num_worst_tokens dispatch whose counts are still to be checked)."""
        state = self.state
        if (state.launch_generation != self.launch_generation or self.status_view[0]
                or state.unchecked_padding is not None or (_layout(main), _layout(other)) != self.layout):
            return None
        main_address = main.data_ptr()
        other_address = main_address if other is None else other.data_ptr()
        return None if (main_address | other_address) & 15 else (main_address, other_address)


class CopyReceive(NamedTuple):
    """What a cached dispatch received on the copy engines forks beside its senders
    (``dispatch_copy_engine.py``): the engine's copier, the handle's received rows in staging
    (``staged_ranges``), the staging offsets of the rows and the scales, and the sender
    programs each source counts."""

    copier: DispatchCopier
    ranges: list[tuple[int, int]]
    staging_x: int
    staging_scales: int
    senders: int


class CachedDispatchReplay(_HandleReplay):
    """A cached dispatch of one handle, input layout and num_sms: its one launch (both halves,
    or the senders alone and the copy-engine receive's side work)."""

    __slots__ = ("rows", "scale_words", "receivers", "launch", "args", "copy_receive", "graphs")

    def __init__(self, state: NormalState, x: torch.Tensor, scales: torch.Tensor | None, launch: Any, rows: int,
                 scale_words: int, receivers: int, copy_receive: CopyReceive | None, rebinding: Rebinding) -> None:
        super().__init__(state, x, scales, rebinding)
        self.rows, self.scale_words, self.receivers = rows, scale_words, receivers
        self.launch, self.args = launch, list(launch.args)
        self.copy_receive = copy_receive
        # The copy-engine receive captured, by the outputs' addresses (recv_x's, recv_scales' or 0).
        self.graphs = None if copy_receive is None else SideGraphs(state.peer_streams, GRAPHS_PER_REPLAY)

    @staticmethod
    def learn(state: NormalState, x: torch.Tensor, scales: torch.Tensor | None, launch: Any, recv_x: torch.Tensor,
              recv_scales: torch.Tensor | None, rows: int, scale_words: int, receivers: int, epoch: int,
              released: int, release_due: int, rebinding: Rebinding, copy_receive: CopyReceive | None = None
              ) -> CachedDispatchReplay | None:
        """The replay of the cached dispatch the general path just launched (``launch``: the
        compiled launch it made; ``copy_receive``: its side work, if the copy engines received),
        or None when it launched none (the interpreter) or when the list does not hold this
        call's values where a replay writes."""
        if launch is None or not x.is_contiguous():
            return None
        x_address = x.data_ptr()
        values = {_D_X: x_address, _D_SCALES: x_address if scales is None else scales.data_ptr(),
                  _D_TOPK_IDX: x_address, _D_TOPK_WEIGHTS: x_address, _D_EPOCH: epoch, _D_RELEASED: released,
                  _D_RELEASE_DUE: release_due, _D_OUT_X: recv_x.data_ptr()}
        if recv_scales is not None:
            values[_D_OUT_SCALES] = recv_scales.data_ptr()
        if not _holds(launch, values):
            return None
        return CachedDispatchReplay(state, x, scales, launch, rows, scale_words, receivers, copy_receive, rebinding)

    def rebind(self, handle: DispatchHandle) -> CachedDispatchReplay | None:
        """This cached dispatch with another handle of the engine's (a new handle's first one:
        training routes anew every step), or None where the general path must decide: the
        handle was made for another token count, its rows do not fit, it receives another way,
        or one of its tensors falls into another specialisation than the launch's."""
        plan, fit = handle.backend_state, self.rebinding
        rows = handle.num_recv_rows
        x_layout, scales_layout = self.layout
        copy_receive = self.copy_receive
        if (handle.is_token_in_rank.shape[0] != x_layout[1][0] or rows > fit.capacity
                or plan.on_copy_engines(fit.copy_engine, fit.num_ranks) != (copy_receive is not None)):
            return None
        scratch = plan.recv_src_scratch(rows, self.device).data_ptr()
        values = {_D_TOKEN_LIST: plan.token_list.data_ptr(), _D_TOKEN_LIST_STRIDE: plan.token_list.stride(0),
                  _D_PREFIX: handle.rank_prefix_matrix.data_ptr(), _D_ROWS: rows, _D_OUT_SRC: scratch}
        if scales_layout is None:   # the scales' place holds the source indices' scratch (engine.py)
            values[_D_OUT_SCALES] = scratch
        args = respecialised(dispatch_kernel, self.args, values)
        if args is None:
            return None
        replay = self._copy()
        replay.rows, replay.args = rows, args
        if copy_receive is not None:
            replay.copy_receive = copy_receive._replace(ranges=staged_ranges(plan.copy_blocks(fit.rank)))
            replay.graphs = SideGraphs(self.state.peer_streams, GRAPHS_PER_REPLAY)
        return replay

    def __call__(self, x: torch.Tensor, scales: torch.Tensor | None) -> Any:
        """recv_x (or (recv_x, recv_scales)) of the cached dispatch, or None: take the general path."""
        addresses = self.fitting_addresses(x, scales)
        if addresses is None:
            return None
        recv_x = torch.empty(self.rows, x.shape[1], dtype=x.dtype, device=self.device)
        recv_scales = None if scales is None else torch.empty(self.rows, self.scale_words, dtype=scales.dtype,
                                                              device=self.device)
        x_address, scales_address = addresses
        state = self.state
        epoch = state.dispatch_epoch = state.dispatch_epoch + 1
        released = state.dispatch_released
        args = self.args
        args[_D_X], args[_D_SCALES], args[_D_TOPK_IDX], args[_D_TOPK_WEIGHTS] = \
            x_address, scales_address, x_address, x_address
        args[_D_EPOCH], args[_D_RELEASED], args[_D_RELEASE_DUE] = epoch, released, state.dispatch_release_due
        args[_D_OUT_X] = recv_x.data_ptr()
        if recv_scales is not None:
            args[_D_OUT_SCALES] = recv_scales.data_ptr()
        copy_receive = self.copy_receive
        start = None if copy_receive is None else copy_receive.copier.mark()
        self.launch(current_stream(), args)
        state.dispatch_release_due = 0   # the senders added it
        if copy_receive is not None:
            copier, senders, ranges = copy_receive.copier, copy_receive.senders, copy_receive.ranges
            regions = [(copy_receive.staging_x, recv_x)]
            if recv_scales is not None:
                regions.append((copy_receive.staging_scales, recv_scales))
            graph = None if not copier.captures else self.graphs.get(
                (args[_D_OUT_X], 0 if recv_scales is None else args[_D_OUT_SCALES]),
                lambda: copier.capture(senders, ranges, regions))
            copier.receive(start, senders, ranges, regions, graph)
        state.dispatch_released = released + self.receivers
        return recv_x if scales is None else (recv_x, recv_scales)


class CombineReplay(_HandleReplay):
    """A combine without bias of one handle, input layout and num_sms: its launch, and the
    copy-engine side work before it when the rows cross on the copy engines."""

    __slots__ = ("copier", "copies", "rank_prefix_matrix", "num_tokens", "reducers", "pieces", "regions", "launch",
                 "args", "ids_placeholder", "graphs")

    def __init__(self, state: NormalState, copier: CombineCopier | None, x: torch.Tensor,
                 topk_weights: torch.Tensor | None, handle: DispatchHandle, launch: Any, num_tokens: int,
                 reducers: int, pieces: int, regions: list[int], rebinding: Rebinding) -> None:
        super().__init__(state, x, topk_weights, rebinding)
        # What the copy-engine side work reads of the handle (not the handle itself: the replay
        # lives in the handle's table, and a cycle would keep its tensors until the cyclic GC).
        self.copier, self.copies = copier, handle.backend_state.combine_copies
        self.rank_prefix_matrix = handle.rank_prefix_matrix
        self.num_tokens, self.reducers, self.pieces, self.regions = num_tokens, reducers, pieces, regions
        self.launch, self.args = launch, list(launch.args)
        # No expert ids (V1's weights, or none): their place holds x's address, rewritten per call.
        self.ids_placeholder = self.args[_C_TOPK_IDX] == x.data_ptr()
        # Captured side work by (x address, weights address or x's).
        self.graphs = SideGraphs(state.peer_streams, GRAPHS_PER_REPLAY)

    @staticmethod
    def learn(state: NormalState, copier: CombineCopier | None, x: torch.Tensor, topk_weights: torch.Tensor | None,
              handle: DispatchHandle, launch: Any, out: torch.Tensor, out_weights: torch.Tensor | None,
              num_tokens: int, reducers: int, pieces: int, regions: list[int], epoch: int,
              released: int, rebinding: Rebinding) -> CombineReplay | None:
        """The replay of the combine (without bias) the general path just launched, or None when
        it made no compiled launch or the launch's list does not hold this call's values.
        ``pieces``: pieces per peer on the copy engines (``copier``'s side work), 0 when SM
        programs send."""
        if launch is None or not x.is_contiguous():
            return None
        x_address = x.data_ptr()
        values = {_C_X: x_address, _C_X_WORDS: x_address, _C_BIAS0: x_address, _C_BIAS1: x_address,
                  _C_WEIGHTS: x_address if topk_weights is None else topk_weights.data_ptr(), _C_OUT: out.data_ptr(),
                  _C_OUT_WEIGHTS: out.data_ptr() if out_weights is None else out_weights.data_ptr(),
                  _C_EPOCH: epoch, _C_RELEASED: released}
        if not _holds(launch, values):
            return None
        return CombineReplay(state, copier, x, topk_weights, handle, launch, num_tokens, reducers, pieces, regions,
                             rebinding)

    def rebind(self, handle: DispatchHandle, own_ids: torch.Tensor | None = None,
               experts_per_rank: int = 0) -> CombineReplay | None:
        """This combine with another handle of the engine's (a new handle's first combine), its
        rows ``handle.num_recv_rows``; or None where the general path must decide: rows that do
        not fit, rows that cross another way, or a tensor or value in another specialisation
        than the launch's. ``own_ids`` and ``experts_per_rank``: for a replay learnt with expert
        ids of its handle's own (V2's weights, ``OwnSlots``), the new handle's ([tokens, K] int64
        contiguous); without them such a replay refuses."""
        plan, fit = handle.backend_state, self.rebinding
        if (plan.on_copy_engines(fit.copy_engine, fit.num_ranks) != bool(self.pieces)
                or (plan.max_send_rows is not None and plan.max_send_rows > fit.capacity)):
            return None
        in_rank = handle.is_token_in_rank
        values = {_C_PREFIX: handle.rank_prefix_matrix.data_ptr(), _C_IN_RANK: in_rank.data_ptr(),
                  _C_SEND_POS: plan.send_pos.data_ptr(), _C_TOKENS: in_rank.shape[0]}
        if not self.ids_placeholder:
            weights_layout = self.layout[1]
            if (own_ids is None or weights_layout is None or own_ids.dtype != torch.int64
                    or own_ids.shape != (in_rank.shape[0], weights_layout[1][1]) or not own_ids.is_contiguous()
                    or own_ids.get_device() != weights_layout[3]):
                return None
            values[_C_TOPK_IDX], values[_C_EXPERTS_PER_RANK] = own_ids.data_ptr(), experts_per_rank
        args = respecialised(combine_kernel, self.args, values)
        if args is None:
            return None
        replay = self._copy()
        rows = handle.num_recv_rows
        replay.layout = (_with_rows(self.layout[0], rows), _with_rows(self.layout[1], rows))
        replay.args, replay.num_tokens = args, in_rank.shape[0]
        replay.rank_prefix_matrix = handle.rank_prefix_matrix
        replay.copies = plan.copy_blocks(fit.rank) if self.pieces else None
        replay.graphs = SideGraphs(self.state.peer_streams, GRAPHS_PER_REPLAY)
        return replay

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(combined_x, combined_topk_weights), launched, or None: take the general path."""
        addresses = self.fitting_addresses(x, topk_weights)
        if addresses is None:
            return None
        out = torch.empty(self.num_tokens, x.shape[1], dtype=torch.bfloat16, device=self.device)
        out_weights = None if topk_weights is None else torch.empty(
            self.num_tokens, topk_weights.shape[1], dtype=torch.float32, device=self.device)
        x_address, weights_address = addresses
        state = self.state
        epoch = state.combine_epoch = state.combine_epoch + 1
        released = state.combine_released
        if self.pieces:
            graph = None if not (self.copies and self.copier.captures) else self.graphs.get(
                addresses, lambda: self.copier.capture(x, topk_weights, self.copies, self.rank_prefix_matrix,
                                                       self.regions, self.pieces))
            if graph is not None:
                state.peer_streams.fork_graph(graph)
            else:
                self.copier.fork(x, topk_weights, self.copies, self.rank_prefix_matrix, self.regions, self.pieces)
        args = self.args
        args[_C_X], args[_C_X_WORDS], args[_C_BIAS0], args[_C_BIAS1], args[_C_WEIGHTS] = \
            x_address, x_address, x_address, x_address, weights_address
        if self.ids_placeholder:
            args[_C_TOPK_IDX] = x_address
        args[_C_OUT] = out.data_ptr()
        args[_C_OUT_WEIGHTS] = args[_C_OUT] if out_weights is None else out_weights.data_ptr()
        args[_C_EPOCH], args[_C_RELEASED] = epoch, released
        self.launch(current_stream(), args)
        if self.pieces:
            state.peer_streams.join()
        state.combine_released = released + self.reducers
        return out, out_weights
