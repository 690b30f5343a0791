"""Normal mode of the NVLink backend: the host side of dispatch and combine.

Per call the host does little: launch the send-plan/count-exchange kernel, read back the
receive counts (the one host sync of a fresh dispatch; none with ``num_worst_tokens``),
allocate outputs, and launch the dispatch's two halves or the combine. A fresh dispatch
launches both halves before it reads the counts back (the receive half into outputs sized
from the previous call), so the GPU does not wait for the host. Calls made with a handle hand
back a replay that repeats their launches (``replay.py``).

The parts, a module each: the state the calls and their replays share (``state.py``), what a
dispatch shape works out once (``shape.py``), the count exchange's host side (``counts.py``),
the kernels (``*_kernel.py``), and the copy engines' side work of the combine
(``combine_copy_engine.py``) and of a cached dispatch received on the copy engines
(``dispatch_copy_engine.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton

from tritonep.backends.base import CombineRequest, CombineResult, DispatchRequest, DispatchResult
from tritonep.backends.nvlink.memory import MAX_CHANNELS, StagingLayout, SymmetricBuffer
from tritonep.backends.nvlink.normal.combine_copy_engine import (
    CombineCopier,
    driver_memory_operations,
    piece_ratio,
    pieces_per_peer,
)
from tritonep.backends.nvlink.normal.combine_kernel import COMBINE
from tritonep.backends.nvlink.normal.counts import CountExchange
from tritonep.backends.nvlink.normal.dispatch_copy_engine import RECEIVERS as COPY_RECEIVERS
from tritonep.backends.nvlink.normal.dispatch_copy_engine import DispatchCopier, staged_ranges
from tritonep.backends.nvlink.normal.dispatch_kernel import DISPATCH, DISPATCH_WITH_FIELDS
from tritonep.backends.nvlink.normal.expert_layout_kernel import ExpertLayouts
from tritonep.backends.nvlink.normal.layout_kernel import DispatchLayout
from tritonep.backends.nvlink.normal.notify_kernel import check_word
from tritonep.backends.nvlink.normal.replay import CachedDispatchReplay, CombineReplay, CopyReceive, Rebinding
from tritonep.backends.nvlink.normal.shape import (
    DispatchShape,
    Placeholders,
    dispatch_outputs,
    guess_rows,
    handle_fields_arguments,
)
from tritonep.backends.nvlink.normal.state import NormalState, SendPlan
from tritonep.backends.nvlink.tuning import (
    Tuning,
    combine_tile,
    copy_engine_receives,
    split_programs,
    tile_block,
    tile_shape,
)
from tritonep.core.checks import InputError
from tritonep.core.expert_layout import ExpertLayout, ExpertLayoutRequest
from tritonep.core.handles import DispatchHandle
from tritonep.core.routing import round_up_counts
from tritonep.runtime.launcher import as_words
from tritonep.runtime.platform import GPU_KERNELS, INTERPRET


class NormalEngine:
    """Dispatch layout, dispatch and combine for one Buffer. ``memory``: the staging memory, None
    for a low-latency-only Buffer (``num_nvl_bytes=0``), whose dispatch and combine then raise."""

    def __init__(self, memory: SymmetricBuffer | None, rank: int, num_ranks: int, buffer_id: int,
                 device: torch.device, tuning: Tuning) -> None:
        self.rank, self.num_ranks, self.buffer_id, self.device = rank, num_ranks, buffer_id, device
        self._memory = memory
        self.staging = StagingLayout.of(memory) if memory is not None else None
        # Combine pieces through the driver when cuda-bindings is there (combine_copy_engine.py).
        self._driver = None if INTERPRET else driver_memory_operations(device)
        self.state = NormalState(device, self._driver)
        self.counts = CountExchange(self.state, rank, num_ranks)
        self.placeholders = Placeholders(device)
        self.layout = DispatchLayout(num_ranks, self.counts.invalid_ids)
        self.expert_layouts = ExpertLayouts(rank, num_ranks, self.placeholders)
        self._shapes: dict[tuple, DispatchShape] = {}
        # The copy-engine combine's reducers spin while one-program signal kernels on side
        # streams must still find an SM: leave a few free.
        self._max_reducers = MAX_CHANNELS if INTERPRET else \
            torch.cuda.get_device_properties(device).multi_processor_count - 4
        self.tuning = tuning

    @property
    def tuning(self) -> Tuning:
        return self._tuning

    @tuning.setter
    def tuning(self, tuning: Tuning) -> None:
        """Kernel shapes (scripts and tests swap them per Buffer): the launches learnt under the
        old ones must not be reused, so they get a new launch generation."""
        self._tuning = tuning
        self.timeout_ns = tuning.timeout_ns
        state = self.state
        state.new_launch_generation()
        self._shapes.clear()
        # The kernels' status group (dispatch_kernel.py, combine_kernel.py): the pinned word's
        # tensor, which Triton passes as its address (``StatusWord.address``), and the time-out.
        self._status_args = (state.status.tensor, self.timeout_ns)
        self.copier = None if self._memory is None else CombineCopier(
            self._memory, state.peer_streams, self._driver if tuning.copy_driver else None,
            state.launch_generation,
            piece_ratio(pieces_per_peer(self.num_ranks, tuning.combine_pieces), tuning.combine_piece_ratio),
            tuning.combine_copy_streams)
        self.dispatch_copier = None if self._memory is None else DispatchCopier(
            self._memory, state, self._driver if tuning.copy_driver else None, state.launch_generation,
            self._status_args)

    @property
    def memory(self) -> SymmetricBuffer:
        if self._memory is None:
            raise InputError("normal-mode dispatch/combine on the NVLink backend needs num_nvl_bytes > 0 for its "
                             "receive areas; make the Buffer with num_nvl_bytes=tritonep.nvl_bytes_for("
                             "num_tokens, hidden, num_ranks)")
        return self._memory

    def check_status(self) -> None:
        """Raise if a kernel of an earlier call gave up waiting on a peer, or if an earlier
        num_worst_tokens dispatch found ranks that disagree or received more rows than it had
        room for."""
        self.counts.check_padding(self.timeout_ns)
        code = self.state.status.code   # written by the kernels into host memory: no sync
        if code:
            raise self.counts.status_error(code, self.timeout_ns, "dispatch/combine calls")

    # ------------------------------------------------------------------ dispatch
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.layout(topk_idx, num_experts)

    def _dispatch_shape(self, request: DispatchRequest) -> DispatchShape:
        """The shape of this call's dispatch, worked out on the first call of its kind."""
        x, scales = request.x, request.x_scales
        num_topk = request.topk_idx.shape[1] if request.topk_idx is not None else 0
        scale_words = scales.shape[1] if scales is not None else 0
        key = (x.dtype, x.shape[1], scale_words, num_topk, request.num_experts, request.config.num_sms)
        shape = self._shapes.get(key)
        if shape is None:
            row_bytes = x.shape[1] * x.element_size()
            if row_bytes % 4:
                raise InputError(f"the NVLink backend moves rows in 4-byte words; hidden={x.shape[1]} of {x.dtype} "
                                 f"gives {row_bytes} bytes")
            shape = self._shapes[key] = DispatchShape.make(
                key, row_bytes // 4, scale_words, num_topk, request.num_experts, request.config.num_sms,
                tuning=self._tuning, memory=self.memory, staging=self.staging, placeholders=self.placeholders,
                launch_generation=self.state.launch_generation)
        return shape

    def dispatch(self, request: DispatchRequest) -> DispatchResult:
        """Count exchange (fresh dispatch), then two kernels: the send half on a side stream,
        launched before the host reads the counts back, so rows move while the host waits; the
        receive half (own rows, then arrived rows into the outputs) on the current stream,
        which the send half does not hold up. A fresh dispatch of a shape seen before launches
        the receive half before the read-back too, into outputs with room for the previous
        call's rows and some slack, and returns views of their first rows; when more rows
        arrive it stands down and is launched again into exact outputs. A dispatch whose counts
        are on the GPU already (a cached one, or with ``num_worst_tokens``) runs both halves as
        one launch on the current stream; with ``Tuning.copy_engine_dispatch``, a cached one
        whose counts the host knows launches senders only and receives on the copy engines
        (``dispatch_copy_engine.py``)."""
        self.check_status()
        x, scales = request.x, request.x_scales
        shape = self._dispatch_shape(request)
        handle = request.cached_handle
        state, R, t = self.state, self.num_ranks, self._tuning
        has_topk = request.topk_idx is not None
        per_expert: list[int] | None = None
        reads_counts = False
        if handle is not None:
            plan: SendPlan = handle.backend_state
            prefix, num_out_rows = handle.rank_prefix_matrix, handle.num_recv_rows
            if num_out_rows > shape.capacity:
                raise InputError(f"cached dispatch of {num_out_rows} rows does not fit the NVLink buffer "
                                 f"({shape.capacity} rows of {shape.row_bytes} bytes); make the Buffer with more "
                                 f"num_nvl_bytes")
        else:
            if request.num_worst_tokens == 0 and not INTERPRET and torch.cuda.is_current_stream_capturing():
                # Checked before the exchange: the host would wait for counts that a capture
                # never produces.
                raise InputError("a dispatch without a handle reads its counts back on the host, which cannot "
                                 "happen inside CUDA-graph capture; capture a cached dispatch (handle=...) or pass "
                                 "num_worst_tokens")
            if request.num_worst_tokens > shape.capacity:
                raise InputError(f"num_worst_tokens={request.num_worst_tokens} does not fit the NVLink buffer "
                                 f"({shape.capacity} rows of {shape.row_bytes} bytes); make the Buffer with more "
                                 f"num_nvl_bytes")
            token_list, send_pos, result, in_rank = self.counts.start(self.memory, request, shape, self.timeout_ns)
            prefix = result[: R * R].view(R, R)
            plan = SendPlan(token_list, send_pos, result)
            if request.num_worst_tokens > 0:
                num_out_rows, per_expert = request.num_worst_tokens, []
                if not request.padding_is_guaranteed(R):
                    self.counts.remember_padding(request.num_worst_tokens)
            else:
                reads_counts = True
        state.dispatch_epoch += 1
        receivers = shape.receivers   # what this call adds to every peer's done word for this rank
        copy_engine = copy_engine_receives(t.copy_engine_dispatch, R)
        copy_receive = (handle is not None and request.num_worst_tokens == 0
                        and plan.on_copy_engines(copy_engine, R))
        # The kernel's argument groups (dispatch_kernel.py); both halves share all but the outputs.
        words = as_words(x) if x.dim() == 2 else x
        scale_view = as_words(scales) if scales is not None else words
        inputs = (words, shape.x_words, scale_view, max(shape.scale_words, 1),
                  scale_view.stride(0) if scales is not None else 0, scale_view.stride(1) if scales is not None else 0,
                  request.topk_idx if has_topk else words, request.topk_weights if has_topk else words,
                  shape.experts_per_rank)
        send_plan = (plan.token_list, plan.token_list.stride(0), prefix)
        ahead = inputs + send_plan
        release_due = state.dispatch_release_due   # added by this call's first launch with senders
        behind = shape.staging + (state.dispatch_epoch, state.dispatch_released, release_due) + self._status_args

        launched = None   # the compiled launch that filled the outputs: a cached dispatch learns it
        # V2's handle fields (not expanded), written by the receivers of a fresh dispatch.
        fields = request.handle_fields if handle is None and has_topk else None
        fields_block: tuple[torch.Tensor, int | None] | None = None   # the block and its topk_idx copy's place

        def send() -> None:   # writes only into peers' staging: needs no output and no host count
            DISPATCH(shape.senders, shape.send_setup, ahead + shape.unused_outputs + shape.no_fields + behind,
                     shape.send_constants, t.warps)
            state.dispatch_release_due = 0

        def receive(rows: int, guard_word: int = 0, roles: str = "receive") -> tuple[torch.Tensor, ...]:
            nonlocal launched, fields_block
            pad = request.num_worst_tokens > 0 and request.pad_outputs
            outputs = dispatch_outputs(x, scales, shape, has_topk, rows, pad, self.device,
                                       plan.recv_src_scratch(rows, self.device) if handle is not None else None)
            output_args = (outputs[0].view(torch.int32),
                           outputs[1].view(torch.int32) if scales is not None else outputs[4],
                           outputs[2] if has_topk else self.placeholders(torch.int64),
                           outputs[3] if has_topk else self.placeholders(torch.float32), outputs[4], rows, guard_word)
            programs, setup, constants = {
                "receive": (shape.receivers, shape.receive_setup, shape.receive_constants),
                "both": (shape.both_programs, shape.both_setup, shape.both_constants),
                "copy": (shape.copy_programs, shape.copy_setup, shape.copy_constants)}[roles]
            if fields is None:
                launched = DISPATCH(programs, setup, ahead + output_args + shape.no_fields + behind, constants,
                                    t.warps)
            else:
                fields_args, *fields_block = handle_fields_arguments(request, fields, shape, plan.send_pos, rows,
                                                                     self.placeholders, self.device)
                # Worst-case outputs: the receivers write the empty rows (not filled above).
                pad_rows = request.num_worst_tokens > 0 and not pad
                launched = DISPATCH_WITH_FIELDS(
                    programs, (setup, fields.num_scaleup_ranks, request.num_max_tokens_per_rank, pad_rows,
                               request.expert_alignment, fields.stats is not None, fields.copy_topk_idx),
                    ahead + output_args + fields_args + behind,
                    shape.fields_constants(constants, fields.num_scaleup_ranks, pad_rows), t.warps)
            if constants["SEND"]:
                state.dispatch_release_due = 0
            return outputs

        if reads_counts:
            # The send half runs on the side stream after the exchange (after everything queued
            # on the current stream so far), beside the receive half; one rank sends nothing.
            sends = R > 1
            if sends and t.send_before_sync:
                state.send_stream.fork([send])
            guess = guess_rows(shape, t)
            # Into outputs of a guessed size, the receive half follows the exchange on the GPU
            # without waiting for the host; it stands down if the counts call for an error or
            # for more rows (its guard reads the exchange's check words in ``result``).
            outputs = receive(guess, check_word(R, shape.experts_per_rank)) if guess is not None else None
            host = self.counts.wait_counts(shape, self.timeout_ns)
            num_out_rows = shape.last_fresh_rows = host[R * (R - 1) + self.rank]
            if sends and not t.send_before_sync:
                state.send_stream.fork([send])
            if outputs is not None and num_out_rows <= guess:
                outputs = tuple(None if out is None else out[:num_out_rows] for out in outputs)
            else:
                outputs = receive(num_out_rows)
            state.send_stream.join()   # later work on the current stream (and the allocator) waits for the send
        elif copy_receive:
            # Every program sends (and copies our own rows); the copy engines receive.
            start = self.dispatch_copier.mark()
            outputs = receive(num_out_rows, roles="copy")
            receivers, ranges = COPY_RECEIVERS, staged_ranges(plan.copy_blocks(self.rank))
            # Rows, then the fields the call returns (a cached dispatch's source indices are the
            # handle's: never copied).
            regions = [(offset, out) for offset, out in zip(shape.staging[2:6], outputs[:4]) if out is not None]
            self.dispatch_copier.receive(start, shape.copy_programs, ranges, regions)
        else:
            # The counts are on the GPU already (a cached dispatch, or num_worst_tokens): one
            # launch runs both halves.
            outputs = receive(num_out_rows, roles="both")
        state.dispatch_released += receivers
        recv_x, recv_scales, recv_idx, recv_weights, recv_src = outputs
        replay = None
        # The next such call may replay these launches (and the copy-engine receive's side work).
        if handle is not None and request.num_worst_tokens == 0:
            side = CopyReceive(self.dispatch_copier, ranges, shape.staging[2], shape.staging[3],
                               shape.copy_programs) if copy_receive else None
            rebinding = Rebinding(self.rank, R, shape.capacity, copy_engine)
            replay = CachedDispatchReplay.learn(
                state, x, scales, launched, recv_x, recv_scales, num_out_rows, shape.scale_words,
                receivers, state.dispatch_epoch, state.dispatch_released - receivers, release_due, rebinding, side)
        if reads_counts:   # host bookkeeping, after the launch
            plan.host_prefix = host[: R * R]
            per_expert = round_up_counts(host[R * R: -2], request.expert_alignment)
        layout = None
        if fields_block is not None:
            block, copy_at = fields_block
            sizes = shape.fields_layout(num_out_rows, x.shape[0], fields.num_scaleup_ranks, copy_at is not None)[0]
            layout = ExpertLayout(block, sizes, request.topk_idx if copy_at is None else None, copy_at)
        if handle is None:
            handle = DispatchHandle(prefix, in_rank, recv_src, num_out_rows, x.shape[1],
                                    self.buffer_id, plan)
        return DispatchResult(recv_x, recv_scales, recv_idx, recv_weights, per_expert, handle, replay, layout)

    def expert_layout(self, request: ExpertLayoutRequest) -> ExpertLayout:
        """The layout of a fresh dispatch's rows by expert, source and destination, in one launch
        from its count exchange and send plan (``expert_layout_kernel.py``)."""
        plan: SendPlan = request.handle.backend_state
        return self.expert_layouts(request, plan.exchange, plan.send_pos, self.state.launch_generation)

    # ------------------------------------------------------------------ combine
    def combine(self, request: CombineRequest) -> CombineResult:
        x, handle, topk_weights, bias, config = request.x, request.handle, request.topk_weights, request.bias, \
            request.config
        # V2's weights: the reduction takes each slot's weight from its expert's rank only.
        own_slots = request.own_slots if topk_weights is not None else None
        self.check_status()
        plan: SendPlan = handle.backend_state
        hidden = x.shape[1]
        if hidden % 2:
            raise InputError(f"the NVLink backend moves combine rows in 4-byte words; hidden must be even, "
                             f"got {hidden}")
        num_tokens = handle.is_token_in_rank.shape[0]
        num_topk = topk_weights.shape[1] if topk_weights is not None else 0
        memory = self.memory
        capacity, regions = self.staging.combine(hidden, num_topk)
        plan.host_counts(self.num_ranks)
        if plan.max_send_rows is not None and plan.max_send_rows > capacity:
            raise InputError(f"combine would return {plan.max_send_rows} rows to one rank but the NVLink buffer "
                             f"holds {capacity} rows of hidden {hidden}; make the Buffer with more num_nvl_bytes")
        out = torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device=self.device)
        out_weights = torch.empty(num_tokens, num_topk, dtype=torch.float32, device=self.device) \
            if topk_weights is not None else None
        state, t, R = self.state, self._tuning, self.num_ranks
        state.combine_epoch += 1
        # The kernel's argument groups (combine_kernel.py), in its order.
        args = (x, as_words(x), topk_weights if topk_weights is not None else x,          # inputs
                bias[0] if bias[0] is not None else x, bias[1] if bias[1] is not None else x, hidden,
                own_slots.topk_idx if own_slots is not None else x,
                own_slots.experts_per_rank if own_slots is not None else 1,
                handle.rank_prefix_matrix, handle.is_token_in_rank, plan.send_pos,                 # send plan
                out, out_weights if out_weights is not None else out, num_tokens,                  # outputs
                memory.peer_base_ptrs, self.rank, *regions, capacity,                              # staging area
                state.combine_epoch, state.combine_released,                                       # call counters
                *self._status_args)                                                                # status
        # Everything the launch does not convert per call (see COMBINE) follows from the setup
        # key; the constexprs are built only when a key is new (FastLauncher).
        setup = (state.launch_generation, hidden, num_topk, topk_weights is not None, bias[0] is not None,
                 bias[1] is not None, own_slots.experts_per_rank if own_slots is not None else 0)

        def constants(senders: int, reducers: int, channels: int) -> Callable[[], dict]:
            def make() -> dict:
                shape = tile_shape(t.rows, 2 * hidden)
                pow2 = triton.next_power_of_2
                tokens, block = combine_tile(t.tokens, t.combine_block, R)
                signals = memory.signals
                # SM senders publish per channel, the copy engines per source (combine_kernel.py).
                tails = dict(TAIL_WORD=signals.combine_tail, TAIL_STRIDE=MAX_CHANNELS) if senders else \
                    dict(TAIL_WORD=signals.combine_copy_tail, TAIL_STRIDE=1)
                return dict(
                    **tails, DONE_WORD=signals.combine_done, FINISHED_WORD=signals.combine_copy_finished,
                    NUM_RANKS=R, RANKS_PAD=pow2(R), HAS_WEIGHTS=topk_weights is not None,
                    OWN_SLOTS=own_slots is not None,
                    NUM_TOPK=max(num_topk, 1), TOPK_PAD=pow2(max(num_topk, 1)), HAS_BIAS0=bias[0] is not None,
                    HAS_BIAS1=bias[1] is not None, BLOCK=min(pow2(hidden), block),
                    TOKENS=tokens, STAGE=t.stage, GPU=GPU_KERNELS,
                    COPY_BLOCK=tile_block(t.block, shape["ROWS"], hidden // 2),
                    NUM_SENDERS=senders, NUM_REDUCERS=reducers, NUM_CHANNELS=channels, **shape)
            return make
        if plan.on_copy_engines(t.copy_engine_combine, R):
            # The rows cross NVLink on the copy engines, piece by piece; every program reduces
            # while they arrive (combine_copy_engine.py).
            pieces = min(pieces_per_peer(R, t.combine_pieces), MAX_CHANNELS)
            self.copier.fork(x, topk_weights, plan.copy_blocks(self.rank), handle.rank_prefix_matrix, regions, pieces)
            reducers = max(1, min(config.num_sms, MAX_CHANNELS, self._max_reducers))
            # One tail word per peer: its pieces publish the rows delivered so far.
            launch = COMBINE(reducers, setup + (0, reducers, 1), args, constants(0, reducers, 1), t.warps)
            state.peer_streams.join()
        else:
            pieces = 0
            senders, reducers = split_programs(config.num_sms, t.combine_sender_fraction)
            launch = COMBINE(senders + reducers, setup + (senders, reducers, senders), args,
                             constants(senders, reducers, senders), t.warps)
        state.combine_released += reducers
        replay = None
        if bias[0] is None and bias[1] is None:   # the next such call may replay this launch
            replay = CombineReplay.learn(
                state, self.copier if pieces else None, x, topk_weights, handle, launch, out, out_weights,
                num_tokens, reducers, pieces, regions, state.combine_epoch, state.combine_released - reducers,
                Rebinding(self.rank, R, capacity, t.copy_engine_combine))
        return CombineResult(out, out_weights, replay)
