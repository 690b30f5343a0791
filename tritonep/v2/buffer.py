"""``ElasticBuffer``: DeepEP V2's front end, over the same engines as V1's ``Buffer``.

It checks every call once (``v2/checks.py``), picks the streams (``runtime/streams.py``), hands
requests to one backend and builds V2's outputs from the backend's (``v2/calls.py``, with
``v2/expand.py``; the handle's fields come from the backend's ``expert_layout``). The
constructor, methods, arguments and return values follow ``deep_ep.ElasticBuffer``; where V2
speaks of RDMA queue pairs, CPU memory or its hybrid kernels, the docstrings say what the value
means here.

Longer than the project's ~400 lines on purpose, as V1's ``Buffer``: V2's whole public surface in
one class, much of it the Arguments/Returns docstrings; the checks and the work live elsewhere.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist

from tritonep.backends.base import Backend
from tritonep.backends.choice import backend_kind, check_node_split, make_backend
from tritonep.core.checks import byte_count, is_int, require
from tritonep.core.rank_agreement import check_same_arguments
from tritonep.core.torch_modes import without_torch_function
from tritonep.runtime.streams import on_comm_stream
from tritonep.v2 import calls, checks, model
from tritonep.v2.event import EventHandle, EventOverlap, wrap
from tritonep.v2.handle import EPHandle

# Distinct from V1's Buffer ids (which count from 1), so that no handle passes for the other's.
_buffer_ids = itertools.count(1 << 32)

# V2's experimental features (Engram, pipeline-parallel send/recv, all-gather reduce-scatter).
_NOT_BUILT = ("engram_write", "engram_fetch", "pp_set_config", "pp_send", "pp_recv", "create_agrs_session",
              "destroy_agrs_session", "agrs_new_session", "agrs_set_config", "agrs_get_inplace_tensor", "all_gather")


class ElasticBuffer:
    """Communication buffers for expert-parallel dispatch and combine, DeepEP V2's API.

    The constructor takes V2's arguments, in the same order and with the same defaults. It is
    collective: every rank of ``group`` must call it. Every argument is checked before any
    communication; then the ranks compare their sizes and options, and unless all agree every
    rank raises InputError.

    Arguments:
        group: the expert-parallel process group. gloo with CPU tensors selects the collective
            (CPU) backend, NCCL with CUDA tensors (one node) the NVLink backend, as for ``Buffer``.
        num_bytes: buffer bytes (GPU plus ``num_cpu_bytes``), a positive multiple of 2 MiB; None:
            sized from the MoE settings below (``get_buffer_size_hint``). The NVLink backend
            stages rows in ``num_bytes - num_cpu_bytes``; the collective backend needs none.
        num_cpu_bytes: V2's CPU memory for Engram, a multiple of 2 MiB (needs ``num_bytes``).
            Engram is not built here: accepted, nothing is allocated.
        num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch: the MoE settings that size
            the buffer (num_topk 0: sized for 32); ``num_max_tokens_per_rank`` is also dispatch's
            default T. fp8 rows are smaller than bf16 ones, so the size covers both.
        deterministic: receive in a fixed order. Always the case here: rows come by source rank,
            then source token (V2's deterministic order), expanded rows grouped by expert in that
            order; False changes nothing.
        allow_hybrid_mode: V2 forwards inter-node traffic through a node peer in hybrid mode. The
            engines here always send directly; the flag only sets the logical domain
            (``num_scaleout_ranks``, ``num_scaleup_ranks``) that V2 code reads.
        allow_multiple_reduction: False asks combine to reduce each token once. Honoured without
            ``do_expand`` (one row per rank is what is reduced anyway); an expanded combine, which
            must sum a token's expert rows on their rank first, raises InputError.
        prefer_overlap_with_compute: False makes ``get_theoretical_num_sms`` give at least 64.
        sl_idx: RDMA service level. No backend uses RDMA: accepted without effect.
        num_allocated_qps: RDMA queue pairs; none exist here. 0 gives V2's automatic count; the
            value only bounds ``num_qps`` (V2's rule) and ``get_theoretical_num_qps``.
        num_cpu_timeout_secs, num_gpu_timeout_secs: V2's time-outs. Accepted without effect: the
            NVLink kernels give up after ``TRITONEP_TIMEOUT_S`` (60 s), the collective backend
            after the process group's own time-out.
        explicitly_destroy: if True, memory is released only by ``destroy()``.
    """

    def __init__(self, group: dist.ProcessGroup, num_bytes: int | None = None, num_cpu_bytes: int = 0,
                 num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0, use_fp8_dispatch: bool = False,
                 deterministic: bool = False, allow_hybrid_mode: bool = True, allow_multiple_reduction: bool = True,
                 prefer_overlap_with_compute: bool = True, sl_idx: int = 3, num_allocated_qps: int = 0,
                 num_cpu_timeout_secs: int = 300, num_gpu_timeout_secs: int = 100,
                 explicitly_destroy: bool = False) -> None:
        require(isinstance(group, dist.ProcessGroup),
                f"group must be a torch.distributed ProcessGroup, got {type(group).__name__}")
        num_ranks = group.size()
        num_cpu_bytes = byte_count("num_cpu_bytes", num_cpu_bytes)
        require(num_cpu_bytes % model.BUFFER_ALIGNMENT == 0,
                f"num_cpu_bytes must be a multiple of 2 MiB, got {num_cpu_bytes}")
        require(is_int(num_max_tokens_per_rank) and num_max_tokens_per_rank >= 0,
                f"num_max_tokens_per_rank must be an int >= 0, got {num_max_tokens_per_rank!r}")
        if num_bytes is None:
            require(num_cpu_bytes == 0, "num_cpu_bytes needs num_bytes (the total, CPU bytes included)")
            num_bytes = model.buffer_bytes(num_ranks, num_max_tokens_per_rank, hidden, num_topk)
        num_bytes = byte_count("num_bytes", num_bytes)
        require(num_bytes > 0 and num_bytes % model.BUFFER_ALIGNMENT == 0,
                f"num_bytes must be a positive multiple of 2 MiB (get_buffer_size_hint gives one), got {num_bytes}")
        require(num_cpu_bytes <= num_bytes, f"num_cpu_bytes ({num_cpu_bytes}) exceeds num_bytes ({num_bytes})")
        for name, value in (("sl_idx", sl_idx), ("num_allocated_qps", num_allocated_qps)):
            require(is_int(value) and value >= 0, f"{name} must be an int >= 0, got {value!r}")
        for name, value in (("num_cpu_timeout_secs", num_cpu_timeout_secs),
                            ("num_gpu_timeout_secs", num_gpu_timeout_secs)):
            require(isinstance(value, (int, float)) and value > 0, f"{name} must be positive, got {value!r}")
        kind = backend_kind(dist.get_backend(group))
        self.num_rdma_ranks, self.num_nvlink_ranks = model.physical_domain_size(num_ranks)
        # A group that spans nodes gets the internode backend, whose heap is the whole buffer.
        heap_bytes = num_bytes - num_cpu_bytes if kind == "nvlink" and self.num_rdma_ranks > 1 else 0
        check_node_split(kind, self.num_rdma_ranks, self.num_nvlink_ranks, heap_bytes)
        # Ranks with different sizes would stage rows differently (NVLink) and ranks on different
        # backends would wait in different collectives.
        check_same_arguments(group, dict(
            num_bytes=num_bytes, num_cpu_bytes=num_cpu_bytes, num_max_tokens_per_rank=num_max_tokens_per_rank,
            deterministic=deterministic, allow_hybrid_mode=allow_hybrid_mode,
            allow_multiple_reduction=allow_multiple_reduction, explicitly_destroy=explicitly_destroy, backend=kind))
        self.group = group
        self.rank_idx = group.rank()
        self.num_ranks = num_ranks
        self.num_bytes = num_bytes
        self.num_cpu_bytes = num_cpu_bytes
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.deterministic = deterministic
        self.allow_hybrid_mode = allow_hybrid_mode
        self.allow_multiple_reduction = allow_multiple_reduction
        self.prefer_overlap_with_compute = prefer_overlap_with_compute
        self.sl_idx = sl_idx
        self.num_allocated_qps = model.allocated_qps(num_allocated_qps, allow_hybrid_mode)
        self.explicitly_destroy = explicitly_destroy
        self.num_scaleout_ranks, self.num_scaleup_ranks = model.logical_domain_size(num_ranks, allow_hybrid_mode)
        self.scaleout_rank_idx = self.rank_idx // self.num_scaleup_ranks
        self.scaleup_rank_idx = self.rank_idx % self.num_scaleup_ranks
        self.buffer_id = next(_buffer_ids)
        self.backend: Backend = make_backend(kind, group, self.buffer_id, num_bytes - num_cpu_bytes - heap_bytes,
                                             heap_bytes, False)
        self.runtime: Backend | None = self.backend   # V2 code tests ``runtime is None`` after destroy()
        self.device = self.backend.device
        self._engine = calls.Engine(self.backend, self.rank_idx, num_ranks, self.num_scaleup_ranks, self.buffer_id)
        self._num_sms_cache: dict[tuple, int] = {}
        self._room_checked: set[tuple[int, int, int]] = set()   # (T, hidden, top-k) that fit the buffer
        # dispatch's num_sms=0: get_theoretical_num_sms at its default rates (which depends on
        # neither the expert count nor top-k), worked out once for the replays' keys.
        self._default_num_sms = self._theoretical_num_sms(0, 200, 50)

    def __getattr__(self, name: str) -> Any:
        if name in _NOT_BUILT:
            raise NotImplementedError(f"ElasticBuffer.{name}: DeepEP V2's experimental Engram / PP / AGRS features "
                                      f"are not built in tritonep; only expert-parallel dispatch and combine are")
        raise AttributeError(f"'ElasticBuffer' object has no attribute {name!r}")

    # ------------------------------------------------------------------ sizes, domains, models
    @staticmethod
    def get_buffer_size_hint(group: dist.ProcessGroup, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0,
                             use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
        """Bytes of ``num_bytes`` for these MoE settings, without making a buffer.

        Arguments:
            group: the process group (its size matters).
            num_max_tokens_per_rank, hidden, num_topk: as in the constructor (num_topk 0: 32).
            use_fp8_dispatch, allow_hybrid_mode, allow_multiple_reduction: accepted; the size
                does not depend on them here (bf16 rows, direct sends, one row per rank).

        Returns:
            bytes, a multiple of 2 MiB: room for every rank to receive T tokens from every rank.
        """
        require(isinstance(group, dist.ProcessGroup),
                f"group must be a torch.distributed ProcessGroup, got {type(group).__name__}")
        return model.buffer_bytes(group.size(), num_max_tokens_per_rank, hidden, num_topk)

    def get_physical_domain_size(self) -> tuple[int, int]:
        """(num_rdma_ranks, num_nvlink_ranks): nodes, and ranks per node (``TRITONEP_GPUS_PER_NODE``,
        else DeepEP's nodes of 8)."""
        return self.num_rdma_ranks, self.num_nvlink_ranks

    def get_logical_domain_size(self) -> tuple[int, int]:
        """(num_scaleout_ranks, num_scaleup_ranks): the physical split with ``allow_hybrid_mode``,
        else (1, num_ranks)."""
        return self.num_scaleout_ranks, self.num_scaleup_ranks

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, num_scaleout_topk: int = 0,
                                rdma_gbs: float = 0, nvlink_gbs: float = 0, sm_read_gbs: float = 200,
                                sm_write_gbs: float = 50) -> int:
        """SMs (programs per launch) for dispatch and combine, from a model of this package's
        NVLink kernels (:func:`tritonep.v2.model.theoretical_num_sms` states its assumptions).
        Cached per arguments.

        Arguments:
            num_experts, num_topk: the MoE shape (checked; the figure does not depend on them).
            num_scaleout_topk: reserved, must be 0 (as in V2).
            rdma_gbs: accepted; no engine here uses RDMA.
            nvlink_gbs: the link's bandwidth each way in GB/s (0: 450, NVLink 4).
            sm_read_gbs, sm_write_gbs: the smaller is one program's row-copy rate in GB/s.

        Returns:
            an even count, at least 4, at most the device's SMs.
        """
        model.check_model_arguments(num_experts, num_topk, num_scaleout_topk, self.num_ranks)
        return self._theoretical_num_sms(nvlink_gbs, sm_read_gbs, sm_write_gbs)

    def _theoretical_num_sms(self, nvlink_gbs: float, sm_read_gbs: float, sm_write_gbs: float) -> int:
        key = (nvlink_gbs, sm_read_gbs, sm_write_gbs)
        if key not in self._num_sms_cache:
            device_sms = torch.cuda.get_device_properties(self.device).multi_processor_count \
                if self.device.type == "cuda" else None
            self._num_sms_cache[key] = model.theoretical_num_sms(
                self.num_ranks, device_sms, self.prefer_overlap_with_compute, nvlink_gbs, sm_read_gbs, sm_write_gbs)
        return self._num_sms_cache[key]

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """V2's QP count for ``num_sms`` SMs. No engine here uses QPs: the value only keeps V2
        code's ``num_qps`` arithmetic valid.

        Arguments:
            num_sms: the SMs of the dispatch/combine.

        Returns:
            num_sms * 16 + 1 with ``allow_hybrid_mode``, else min(num_sms, 9); at most
            ``num_allocated_qps``.
        """
        require(is_int(num_sms) and num_sms > 0, f"num_sms must be a positive int, got {num_sms!r}")
        return model.theoretical_num_qps(num_sms, self.allow_hybrid_mode, self.num_allocated_qps)

    # ------------------------------------------------------------------ streams and lifetime
    @staticmethod
    def capture() -> EventHandle:
        """An event recorded on the current stream, to pass as ``previous_event``."""
        return EventHandle()

    def get_comm_stream(self) -> torch.cuda.Stream | None:
        """The stream communication runs on (None on the CPU backend)."""
        return self.backend.comm_stream()

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        """Wait until every rank of the group reaches this point (collective).

        Arguments:
            use_comm_stream: accepted; the barrier is the process group's, which blocks the host.
            with_cpu_sync: also synchronise this rank's GPU before and after.
            sequential: accepted; there are no scale-out and scale-up barriers to order.
        """
        self._check_alive()
        on_gpu = self.device.type == "cuda"
        if with_cpu_sync and on_gpu:
            torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)
        if with_cpu_sync and on_gpu:
            torch.cuda.synchronize(self.device)

    def destroy(self) -> None:
        """Release the buffers (collective). Only allowed with ``explicitly_destroy=True``."""
        require(self.explicitly_destroy, "destroy() is only for ElasticBuffers made with explicitly_destroy=True")
        self._check_alive()
        self._engine.handle_replays.clear()
        self.backend.destroy()
        self.runtime = None

    def _check_buffer_room(self, num_max_tokens_per_rank: int, hidden: int, num_topk: int) -> None:
        """InputError unless a dispatch of this (T, hidden, top-k) fits the buffer; the sizes that
        fit are remembered (the size model reads the node split from the environment)."""
        key = (num_max_tokens_per_rank, hidden, num_topk)
        if key not in self._room_checked:
            checks.check_buffer_room(model.buffer_bytes(self.num_ranks, num_max_tokens_per_rank, hidden, num_topk),
                                     self.num_bytes - self.num_cpu_bytes, num_max_tokens_per_rank, hidden, num_topk)
            self._room_checked.add(key)

    def _check_alive(self) -> None:
        require(self.runtime is not None, "this ElasticBuffer was destroyed")

    def _replayable(self, handle: object, num_sms: object, num_qps: object, previous_event: object,
                    previous_event_before_epilogue: object, async_with_compute_stream: object,
                    allocate_on_comm_stream: object) -> bool:
        """What dispatch's and combine's replays ask first (a few reads each): a handle of this
        live buffer, num_sms and num_qps that the general path would accept, and no stream
        options (a replay launches on the caller's stream)."""
        return (type(handle) is EPHandle and handle._state.buffer_id == self.buffer_id and self.runtime is not None
                and previous_event is None and previous_event_before_epilogue is None
                and not async_with_compute_stream and not allocate_on_comm_stream
                and type(num_sms) is int and num_sms >= 0
                and type(num_qps) is int and 0 <= num_qps <= self.num_allocated_qps)

    # ------------------------------------------------------------------ dispatch and combine
    @without_torch_function
    def dispatch(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor], topk_idx: torch.Tensor | None = None,
                 topk_weights: torch.Tensor | None = None,
                 cumulative_local_expert_recv_stats: torch.Tensor | None = None, num_experts: int | None = None,
                 num_max_tokens_per_rank: int | None = None, expert_alignment: int | None = None, num_sms: int = 0,
                 num_qps: int = 0, previous_event: EventOverlap | None = None,
                 previous_event_before_epilogue: EventOverlap | None = None, async_with_compute_stream: bool = False,
                 allocate_on_comm_stream: bool = False, handle: EPHandle | None = None, do_handle_copy: bool = True,
                 do_cpu_sync: bool | None = None, do_expand: bool = False, do_zero_padding: bool = False,
                 use_tma_aligned_col_major_sf: bool = False) -> tuple:
        """Send each token to every rank that holds one of its top-k experts.

        Arguments:
            x: bf16 [N, H], or (fp8 e4m3 [N, H], scales [N, S] float32 or packed UE8M0 int32, any
                strides), the scales carried unchanged. A row must be a multiple of 16 bytes.
            topk_idx: [N, K] int64 (``topk_idx_t``) global expert ids, -1 for none; None with a handle.
            topk_weights: optional [N, K] float32.
            cumulative_local_expert_recv_stats: optional int32 [E/R], incremented by the tokens
                each local expert receives (a cached dispatch leaves it, as in V2).
            num_experts: E, divisible by R; from the handle when cached.
            num_max_tokens_per_rank: T >= N, the same on every rank; default: the constructor's.
            expert_alignment: pad each local expert's count to a multiple of this (default 1).
            num_sms: programs per launch (0: ``get_theoretical_num_sms``); the collective backend
                ignores it. num_qps: checked against ``num_allocated_qps``, else unused.
            previous_event: wait for it first (needs ``allocate_on_comm_stream``).
            previous_event_before_epilogue: wait for it before the outputs are built from the
                received rows (the expanded layout and the handle's fields).
            async_with_compute_stream: return an event instead of making the current stream wait.
            allocate_on_comm_stream: with an event, work and outputs are on the communication
                stream anyway (outputs recorded on the current stream).
            handle: an EPHandle from an earlier dispatch: same routing, no count exchange, no
                CPU sync. ``topk_weights`` may come along (moved with a fresh engine dispatch of
                the handle's routing, since engines' cached dispatches carry rows only).
            do_handle_copy: keep a copy of topk_idx in the handle (else the caller's tensor).
            do_cpu_sync: read the counts on the host (exact output sizes; default True without a
                handle). False: outputs of the worst-case size (R * T rows, or
                ``num_expanded_tokens``), counts only on the device, no host sync on the NVLink
                backend: CUDA-graph capturable.
            do_expand: one row per (token, local expert) pair, grouped by expert, each expert's
                block aligned to expert_alignment (``v2/expand.py``).
            do_zero_padding: zero the expanded layout's padding rows (and their scales, weights).
            use_tma_aligned_col_major_sf: scales column-major, columns 16-byte aligned.

        Returns:
            recv_x: bf16 [M, H] or (fp8 [M, H], scales [M, S]); rows by source rank ascending,
                source token order inside (expanded: grouped by local expert, in that order).
            recv_topk_idx: int64 [M, K] local expert ids, -1 where the expert lives elsewhere;
                None when expanded.
            recv_topk_weights: float32 [M, K] (0 where recv_topk_idx is -1; V2 leaves the
                sender's weight there), or [M] per expanded row; None without topk_weights.
            handle: an EPHandle (the given one when cached).
            event: an EventOverlap to wait on when ``async_with_compute_stream``.
        """
        # A cached dispatch repeated as before (every layer's backward): the replay its engine
        # handle learnt checks x against the call it learnt and launches; anything else takes
        # the general path below, which checks every argument.
        if (self._replayable(handle, num_sms, num_qps, previous_event, previous_event_before_epilogue,
                             async_with_compute_stream, allocate_on_comm_stream)
                and topk_idx is None and topk_weights is None and cumulative_local_expert_recv_stats is None
                and _same(num_experts, handle.num_experts) and _same(expert_alignment, handle.expert_alignment)
                and _same(num_max_tokens_per_rank, handle.num_max_tokens_per_rank) and not do_cpu_sync
                and do_expand is handle.do_expand and (do_expand or not do_zero_padding)):
            data, scales = x if type(x) is tuple and len(x) == 2 else (x, None)
            if type(data) is torch.Tensor and (scales is None or type(scales) is torch.Tensor):
                outputs = calls.replayed_dispatch(self._engine, handle, data, scales, num_sms or self._default_num_sms,
                                                   do_zero_padding, use_tma_aligned_col_major_sf)
                if outputs is not None:
                    return outputs
        self._check_alive()
        # No event to wait for or to return: the work runs on the caller's stream, with no scope
        # to enter and no outputs to record (what on_comm_stream would do, less its host cost).
        plain = previous_event is None and previous_event_before_epilogue is None and not async_with_compute_stream
        checks.check_stream_args(previous_event, previous_event_before_epilogue, allocate_on_comm_stream)
        checks.check_sms_and_qps(num_sms, num_qps, self.num_allocated_qps)
        call = checks.dispatch_call(x, topk_idx, topk_weights, cumulative_local_expert_recv_stats, num_experts,
                                    num_max_tokens_per_rank, expert_alignment, handle, do_cpu_sync, do_expand,
                                    do_zero_padding, self.num_max_tokens_per_rank, self.num_ranks, self.buffer_id,
                                    self.device)
        num_topk, hidden = call.topk_idx.shape[1], call.x.shape[1]
        self._check_buffer_room(call.num_max_tokens_per_rank, hidden, num_topk)
        options = calls.Options(
            num_sms=num_sms or self.get_theoretical_num_sms(call.num_experts, num_topk),
            do_zero_padding=do_zero_padding,
            do_handle_copy=do_handle_copy, col_major_sf=use_tma_aligned_col_major_sf,
            stats=cumulative_local_expert_recv_stats, before_epilogue=previous_event_before_epilogue)
        run = calls.cached_dispatch if call.handle is not None else calls.fresh_dispatch
        if plain:
            return run(self._engine, call, options).outputs(EventOverlap())
        inputs = (call.x, call.scales, call.topk_idx, call.topk_weights, cumulative_local_expert_recv_stats)
        with on_comm_stream(self.backend.comm_stream(), previous_event, async_with_compute_stream, inputs) as scope:
            received = run(self._engine, call, options)
            scope.keep(*received.tensors())
        return received.outputs(wrap(scope.event))

    @without_torch_function
    def combine(self, x: torch.Tensor, handle: EPHandle, topk_weights: torch.Tensor | None = None,
                bias: torch.Tensor | tuple[torch.Tensor | None, torch.Tensor | None] | None = None, num_sms: int = 0,
                num_qps: int = 0, previous_event: EventOverlap | None = None,
                previous_event_before_epilogue: EventOverlap | None = None, async_with_compute_stream: bool = False,
                allocate_on_comm_stream: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:
        """Send each received row back to its token's rank and sum the rows of each token.

        Arguments:
            x: bf16 [M, H], rows in dispatch's order (M: ``handle.num_recv_tokens``, or
                ``handle.num_expanded_tokens`` for an expanded handle). Padding rows are not read.
            handle: the EPHandle of that dispatch.
            topk_weights: optional float32 [M, K] (or [M] expanded), carried back per slot.
            bias: None, a bf16 [N, H] tensor or a 2-tuple of them (or None), added to the sum.
            num_sms: programs per launch (0: the handle's). num_qps: as in dispatch.
            previous_event, previous_event_before_epilogue, async_with_compute_stream,
                allocate_on_comm_stream: as in dispatch (the second is waited for first:
                this combine has no separate epilogue).

        Returns:
            combined_x: bf16 [N, H], per token the bias plus the unweighted sum over its ranks'
                rows (expanded: over its experts' rows), accumulated in float32.
            combined_topk_weights: float32 [N, K], slot k's weight from the rank of its expert
                (0 where topk_idx is -1), or None without topk_weights.
            event: an EventOverlap to wait on when ``async_with_compute_stream``.
        """
        # A combine repeated as before (every layer, every step): as in dispatch. The replay
        # compares x and the weights with those it learnt from a checked call (dtype, shape,
        # strides, device), so only their types are checked here.
        if (self._replayable(handle, num_sms, num_qps, previous_event, previous_event_before_epilogue,
                             async_with_compute_stream, allocate_on_comm_stream)
                and bias is None and not handle.do_expand and type(x) is torch.Tensor
                and (topk_weights is None or type(topk_weights) is torch.Tensor)):
            combined = calls.replayed_combine(self._engine, handle, x, topk_weights, num_sms or handle.num_sms)
            if combined is not None:
                return combined[0], combined[1], EventOverlap()
        self._check_alive()
        checks.check_stream_args(previous_event, previous_event_before_epilogue, allocate_on_comm_stream)
        checks.check_sms_and_qps(num_sms, num_qps, self.num_allocated_qps)
        call = checks.combine_call(x, handle, topk_weights, bias, self.allow_multiple_reduction, self.buffer_id,
                                   self.device)
        with on_comm_stream(self.backend.comm_stream(), previous_event, async_with_compute_stream,
                            (call.x, call.topk_weights, call.bias)) as scope:
            combined_x, combined_weights = calls.combine(self._engine, call, num_sms or call.handle.num_sms,
                                                         previous_event_before_epilogue)
            scope.keep(combined_x, combined_weights)
        return combined_x, combined_weights, wrap(scope.event)


def _same(given: object, cached: int) -> bool:
    """A cached dispatch's option left out, or given as the handle has it."""
    return given is None or (type(given) is int and given == cached)


def _domain_group_size(group: dist.ProcessGroup) -> int:
    require(isinstance(group, dist.ProcessGroup),
            f"group must be a torch.distributed ProcessGroup, got {type(group).__name__}")
    return group.size()


def get_physical_domain_size(group: dist.ProcessGroup) -> tuple[int, int]:
    """V2's module-level helper, without a buffer.

    Arguments:
        group: the expert-parallel process group.

    Returns:
        (num_rdma_ranks, num_nvlink_ranks): nodes, and ranks per node (``core.topology``).
    """
    return model.physical_domain_size(_domain_group_size(group))


def get_logical_domain_size(group: dist.ProcessGroup, allow_hybrid_mode: bool = True) -> tuple[int, int]:
    """V2's module-level helper, without a buffer.

    Arguments:
        group: the expert-parallel process group.
        allow_hybrid_mode: as in the ElasticBuffer constructor.

    Returns:
        (num_scaleout_ranks, num_scaleup_ranks): the physical split in hybrid mode, else (1, R).
    """
    return model.logical_domain_size(_domain_group_size(group), allow_hybrid_mode)
