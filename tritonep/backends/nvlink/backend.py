"""The NVLink backend: ranks of one node, Triton kernels over torch symmetric memory.

Per normal-mode call the host does little: launch the send-plan/count-exchange kernel, read
back the receive counts (the one host sync of a non-cached dispatch; none with
``num_worst_tokens``), allocate outputs, and launch the dispatch's two halves or the combine.
A fresh dispatch launches both halves before it reads the counts back (the receive half into
outputs sized from the previous call), so the GPU does not wait for the host. The
kernels are in this folder, one file each. Low-latency mode is ``low_latency.py``: its own
symmetric allocation (``num_rdma_bytes``) and two kernels.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import triton

from tritonep.backends.base import (
    Backend,
    CombineRequest,
    CombineResult,
    DispatchRequest,
    DispatchResult,
    LowLatencyCombineRequest,
    LowLatencyCombineResult,
    LowLatencyDispatchRequest,
    LowLatencyDispatchResult,
)
from tritonep.backends.nvlink.low_latency.engine import LowLatencyEngine
from tritonep.backends.nvlink.memory import MAX_CHANNELS, SymmetricBuffer, give_back_released
from tritonep.backends.nvlink.normal.combine_copy_engine import (
    combine_copies,
    combine_copy_jobs,
    driver_memory_operations,
    pieces_per_peer,
    push_combine_weights,
)
from tritonep.backends.nvlink.normal.combine_kernel import COMBINE
from tritonep.backends.nvlink.normal.dispatch_kernel import DISPATCH
from tritonep.backends.nvlink.normal.layout_kernel import dispatch_layout
from tritonep.backends.nvlink.normal.notify_kernel import MAILBOX_HEADER, mailbox_words, notify_dispatch
from tritonep.backends.nvlink.normal.replay import CachedDispatchReplay, CombineReplay
from tritonep.backends.nvlink.normal.shape import DispatchShape, SendPlan, dispatch_outputs, guess_rows
from tritonep.backends.nvlink.tuning import Tuning, combine_tile_tokens, split_programs, tile_block, tile_shape
from tritonep.core.checks import InputError
from tritonep.core.handles import DispatchHandle, LowLatencyHandle
from tritonep.core.replay import Replay
from tritonep.core.routing import count_rows_from_prefix, round_up_counts
from tritonep.runtime.platform import GPU_KERNELS, INTERPRET
from tritonep.runtime.side_streams import PeerStreams
from tritonep.runtime.status import timeout_error

# Distinct per backend and kernel shapes (see ``NvlinkBackend.tuning``): part of every setup key.
_LAUNCH_KEYS = itertools.count()


class NvlinkBackend(Backend):
    def __init__(self, group: dist.ProcessGroup, buffer_id: int, num_nvl_bytes: int, num_rdma_bytes: int,
                 low_latency_mode: bool) -> None:
        super().__init__(group, buffer_id)
        self._device = torch.device("cpu") if INTERPRET else torch.device("cuda", torch.cuda.current_device())
        # A low-latency-only Buffer (num_nvl_bytes=0, as decode servers make them) has no staging
        # area; normal-mode calls then raise (_require_memory).
        self._memory = SymmetricBuffer(group, num_nvl_bytes, self._device, interpret=INTERPRET) \
            if num_nvl_bytes > 0 else None
        self.half_bytes = self._memory.data_bytes // 2 // 4096 * 4096 if self._memory is not None else 0
        # The kernels write a timed-out wait's (phase, peer) straight into host memory (pinned,
        # which the GPU reaches under unified addressing): the host reads it with no copy.
        self.status = torch.zeros(1, dtype=torch.int64, device="cpu", pin_memory=not INTERPRET)
        self._status_host = self.status.numpy()
        self.invalid_ids = torch.zeros(1, dtype=torch.int32, device=self._device)
        self.timeout_ns = int(float(os.environ.get("TRITONEP_TIMEOUT_S", "60")) * 1e9)
        self.notify_epoch = 0
        self.dispatch_epoch = 0
        self.combine_epoch = 0
        # Receiver (reducer) programs of all earlier dispatch (combine) calls: each one adds 1 to
        # every peer's done counter, so a sender knows when the staging it writes is free again.
        self.dispatch_released = 0
        self.combine_released = 0
        self._dispatch_shapes: dict[tuple, DispatchShape] = {}
        self.tuning = Tuning.from_environment()
        self._placeholders: dict[torch.dtype, torch.Tensor] = {}
        # A num_worst_tokens dispatch does not sync, so whether its padding was large enough is
        # checked when the next call starts: (its exchange's epoch, num_worst_tokens).
        self._unchecked_padding: tuple[int, int] | None = None
        # The count exchange writes its result here (pinned host memory) and the host polls it.
        self._mailbox = torch.zeros(mailbox_words(self.num_ranks), dtype=torch.int64, device="cpu",
                                    pin_memory=not INTERPRET)
        self._mailbox_host = self._mailbox.numpy()
        self._stream = None if INTERPRET else torch.cuda.Stream(self._device)
        self._peer_streams = PeerStreams(self._device)
        self._send_stream = PeerStreams(self._device)
        # The copy-engine combine's reducers spin while one-program signal kernels on side
        # streams must still find an SM: leave a few free.
        self._max_reducers = MAX_CHANNELS if INTERPRET else \
            torch.cuda.get_device_properties(self._device).multi_processor_count - 4
        # Combine pieces through the driver when cuda-bindings is there (combine_copy_engine.py).
        self._driver = None if INTERPRET else driver_memory_operations(self._device)
        # Low-latency mode has its own allocation (the front end checks its size per call).
        self._low_latency = LowLatencyEngine(group, buffer_id, num_rdma_bytes, self._device) \
            if low_latency_mode and num_rdma_bytes > 0 else None

    @property
    def tuning(self) -> Tuning:
        return self._tuning

    @tuning.setter
    def tuning(self, tuning: Tuning) -> None:
        """Kernel shapes (scripts and tests swap them per Buffer): the launches learnt under the
        old ones must not be reused, so they get a new key."""
        self._tuning = tuning
        self._launch_key = next(_LAUNCH_KEYS)
        self._dispatch_shapes.clear()

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def memory(self) -> SymmetricBuffer:
        if self._memory is None:
            raise InputError("normal-mode dispatch/combine on the NVLink backend needs num_nvl_bytes > 0 for its "
                             "receive areas; make the Buffer with num_nvl_bytes=tritonep.nvl_bytes_for("
                             "num_tokens, hidden, num_ranks)")
        return self._memory

    @property
    def low_latency(self) -> LowLatencyEngine:
        if self._low_latency is None:
            raise InputError("low-latency calls on the NVLink backend need a Buffer made with low_latency_mode=True "
                             "and num_rdma_bytes from Buffer.get_low_latency_rdma_size_hint(...)")
        return self._low_latency

    def comm_stream(self) -> torch.cuda.Stream | None:
        return self._stream

    def low_latency_stream(self, async_finish: bool) -> torch.cuda.Stream | None:
        """Low-latency calls run on the caller's stream (one launch, nothing to overlap with)
        unless the caller asked for an event to wait on."""
        return self._stream if async_finish else None

    # ------------------------------------------------------------------ status
    def check_status(self) -> None:
        """Raise if a kernel of an earlier call gave up waiting on a peer, or if an earlier
        num_worst_tokens dispatch received more rows than it had room for."""
        self._check_padding()
        code = int(self._status_host[0])   # written by the kernels into host memory: no sync
        if code:
            raise timeout_error(code, self.rank, self.timeout_ns, "dispatch/combine calls")

    def _remember_padding(self, num_worst_tokens: int) -> None:
        """A num_worst_tokens dispatch does not wait for its counts: the next call checks them
        (from the mailbox, still holding this exchange's result then). Not under CUDA-graph
        capture, where the exchange does not run until a replay."""
        if INTERPRET or not torch.cuda.is_current_stream_capturing():
            self._unchecked_padding = (self.notify_epoch, num_worst_tokens)

    def _check_padding(self) -> None:
        """Every rank holds the same received counts, so with equal num_worst_tokens every rank
        raises here, at the same call, before any communication."""
        if self._unchecked_padding is None or (not INTERPRET and torch.cuda.is_current_stream_capturing()):
            return
        epoch, limit = self._unchecked_padding
        self._unchecked_padding = None
        R = self.num_ranks
        # The last row of rank_prefix_matrix: what each rank received (exchanged a call ago, so
        # normally long finished).
        counts = self._mailbox_result(epoch, R * R, "a num_worst_tokens dispatch")[R * (R - 1):]
        if max(counts) > limit:
            worst = counts.index(max(counts))
            raise InputError(f"the previous dispatch had num_worst_tokens={limit}, but rank {worst} received "
                             f"{max(counts)} rows: rows past num_worst_tokens were dropped there. Use a larger "
                             f"num_worst_tokens (an upper bound on any rank's received rows).")

    def _check_agreement(self, ranks_disagreeing: int, invalid_ids: int) -> None:
        """Raise on every rank, before any row moves, if the count exchange found a problem."""
        if invalid_ids:
            self.invalid_ids.zero_()
            raise InputError(f"topk_idx given to get_dispatch_layout had {invalid_ids} entries (over all ranks) "
                             "outside [-1, num_experts); nothing was dispatched")
        if ranks_disagreeing:
            raise InputError(f"ranks called dispatch with different arguments: {ranks_disagreeing} rank(s) "
                             "disagree on (hidden, scales, top-k, num_experts) with this rank")

    def _placeholder(self, dtype: torch.dtype) -> torch.Tensor:
        """A one-element tensor passed for an absent output: the kernel's branches that store
        to staging or to the output must see pointers of the same element type. Made once per
        dtype, not on every call."""
        if dtype not in self._placeholders:
            self._placeholders[dtype] = torch.empty(1, dtype=dtype, device=self._device)
        return self._placeholders[dtype]

    # ------------------------------------------------------------------ memory regions
    def _dispatch_regions(self, x_words: int, scale_words: int, num_topk: int) -> tuple[int, list[int]]:
        row_bytes = 4 * x_words + 4 * scale_words + 12 * num_topk + 4
        capacity = self.half_bytes // row_bytes // 16 * 16
        offsets, cursor = [], self.memory.data_offset
        for width in (4 * x_words, 4 * scale_words, 8 * num_topk, 4 * num_topk, 4):
            offsets.append(cursor)
            cursor += capacity * width
        return capacity, offsets

    def _combine_regions(self, hidden: int, num_topk: int) -> tuple[int, list[int]]:
        capacity = self.half_bytes // (2 * hidden + 4 * num_topk) // 16 * 16
        start = self.memory.data_offset + self.half_bytes
        return capacity, [start, start + capacity * 2 * hidden]

    # ------------------------------------------------------------------ normal mode
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return dispatch_layout(topk_idx, num_experts, self.num_ranks, self.invalid_ids)

    def _dispatch_shape(self, request: DispatchRequest) -> DispatchShape:
        """The shape of this call's dispatch, worked out on the first call of its kind."""
        x, scales = request.x, request.x_scales
        num_topk = request.topk_idx.shape[1] if request.topk_idx is not None else 0
        scale_words = scales.shape[1] if scales is not None else 0
        key = (x.dtype, x.shape[1], scale_words, num_topk, request.num_experts, request.config.num_sms)
        shape = self._dispatch_shapes.get(key)
        if shape is None:
            row_bytes = x.shape[1] * x.element_size()
            if row_bytes % 4:
                raise InputError(f"the NVLink backend moves rows in 4-byte words; hidden={x.shape[1]} of {x.dtype} "
                                 f"gives {row_bytes} bytes")
            shape = self._dispatch_shapes[key] = DispatchShape.make(
                self, key, row_bytes // 4, scale_words, num_topk, request.num_experts, request.config.num_sms)
        return shape

    def dispatch(self, request: DispatchRequest) -> DispatchResult:
        """Count exchange (fresh dispatch), then two kernels: the send half on a side stream,
        launched before the host reads the counts back, so rows move while the host waits; the
        receive half (own rows, then arrived rows into the outputs) on the current stream,
        which the send half does not hold up. A fresh dispatch of a shape seen before launches
        the receive half before the read-back too, into outputs with room for the previous
        call's rows and some slack, and returns views of their first rows; when more rows
        arrive it stands down and is launched again into exact outputs."""
        self.check_status()
        x, scales = request.x, request.x_scales
        shape = self._dispatch_shape(request)
        handle = request.cached_handle
        R, t = self.num_ranks, self.tuning
        has_topk, num_topk = request.topk_idx is not None, shape.num_topk
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
            self.notify_epoch += 1
            token_list, send_pos, result = notify_dispatch(
                self.memory, request.is_token_in_rank, request.num_tokens_per_expert,
                (shape.x_words, shape.scale_words, num_topk, request.num_experts), self.invalid_ids,
                self.notify_epoch, self.status, self.timeout_ns, self._mailbox, self._launch_key)
            prefix = result[: R * R].view(R, R)
            plan = SendPlan(token_list, send_pos)
            if request.num_worst_tokens > 0:
                num_out_rows, per_expert = request.num_worst_tokens, []
                self._remember_padding(request.num_worst_tokens)
            else:
                reads_counts = True
        self.dispatch_epoch += 1
        # The kernel's argument groups (dispatch_kernel.py); both halves share all but the outputs.
        words = x.view(torch.int32) if x.dim() == 2 else x
        scale_view = scales.view(torch.int32) if scales is not None else words
        inputs = (words, shape.x_words, scale_view, max(shape.scale_words, 1),
                  scale_view.stride(0) if scales is not None else 0, scale_view.stride(1) if scales is not None else 0,
                  request.topk_idx if has_topk else words, request.topk_weights if has_topk else words,
                  shape.experts_per_rank)
        send_plan = (plan.token_list, plan.token_list.stride(0), prefix)
        staging = (self.memory.peer_base_ptrs, self.rank, *shape.regions, shape.capacity)
        ahead = inputs + send_plan
        behind = staging + (self.dispatch_epoch, self.dispatch_released) + (self.status, self.timeout_ns)

        launched: list = [None, None]   # the compiled (send, receive) launches: a cached dispatch learns them

        def send() -> None:   # writes only into peers' staging: needs no output and no host count
            launched[0] = DISPATCH(shape.senders, shape.send_setup, ahead + shape.unused_outputs + behind,
                                   shape.send_constants, t.warps)

        def receive(rows: int, guard_word: int = 0) -> tuple[torch.Tensor, ...]:
            outputs = dispatch_outputs(x, scales, shape, has_topk, rows, request.num_worst_tokens > 0, self._device,
                                       self._cached_recv_src(plan, rows) if handle is not None else None)
            output_args = (outputs[0].view(torch.int32),
                           outputs[1].view(torch.int32) if scales is not None else outputs[4],
                           outputs[2] if has_topk else self._placeholder(torch.int64),
                           outputs[3] if has_topk else self._placeholder(torch.float32), outputs[4], rows, guard_word)
            launched[1] = DISPATCH(shape.receivers, shape.receive_setup, ahead + output_args + behind,
                                   shape.receive_constants, t.warps)
            return outputs

        # The send half runs on the side stream after the exchange (after everything queued on
        # the current stream so far), beside the receive half; one rank sends nothing.
        sends = R > 1
        if sends and (not reads_counts or t.send_before_sync):
            self._send_stream.fork([send])
        if reads_counts:
            guess = guess_rows(shape, t)
            # Into outputs of a guessed size, the receive half follows the exchange on the GPU
            # without waiting for the host; it stands down if the counts call for an error or
            # for more rows (its guard reads the exchange's check words, after the per-expert
            # counts at the end of ``result``).
            outputs = receive(guess, result.numel() - 2) if guess is not None else None
            host = self._wait_counts(shape)
            num_out_rows = shape.last_fresh_rows = host[R * (R - 1) + self.rank]
            if sends and not t.send_before_sync:
                self._send_stream.fork([send])
            if outputs is not None and num_out_rows <= guess:
                outputs = tuple(None if out is None else out[:num_out_rows] for out in outputs)
            else:
                outputs = receive(num_out_rows)
        else:
            outputs = receive(num_out_rows)
        self._send_stream.join()   # later work on the current stream (and the allocator) waits for the send
        self.dispatch_released += shape.receivers
        recv_x, recv_scales, recv_idx, recv_weights, recv_src = outputs
        replay = None
        if handle is not None and request.num_worst_tokens == 0:   # the next such call may replay these launches
            replay = CachedDispatchReplay.learn(
                self, x, scales, *launched, recv_x, recv_scales, num_out_rows,
                shape.scale_words, shape.receivers, self.dispatch_epoch, self.dispatch_released - shape.receivers)
        if reads_counts:   # host bookkeeping, after the launch
            plan.host_prefix = host[: R * R]
            per_expert = round_up_counts(host[R * R: -2], request.expert_alignment)
        if handle is None:
            handle = DispatchHandle(prefix, request.is_token_in_rank, recv_src, num_out_rows, x.shape[1],
                                    self.buffer_id, plan)
        return DispatchResult(recv_x, recv_scales, recv_idx, recv_weights, per_expert, handle, replay)

    def _cached_recv_src(self, plan: SendPlan, rows: int) -> torch.Tensor:
        """Where a cached dispatch's receive half writes the source indices it does not return:
        one scratch tensor per handle (every such call writes the same values)."""
        if plan.cached_recv_src is None:
            plan.cached_recv_src = torch.empty(rows, dtype=torch.int32, device=self._device)
        return plan.cached_recv_src

    def _mailbox_result(self, epoch: int, words: int, what: str) -> list[int]:
        """The result words of count exchange ``epoch`` from the host mailbox, once its flag shows
        the exchange done (the host sync of a fresh dispatch). The poll is bounded: past the
        kernels' own time-out it waits for the stream (its waits on peers are bounded), then
        raises if the flag is still missing. Raises a time-out error if the exchange gave up."""
        box = self._mailbox_host
        if box[0] != epoch:
            deadline = time.monotonic() + self.timeout_ns / 1e9 + 5.0
            while box[0] != epoch:
                if time.monotonic() > deadline:
                    # The GPU may simply be busy with earlier work: wait for it, then decide.
                    torch.cuda.current_stream(self._device).synchronize()
                    if box[0] != epoch:
                        raise TimeoutError(f"rank {self.rank}: {what}: the count exchange (notify, epoch {epoch}) "
                                           f"never reported its result to the host")
        code = int(self._status_host[0])   # a wait that timed out wrote it before the flag
        if code:
            raise timeout_error(code, self.rank, self.timeout_ns, what)
        return box[MAILBOX_HEADER: MAILBOX_HEADER + words].tolist()

    def _wait_counts(self, shape: DispatchShape) -> list[int]:
        """The counts of this fresh dispatch's exchange, checked on every rank alike: the
        mailbox words (``rank_prefix_matrix`` row-major, the per-local-expert counts, the
        disagreeing ranks, the out-of-range ids)."""
        R = self.num_ranks
        host = self._mailbox_result(self.notify_epoch, R * R + shape.experts_per_rank + 2, "dispatch")
        self._check_agreement(host[-2], host[-1])
        received = host[R * (R - 1): R * R]
        if max(received) > shape.capacity:
            worst = received.index(max(received))
            raise InputError(f"rank {worst} would receive {max(received)} rows but the NVLink buffer "
                             f"holds {shape.capacity} rows of {shape.row_bytes} bytes; make the Buffer with more "
                             f"num_nvl_bytes")
        return host

    def combine(self, request: CombineRequest) -> CombineResult:
        x, handle, topk_weights, bias, config = request.x, request.handle, request.topk_weights, request.bias, \
            request.config
        self.check_status()
        plan: SendPlan = handle.backend_state
        hidden = x.shape[1]
        if hidden % 2:
            raise InputError(f"the NVLink backend moves combine rows in 4-byte words; hidden must be even, "
                             f"got {hidden}")
        num_tokens = handle.is_token_in_rank.shape[0]
        num_topk = topk_weights.shape[1] if topk_weights is not None else 0
        capacity, regions = self._combine_regions(hidden, num_topk)
        if plan.counts is None and plan.host_prefix is not None:
            plan.counts = count_rows_from_prefix(plan.host_prefix, self.num_ranks)
            plan.max_send_rows = max(map(sum, plan.counts))
        if plan.max_send_rows is not None and plan.max_send_rows > capacity:
            raise InputError(f"combine would return {plan.max_send_rows} rows to one rank but the NVLink buffer "
                             f"holds {capacity} rows of hidden {hidden}; make the Buffer with more num_nvl_bytes")
        out = torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device=self._device)
        out_weights = torch.empty(num_tokens, num_topk, dtype=torch.float32, device=self._device) \
            if topk_weights is not None else None
        self.combine_epoch += 1
        t = self.tuning
        R = self.num_ranks
        # The kernel's argument groups (combine_kernel.py), in its order.
        args = (x, x.view(torch.int32), topk_weights if topk_weights is not None else x,          # inputs
                bias[0] if bias[0] is not None else x, bias[1] if bias[1] is not None else x, hidden,
                handle.rank_prefix_matrix, handle.is_token_in_rank, plan.send_pos,                 # send plan
                out, out_weights if out_weights is not None else out, num_tokens,                  # outputs
                self.memory.peer_base_ptrs, self.rank, *regions, capacity,                         # staging area
                self.combine_epoch, self.combine_released,                                         # call counters
                self.status, self.timeout_ns)                                                      # status
        # Everything the launch does not convert per call (see COMBINE) follows from the setup
        # key; the constexprs are built only when a key is new (FastLauncher).
        setup = (self._launch_key, hidden, num_topk, topk_weights is not None, bias[0] is not None, bias[1] is not None)

        def constants(senders: int, reducers: int, channels: int) -> Callable[[], dict]:
            def make() -> dict:
                shape = tile_shape(t.rows, 2 * hidden)
                pow2 = triton.next_power_of_2
                return dict(
                    TAIL_WORD=self.memory.signals.combine_tail, DONE_WORD=self.memory.signals.combine_done,
                    MAX_CHANNELS=MAX_CHANNELS, NUM_RANKS=R, RANKS_PAD=pow2(R), HAS_WEIGHTS=topk_weights is not None,
                    NUM_TOPK=max(num_topk, 1), TOPK_PAD=pow2(max(num_topk, 1)), HAS_BIAS0=bias[0] is not None,
                    HAS_BIAS1=bias[1] is not None, BLOCK=min(pow2(hidden), t.combine_block),
                    TOKENS=combine_tile_tokens(t.tokens, R), STAGE=t.stage, GPU=GPU_KERNELS,
                    COPY_BLOCK=tile_block(t.block, shape["ROWS"], hidden // 2),
                    NUM_SENDERS=senders, NUM_REDUCERS=reducers, NUM_CHANNELS=channels, **shape)
            return make
        if plan.counts is not None and t.copy_engine_combine:
            # The rows cross NVLink on the copy engines, piece by piece; every program reduces
            # while they arrive (combine_copy_engine.py).
            pieces = min(pieces_per_peer(R, t.combine_pieces), MAX_CHANNELS)
            self._fork_combine_copies(x, topk_weights, plan, handle.rank_prefix_matrix, regions, pieces)
            reducers = max(1, min(config.num_sms, MAX_CHANNELS, self._max_reducers))
            launch = COMBINE(reducers, setup + (0, reducers, pieces), args, constants(0, reducers, pieces), t.warps)
            self._peer_streams.join()
        else:
            pieces = 0
            senders, reducers = split_programs(config.num_sms, t.combine_sender_fraction)
            launch = COMBINE(senders + reducers, setup + (senders, reducers, senders), args,
                              constants(senders, reducers, senders), t.warps)
        self.combine_released += reducers
        replay = None
        if bias[0] is None and bias[1] is None:   # the next such call may replay this launch
            replay = CombineReplay.learn(
                self, x, topk_weights, handle, launch, out, out_weights, num_tokens, reducers, pieces,
                regions, self.combine_epoch, self.combine_released - reducers)
        return CombineResult(out, out_weights, replay)

    def _fork_combine_copies(self, x: torch.Tensor, topk_weights: torch.Tensor | None, plan: SendPlan,
                             rank_prefix_matrix: torch.Tensor, regions: list[int], pieces: int) -> None:
        """The copy-engine combine's side work for epoch ``combine_epoch``: the top-k weights to
        every peer (on the current stream: the tail words publish them), then each peer's rows
        in ``pieces`` pieces on its side stream (``join`` after the reduction's launch)."""
        if plan.combine_copies is None:
            plan.combine_copies = combine_copies(plan.counts, self.rank)
        if not plan.combine_copies:   # no rows go to a peer (one rank, or all stay here): nothing to send
            return
        if topk_weights is not None:
            push_combine_weights(topk_weights, rank_prefix_matrix, self.memory.peer_base_ptrs, regions[1],
                                 self.rank, self.num_ranks, self._launch_key)
        self._peer_streams.fork(combine_copy_jobs(
            x, plan.combine_copies, self.memory.peers, self.memory.peer_base_ptrs, regions[0],
            self.memory.signals.combine_tail, self.rank, self.combine_epoch, pieces, self._launch_key,
            self._driver if self.tuning.combine_driver else None))

    # ------------------------------------------------------------------ low-latency mode
    def low_latency_dispatch(self, request: LowLatencyDispatchRequest,
                             replay: Replay | None = None) -> LowLatencyDispatchResult:
        return self.low_latency.dispatch(request, self.rank_mask, replay)

    def low_latency_combine(self, request: LowLatencyCombineRequest,
                            replay: Replay | None = None) -> LowLatencyCombineResult:
        return self.low_latency.combine(request, self.rank_mask, replay)

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        return self.low_latency.get_next_low_latency_combine_buffer(handle)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        self.low_latency.clean(self.rank_mask)

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: torch.Size | None, offset: int,
                                use_rdma_buffer: bool) -> torch.Tensor:
        data = self.low_latency.local_bytes() if use_rdma_buffer else self.memory.local[self.memory.data_offset:]
        data = data[offset:]
        element = dtype.itemsize
        view = data[: data.numel() // element * element].view(dtype)
        return view if size is None else view[: torch.Size(size).numel()].view(size)

    def destroy(self) -> None:
        if self._stream is not None:
            torch.cuda.synchronize(self._device)
        dist.barrier(group=self.group)
        if self._memory is not None:
            self._memory.release()
        if self._low_latency is not None:
            self._low_latency.release()
        give_back_released(self.group, [self._memory, self._low_latency.memory if self._low_latency else None])

