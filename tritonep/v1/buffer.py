"""``Buffer``: DeepEP V1's front end.

It checks every call once (``v1/checks.py``), picks the streams, hands well-formed requests to
one backend (``backends/``: collective for gloo groups and CPU tensors, NVLink for NCCL groups
inside one node) and replays calls that repeat (``core/replay.py``). The methods, arguments and
return values follow ``deep_ep.Buffer``.

Longer than the project's ~400 lines on purpose: it is DeepEP V1's whole public surface in one
class, as its users read it, and a third of it is the Arguments/Returns docstrings. The checks
live in ``v1/checks.py`` and the work in the backends.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tritonep.backends.base import Backend, LowLatencyCombineRequest, LowLatencyDispatchRequest
from tritonep.backends.choice import backend_kind, check_backend_options, check_node_split, make_backend
from tritonep.backends.nvlink.sizes import low_latency_buffer_bytes
from tritonep.core import checks, routing, topology
from tritonep.core.checks import byte_count, is_int, require
from tritonep.core.config import Config
from tritonep.core.event import NO_EVENT, EventOverlap, capture_event
from tritonep.core.groups import backend_for_comm, check_comm, group_from_comm
from tritonep.core.handles import DispatchHandle, LowLatencyHandle
from tritonep.core.rank_agreement import check_same_arguments
from tritonep.core.replay import ReplayTable, handle_replay, learn_handle_replay
from tritonep.core.torch_modes import plain_hook, torch_functions_off, without_torch_function
from tritonep.runtime.streams import on_comm_stream
from tritonep.v1 import checks as v1_checks

_buffer_ids = itertools.count(1)


# Replay keys of the calls made with a handle (the handle's table; see Buffer._plain_num_sms).
_CACHED_DISPATCH, _COMBINE = "cached_dispatch", "combine"


class Buffer:
    """Communication buffers for expert-parallel dispatch and combine.

    The constructor takes DeepEP V1's arguments, in the same order and with the same defaults.
    It is collective: every rank of ``group`` (or of ``comm``) must call it. Every argument is
    checked before any communication starts. Then the ranks compare their sizes, modes and
    backend: unless all agree, every rank raises InputError. If allocating or mapping the
    shared memory fails on some rank (out of memory, say), every rank raises RuntimeError
    naming it, instead of waiting for it.

    Arguments:
        group: the process group of the expert-parallel ranks. gloo with CPU tensors selects
            the CPU backend; NCCL with CUDA tensors (all ranks in one node) the NVLink backend.
            May be None when ``comm`` is given. Its ranks split into ``num_nodes`` nodes of
            ``ranks_per_node`` consecutive ranks (:mod:`tritonep.core.topology`:
            ``TRITONEP_GPUS_PER_NODE``, else nodes of 8 as in DeepEP); only the CPU backend
            takes a group that spans several nodes.
        num_nvl_bytes: bytes of the intranode buffer used by normal-mode dispatch/combine.
        num_rdma_bytes: bytes of the buffer used by low-latency mode (and, later, internode).
        low_latency_mode: enable the low-latency kernels.
        num_qps_per_rank: RDMA queue pairs per peer in DeepEP. No backend here uses RDMA, so the
            value selects nothing; in low-latency mode it must still be a positive int, as in DeepEP.
        allow_nvlink_for_low_latency_mode: False asks low-latency traffic to avoid NVLink. The
            NVLink backend has no other path, and the collective backend on NCCL lets NCCL pick
            its transport, so both raise InputError for False in low-latency mode; on gloo (no
            NVLink involved) and outside low-latency mode it changes nothing. A group that spans
            nodes honours it on NVSHMEM (every peer reached by NVSHMEM's puts) and raises on the
            plain-stores transport.
        allow_mnnvl: allow multi-node NVLink. Both backends work inside one node, so allowing it
            changes nothing.
        use_fabric: allocate the shared buffers with CUDA fabric handles. The NVLink backend's
            memory comes from torch symmetric memory, which uses fabric handles by itself where
            the GPU supports them; where it does not (or under the Triton interpreter) True raises
            InputError. The collective backend shares no memory, so it ignores the flag.
        explicitly_destroy: if True, memory is released only by ``destroy()``.
        enable_shrink: shrink mode: allocate a per-rank mask so that low-latency calls can skip
            ranks (``low_latency_update_mask_buffer``).
        comm: an ``mpi4py`` communicator, used when ``group`` is None: the Buffer then makes a
            torch process group over the same processes in the same rank order
            (:func:`tritonep.core.groups.group_from_comm`; needs mpi4py). Ignored when ``group`` is given.
    """

    num_sms: int = 20

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        use_fabric: bool = False,
        explicitly_destroy: bool = False,
        enable_shrink: bool = False,
        comm: Any | None = None,
    ) -> None:
        num_nvl_bytes = byte_count("num_nvl_bytes", num_nvl_bytes)
        num_rdma_bytes = byte_count("num_rdma_bytes", num_rdma_bytes)
        if low_latency_mode:
            # DeepEP asserts this whenever it sets up RDMA, which low-latency mode always does.
            require(is_int(num_qps_per_rank) and num_qps_per_rank > 0,
                    f"num_qps_per_rank must be a positive int in low-latency mode, got {num_qps_per_rank!r}")
        if group is None:
            require(comm is not None, "Buffer needs group (a torch.distributed ProcessGroup) or, with group=None, "
                                      "comm (an mpi4py communicator)")
            check_comm(comm)
            group_backend = backend_for_comm()
        else:
            require(isinstance(group, dist.ProcessGroup),
                    f"group must be a torch.distributed ProcessGroup, got {type(group).__name__}"
                    + ("; pass an mpi4py communicator as comm=... with group=None" if hasattr(group, "Get_rank")
                       else ""))
            group_backend = dist.get_backend(group)
        kind = backend_kind(group_backend)
        num_ranks = group.size() if group is not None else int(comm.Get_size())
        self.ranks_per_node = topology.ranks_per_node(num_ranks)
        self.num_nodes = num_ranks // self.ranks_per_node
        check_backend_options(kind, group_backend, low_latency_mode, allow_nvlink_for_low_latency_mode, use_fabric,
                              self.num_nodes)
        check_node_split(kind, self.num_nodes, self.ranks_per_node, num_rdma_bytes, low_latency_mode)
        if group is None:
            group = group_from_comm(comm)   # the first communication
        self.group, self.comm, self.rank, self.group_size = group, comm, group.rank(), group.size()
        # Every constructor argument is kept, under its own name (DeepEP's code reads some of them).
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode, self.num_qps_per_rank = low_latency_mode, num_qps_per_rank
        self.allow_nvlink_for_low_latency_mode = allow_nvlink_for_low_latency_mode
        self.allow_mnnvl, self.use_fabric, self.explicitly_destroy = allow_mnnvl, use_fabric, explicitly_destroy
        self.enable_shrink = enable_shrink
        self._low_latency_sizes_checked: set[tuple[int, int, int]] = set()
        self._low_latency_options_checked: set[tuple] = set()   # option sets whose static checks passed
        # Ranks given different sizes would lay out the memory they share differently (silent
        # corruption), and ranks on different backends would wait in different collectives.
        check_same_arguments(group, dict(num_nvl_bytes=num_nvl_bytes, num_rdma_bytes=num_rdma_bytes,
                                         low_latency_mode=low_latency_mode, enable_shrink=enable_shrink,
                                         explicitly_destroy=explicitly_destroy, backend=kind))
        self.buffer_id = next(_buffer_ids)
        self.backend: Backend = make_backend(kind, group, self.buffer_id, num_nvl_bytes, num_rdma_bytes,
                                             low_latency_mode, allow_nvlink_for_low_latency_mode)
        self.device = self.backend.device
        self._on_gpu = self.device.type == "cuda"
        # Low-latency calls that repeat, by their options and shapes (see low_latency_dispatch).
        self._low_latency_replays = ReplayTable()
        # The latest cached dispatch and combine replays of any handle, by their keys: a new
        # handle's first such call rebinds one (core/replay.py).
        self._handle_replays = ReplayTable()
        if enable_shrink:
            self.backend.rank_mask = torch.zeros(self.group_size, dtype=torch.int32, device=self.device)
        self._destroyed = False

    # ------------------------------------------------------------------ static helpers
    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set the SMs (programs per launch) normal-mode kernels may use. Must be even."""
        require(new_num_sms % 2 == 0 and new_num_sms > 0, f"num_sms must be a positive even number, got {new_num_sms}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event recorded on the current stream, to pass as ``previous_event``."""
        return capture_event()

    @staticmethod
    def is_sm90_compiled() -> bool:
        """Triton compiles for the GPU at hand at run time, so Hopper is always covered."""
        return True

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """Recommended dispatch config for ``num_ranks`` ranks."""
        return Config(Buffer.num_sms, 32, 256, 6, 128)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """Recommended combine config for ``num_ranks`` ranks."""
        return Config(Buffer.num_sms, 32, 256, 6, 128)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes of ``num_rdma_bytes`` low-latency mode needs for these sizes."""
        return low_latency_buffer_bytes(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    # ------------------------------------------------------------------ lifetime and memory
    def destroy(self) -> None:
        """Release the buffers (collective). Only allowed with ``explicitly_destroy=True``."""
        require(self.explicitly_destroy, "destroy() is only for buffers made with explicitly_destroy=True")
        self._check_alive()
        self._low_latency_replays.clear()
        self._handle_replays.clear()
        self.backend.destroy()
        self._destroyed = True

    def get_comm_stream(self) -> torch.cuda.Stream | None:
        """The stream communication kernels run on (None on the CPU backend)."""
        return self.backend.comm_stream()

    @without_torch_function
    def get_local_buffer_tensor(self, dtype: torch.dtype, size: torch.Size | None = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """A view of this rank's communication memory.

        Arguments:
            dtype: element type of the view.
            size: shape of the view; None means as many elements as fit after ``offset``.
            offset: byte offset into the buffer.
            use_rdma_buffer: view the low-latency (RDMA) buffer instead of the NVLink one.

        Returns:
            a tensor aliasing the buffer.
        """
        self._check_alive()
        total = self.num_rdma_bytes if use_rdma_buffer else self.num_nvl_bytes
        element = dtype.itemsize
        require(0 <= offset <= total, f"offset {offset} is outside the {total}-byte buffer")
        if size is not None:
            needed = int(torch.Size(size).numel()) * element
            require(offset + needed <= total,
                    f"a {list(size)} {dtype} view at offset {offset} needs {offset + needed} bytes; "
                    f"the buffer has {total}")
        return self.backend.get_local_buffer_tensor(dtype, size, offset, use_rdma_buffer)

    # ------------------------------------------------------------------ normal mode
    @without_torch_function
    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, EventOverlap]:
        """Count how many tokens go to each rank and expert.

        Arguments:
            topk_idx: [N, K] int64, global expert ids in [0, E) or -1 for no expert.
            num_experts: E, divisible by the number of ranks.
            previous_event, async_finish, allocate_on_comm_stream: stream control (see class doc).

        Returns:
            num_tokens_per_rank: [R] int32.
            num_tokens_per_rdma_rank: int32 [num_nodes] on this Buffer's device, the tokens that go
                to at least one rank of each node (counted once per node), when the group spans
                several nodes; None when it is one node.
            num_tokens_per_expert: [E] int32.
            is_token_in_rank: [N, R] bool.
            event: the event to wait on when ``async_finish``.
        """
        self._check_alive()
        # A well-formed call passes on a few attribute reads; any miss runs the full checks,
        # which say what is wrong. The ids' values are checked on every call: here on the CPU,
        # by the layout kernel on the GPU (dispatch then raises on every rank).
        if not (type(topk_idx) is torch.Tensor and topk_idx.dtype == torch.int64 and topk_idx.dim() == 2
                and (topk_idx.is_cuda if self._on_gpu else topk_idx.is_cpu) and topk_idx.is_contiguous()
                and type(num_experts) is int and num_experts > 0 and num_experts % self.group_size == 0):
            checks.check_num_experts(num_experts, self.group_size)
            checks.check_tensor("topk_idx", topk_idx, dtype=torch.int64, shape=(None, None), device=self.device)
        checks.check_expert_ids("topk_idx", topk_idx, num_experts)
        if previous_event is None and not async_finish and not allocate_on_comm_stream and self.num_nodes == 1:
            # On the current stream, with no event (as on_comm_stream would run it), and no scope.
            per_rank, per_expert, in_rank = self.backend.get_dispatch_layout(topk_idx, num_experts)
            return per_rank, None, per_expert, in_rank, NO_EVENT
        checks.check_stream_args(previous_event, async_finish, allocate_on_comm_stream)
        with on_comm_stream(self.backend.comm_stream(), previous_event, async_finish, (topk_idx,)) as scope:
            per_rank, per_expert, in_rank = self.backend.get_dispatch_layout(topk_idx, num_experts)
            per_node = routing.tokens_per_node(in_rank, self.ranks_per_node) if self.num_nodes > 1 else None
            scope.keep(per_rank, per_expert, in_rank, per_node)
        return per_rank, per_node, per_expert, in_rank, scope.event

    @without_torch_function
    def dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        handle: DispatchHandle | None = None,
        num_tokens_per_rank: torch.Tensor | None = None,
        num_tokens_per_rdma_rank: torch.Tensor | None = None,
        is_token_in_rank: torch.Tensor | None = None,
        num_tokens_per_expert: torch.Tensor | None = None,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple:
        """Send each token to every rank that holds one of its top-k experts.

        Arguments:
            x: bf16 [N, H], or a tuple (fp8 e4m3 [N, H], scales float32 [N, H/128] or packed
                int32) whose scales are carried through unchanged.
            handle: a handle from an earlier dispatch: reuse its layout (cached mode). Then the
                layout arguments and top-k must be None.
            num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert: from
                ``get_dispatch_layout``.
            num_tokens_per_rdma_rank: from ``get_dispatch_layout``: int32 [num_nodes], required by
                a fresh dispatch when the group spans several nodes (as in DeepEP's internode
                dispatch); must be None in cached mode and when the group is one node.
            topk_idx: [N, K] int64 global expert ids (-1 = none); topk_weights: [N, K] float32.
            expert_alignment: round each per-expert count up to a multiple of this.
            num_worst_tokens: if > 0, output exactly this many rows and skip the host sync.
            config: performance knobs; defaults to ``get_dispatch_config``.
            previous_event, async_finish, allocate_on_comm_stream: stream control.

        Returns:
            recv_x: bf16 [M, H] or (fp8 [M, H], scales), rows grouped by source rank ascending,
                source token order inside a group.
            recv_topk_idx: [M, K] int64, ids local to this rank, -1 for experts elsewhere.
            recv_topk_weights: [M, K] float32, 0 where recv_topk_idx is -1.
            num_recv_tokens_per_expert_list: list of E/R ints, aligned (empty with num_worst_tokens).
            handle: for combine and cached dispatch; element 0 is rank_prefix_matrix.
            event: the event to wait on when ``async_finish``.
            In cached mode recv_topk_idx, recv_topk_weights, the list and handle are None.
            On the NVLink backend the outputs of a fresh dispatch may be views of the first M
            rows of larger tensors (the previous call's M plus about 6%, allocated before the
            counts were known; ``TRITONEP_RECEIVE_BEFORE_SYNC=0`` allocates exactly M rows).
        """
        # A cached dispatch repeated as before (every layer's backward in training): its replay
        # checks x against the call it learnt and launches, or returns None and the general path
        # below checks everything.
        num_sms = self._plain_num_sms(handle, config, previous_event, async_finish, allocate_on_comm_stream)
        if (num_sms and num_tokens_per_rank is None and num_tokens_per_rdma_rank is None and is_token_in_rank is None
                and num_tokens_per_expert is None and topk_idx is None and topk_weights is None
                and type(num_worst_tokens) is int and not num_worst_tokens and type(expert_alignment) is int
                and expert_alignment >= 1):
            data, scales = x if type(x) is tuple and len(x) == 2 else (x, None)
            if type(data) is torch.Tensor and (scales is None or type(scales) is torch.Tensor):
                replay = handle_replay(self._handle_replays, (_CACHED_DISPATCH, num_sms, scales is None), handle)
                recv_x = replay(data, scales) if replay is not None else None
                if recv_x is not None:
                    return recv_x, None, None, None, None, NO_EVENT
        self._check_alive()
        checks.check_stream_args(previous_event, async_finish, allocate_on_comm_stream)
        config = config or self.get_dispatch_config(self.group_size)
        v1_checks.check_tokens_per_node(num_tokens_per_rdma_rank, handle is not None, self.group_size, self.num_nodes,
                                        self.ranks_per_node, self.device)
        request = v1_checks.dispatch_request(x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                                             topk_idx, topk_weights, expert_alignment, num_worst_tokens, config,
                                             self.group_size, self.buffer_id, self.device)
        scales = request.x_scales
        inputs = (request.x, scales, topk_idx, topk_weights, request.is_token_in_rank)
        with on_comm_stream(self.backend.comm_stream(), previous_event, async_finish, inputs) as scope:
            result = self.backend.dispatch(request)
            scope.keep(result.recv_x, result.recv_x_scales, result.recv_topk_idx, result.recv_topk_weights)
        recv_x = result.recv_x if scales is None else (result.recv_x, result.recv_x_scales)
        if handle is not None:
            learn_handle_replay(self._handle_replays, (_CACHED_DISPATCH, config.num_sms, scales is None), handle,
                                result.replay)
            return recv_x, None, None, None, None, scope.event
        return (recv_x, result.recv_topk_idx, result.recv_topk_weights,
                result.num_recv_tokens_per_expert_list, result.handle, scope.event)

    @without_torch_function
    def combine(
        self,
        x: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: torch.Tensor | None = None,
        bias: torch.Tensor | tuple[torch.Tensor | None, torch.Tensor | None] | None = None,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:
        """Send each received row back to its source rank and sum the copies of each token.

        Arguments:
            x: bf16 [M, H] in the order dispatch returned (M as in the handle).
            handle: the handle of that dispatch.
            topk_weights: optional [M, K] float32, summed the same way.
            bias: optional bf16 [N, H] tensor or 2-tuple of them, added to the result.
            config, previous_event, async_finish, allocate_on_comm_stream: as in dispatch.

        Returns:
            combined_x: bf16 [N, H], out[t] = bias + sum over ranks that received t of their row
                (accumulated in float32, not weighted).
            combined_topk_weights: [N, K] float32 or None.
            event: the event to wait on when ``async_finish``.
        """
        # A combine repeated as before (every layer, every step): as in dispatch.
        num_sms = self._plain_num_sms(handle, config, previous_event, async_finish, allocate_on_comm_stream)
        if (num_sms and type(x) is torch.Tensor and (topk_weights is None or type(topk_weights) is torch.Tensor)
                and bias is None):
            replay = handle_replay(self._handle_replays, (_COMBINE, num_sms, topk_weights is None), handle)
            combined = replay(x, topk_weights) if replay is not None else None
            if combined is not None:
                return combined[0], combined[1], NO_EVENT
        self._check_alive()
        checks.check_stream_args(previous_event, async_finish, allocate_on_comm_stream)
        config = config or self.get_combine_config(self.group_size)
        request = v1_checks.combine_request(x, handle, topk_weights, bias, config, self.buffer_id, self.device)
        with on_comm_stream(self.backend.comm_stream(), previous_event, async_finish,
                            (x, topk_weights, request.bias)) as scope:
            result = self.backend.combine(request)
            scope.keep(result.combined_x, result.combined_topk_weights)
        if request.bias == (None, None):
            learn_handle_replay(self._handle_replays, (_COMBINE, config.num_sms, topk_weights is None), handle,
                                result.replay)
        return result.combined_x, result.combined_topk_weights, scope.event

    # ------------------------------------------------------------------ low-latency mode
    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        dispatch_wait_recv_cost_stats: torch.Tensor | None = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
    ) -> tuple:
        """Send each (token, expert) pair to the expert's rank, packed per local expert.

        Arguments:
            x: bf16 [N, H] with N <= num_max_dispatch_tokens_per_rank (T, same on all ranks).
            topk_idx: [N, K] int64 global expert ids, -1 = none, K <= 11.
            num_max_dispatch_tokens_per_rank: T.
            num_experts: E, divisible by the number of ranks.
            cumulative_local_expert_recv_stats: optional int32 [E/R], incremented by the counts.
            dispatch_wait_recv_cost_stats: optional int64 [R], incremented by nanoseconds spent
                waiting for each source rank's data.
            use_fp8: cast to e4m3 with per-128-channel scales; round_scale: scales rounded up to
                powers of two; use_ue8m0: pack the scales' exponents into int32 (needs round_scale).
            async_finish: return an event instead of finishing on the current stream.
            return_recv_hook: only issue the sends; call the returned hook to receive.

        Returns:
            packed_recv_x: [E/R, R*T, H] e4m3 with scales [E/R, R*T, H/128] float32 (or
                [E/R, R*T, H/512] int32 with ue8m0), column-major in the last two dims; or bf16.
            packed_recv_count: [E/R] int32 valid rows per local expert. In shrink mode, ranks this
                rank masks get no rows from it and none of theirs are received (their
                layout_range entries are empty).
            handle: (src_info, layout_range, T, H, E).
            event: the event to wait on when ``async_finish``.
            hook: the receive hook when ``return_recv_hook``, else None.
        """
        recv_stats, wait_stats = cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats
        with torch_functions_off():   # see core/torch_modes.py (inline: a decode call's cost)
            # A decode-time repeat: the replay of this call shape checks the tensors and launches,
            # or returns None and the general path checks everything.
            key = None
            if type(x) is torch.Tensor and type(topk_idx) is torch.Tensor and not async_finish:
                key = (x.shape, topk_idx.shape, num_max_dispatch_tokens_per_rank, num_experts, use_fp8,
                       round_scale, use_ue8m0, return_recv_hook, recv_stats is None, wait_stats is None)
                replay = self._low_latency_replays.get(key)
                if replay is not None:
                    result = replay(x, topk_idx, recv_stats, wait_stats)
                    if result is not None:
                        return result
            request = LowLatencyDispatchRequest(
                x=x, topk_idx=topk_idx, num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
                num_experts=num_experts, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
                cumulative_local_expert_recv_stats=recv_stats, dispatch_wait_recv_cost_stats=wait_stats,
                return_recv_hook=return_recv_hook)
            return self._general_low_latency_dispatch(request, async_finish, key)

    def _general_low_latency_dispatch(self, request: LowLatencyDispatchRequest, async_finish: bool,
                                      key: tuple | None) -> tuple:
        """low_latency_dispatch with every check, torch functions already disabled. ``key``: the
        call's replay key (None: not replayable)."""
        self._check_alive()
        x, topk_idx = request.x, request.topk_idx
        recv_stats, wait_stats = request.cumulative_local_expert_recv_stats, request.dispatch_wait_recv_cost_stats
        T, num_experts, R, on_gpu = request.num_max_dispatch_tokens_per_rank, request.num_experts, self.group_size, \
            self._on_gpu
        # Decode calls repeat one set of options: once those passed the full checks, a call only
        # checks its tensors (a few attribute reads; see checks.fits).
        options = (T, num_experts, request.use_fp8, request.round_scale, request.use_ue8m0, async_finish,
                   request.return_recv_hook, x.shape if isinstance(x, torch.Tensor) else None,
                   topk_idx.shape if isinstance(topk_idx, torch.Tensor) else None)
        if not (options in self._low_latency_options_checked
                and checks.fits(x, torch.bfloat16, options[7], on_gpu)
                and checks.fits(topk_idx, torch.int64, options[8], on_gpu)
                and (recv_stats is None or checks.fits(recv_stats, torch.int32, (num_experts // R,), on_gpu))
                and (wait_stats is None or checks.fits(wait_stats, torch.int64, (R,), on_gpu))):
            v1_checks.check_low_latency_dispatch(request, self.low_latency_mode, async_finish, R, self.device)
            self._check_low_latency_size(T, x.shape[1], num_experts)
            self._low_latency_options_checked.add(options)
        checks.check_expert_ids("topk_idx", topk_idx, num_experts)   # values: every call (free on the GPU)
        stream = self.backend.low_latency_stream(async_finish)
        if stream is None:   # the caller's stream: nothing to order, no event (decode-time host cost)
            replay = self._low_latency_replays.get(key) if key is not None else None
            result = self.backend.low_latency_dispatch(request, replay)
            if key is not None:
                self._low_latency_replays.learn(key, result.replay)
            return result.packed_recv_x, result.packed_recv_count, result.handle, NO_EVENT, plain_hook(result.hook)
        with on_comm_stream(stream, None, async_finish, (x, topk_idx)) as scope:
            result = self.backend.low_latency_dispatch(request)
            scope.keep(result.packed_recv_x, result.packed_recv_count)
        return result.packed_recv_x, result.packed_recv_count, result.handle, scope.event, plain_hook(result.hook)

    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: LowLatencyHandle,
        use_logfmt: bool = False,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: torch.Tensor | None = None,
        combine_wait_recv_cost_stats: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, EventOverlap, Callable[[], None] | None]:
        """Send expert outputs back and sum them, weighted, per token.

        Arguments:
            x: bf16 [E/R, R*T, H], expert outputs at the rows low_latency_dispatch filled.
            topk_idx: [N, K] int64, the same ids given to that dispatch.
            topk_weights: [N, K] float32.
            handle: the handle of that dispatch.
            use_logfmt: accepted for compatibility; rows travel as bf16.
            zero_copy: x was written into ``get_next_low_latency_combine_buffer(handle)``.
            async_finish, return_recv_hook: as in low_latency_dispatch.
            out: optional bf16 [N, H] to write the result into.
            combine_wait_recv_cost_stats: optional int64 [R], incremented by nanoseconds spent
                waiting for each rank's expert outputs.

        Returns:
            combined_x: bf16 [N, H], out[t] = sum_k topk_weights[t, k] * y_{topk_idx[t, k]}(t).
                In shrink mode, experts on ranks masked now or at the handle's dispatch count as 0.
                ``out`` when given; otherwise memory of this Buffer that the combine after next
                reuses (at most two low-latency results are alive at once, as with dispatch's
                outputs): pass ``out`` to keep a result longer.
            event, hook: as in low_latency_dispatch.
        """
        with torch_functions_off():   # as in low_latency_dispatch
            request = LowLatencyCombineRequest(x, topk_idx, topk_weights, handle, zero_copy, return_recv_hook, out,
                                               combine_wait_recv_cost_stats)
            key = None
            if (type(handle) is LowLatencyHandle and type(x) is torch.Tensor  # noqa: E721
                    and type(topk_idx) is torch.Tensor and not async_finish):
                key = (handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts, topk_idx.shape,
                       zero_copy, return_recv_hook, combine_wait_recv_cost_stats is None)
                replay = self._low_latency_replays.get(key)
                if replay is not None:
                    result = replay(x, topk_idx, topk_weights, handle, out, combine_wait_recv_cost_stats)
                    if result is not None:
                        return result
            return self._general_low_latency_combine(request, async_finish, key)

    def _general_low_latency_combine(self, request: LowLatencyCombineRequest, async_finish: bool,
                                     key: tuple | None) -> tuple[torch.Tensor, EventOverlap,
                                                                 Callable[[], None] | None]:
        """low_latency_combine with every check, torch functions already disabled."""
        self._check_alive()
        if not v1_checks.low_latency_combine_fits(request, async_finish, self.buffer_id, self.group_size,
                                                  self._on_gpu):
            v1_checks.check_low_latency_combine(request, self.low_latency_mode, async_finish, self.group_size,
                                                self.buffer_id, self.device)
        checks.check_expert_ids("topk_idx", request.topk_idx, request.handle.num_experts)   # every call
        stream = self.backend.low_latency_stream(async_finish)
        if stream is None:
            replay = self._low_latency_replays.get(key) if key is not None else None
            result = self.backend.low_latency_combine(request, replay)
            if key is not None:
                self._low_latency_replays.learn(key, result.replay)
            return result.combined_x, NO_EVENT, plain_hook(result.hook)
        with on_comm_stream(stream, None, async_finish, (request.x, request.topk_idx, request.topk_weights)) as scope:
            result = self.backend.low_latency_combine(request)
            scope.keep(result.combined_x)
        return result.combined_x, scope.event, plain_hook(result.hook)

    @without_torch_function
    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """A writable bf16 [E/R, R*T, H] view that ``low_latency_combine(zero_copy=True)`` sends from."""
        self._check_alive()
        require(self.low_latency_mode, "get_next_low_latency_combine_buffer needs low_latency_mode=True")
        v1_checks.check_handle(handle, LowLatencyHandle, self.buffer_id)
        return self.backend.get_next_low_latency_combine_buffer(handle)

    @without_torch_function
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Reset the low-latency area after its memory was used by normal mode. Collective over
        the ranks this rank does not mask (shrink mode)."""
        self._check_alive()
        require(self.low_latency_mode, "clean_low_latency_buffer needs low_latency_mode=True")
        self._check_low_latency_size(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        self.backend.clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    # ------------------------------------------------------------------ shrink mode (rank masks)
    @without_torch_function
    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask or unmask one rank for this rank's low-latency calls (shrink mode).

        A rank this rank masks is neither sent to nor waited for by low_latency_dispatch,
        low_latency_combine and clean_low_latency_buffer: its experts get none of this rank's
        tokens, its rows are not received, and its experts' outputs count as zero in the
        combine. A combine skips the ranks masked when it runs and those masked at its handle's
        dispatch. Masks are local: each rank decides whom it masks (mask a rank on every rank that
        still talks to it, or that rank waits for this one and times out). The update is
        queued on the current stream (no host synchronisation; CUDA-graph capturable).

        Arguments:
            rank_to_mask: the rank in [0, R) to mask or unmask.
            mask: True to mask the rank, False to unmask it.
        """
        rank_mask = self._shrink_mask("low_latency_update_mask_buffer")
        require(isinstance(rank_to_mask, int) and not isinstance(rank_to_mask, bool)
                and 0 <= rank_to_mask < self.group_size,
                f"rank_to_mask must be an int in [0, {self.group_size}), got {rank_to_mask!r}")
        require(isinstance(mask, int), f"mask must be a bool, got {type(mask).__name__}")
        # fill_ passes the value as a kernel argument; an indexed assignment would copy a host
        # scalar to the device, which CUDA-graph capture refuses.
        rank_mask.narrow(0, rank_to_mask, 1).fill_(1 if mask else 0)

    @without_torch_function
    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Copy this rank's masks into ``mask_status`` (shrink mode), in stream order.

        Arguments:
            mask_status: int32 [R] on this Buffer's device; entry r becomes 1 if this rank
                masks rank r, else 0.
        """
        rank_mask = self._shrink_mask("low_latency_query_mask_buffer")
        checks.check_tensor("mask_status", mask_status, dtype=torch.int32, shape=(self.group_size,),
                            device=self.device, contiguous=False)
        mask_status.copy_(rank_mask)

    @without_torch_function
    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank (shrink mode), in stream order."""
        rank_mask = self._shrink_mask("low_latency_clean_mask_buffer")
        rank_mask.zero_()

    # ------------------------------------------------------------------ internals
    def _plain_num_sms(self, handle: object, config: object, previous_event: object, async_finish: object,
                       allocate_on_comm_stream: object) -> int | None:
        """What dispatch's and combine's replays ask first (one attribute read each): the call's
        num_sms when it has this live Buffer's handle, a Config or None, and no stream options;
        else None (the general path checks and raises)."""
        if (type(handle) is DispatchHandle and handle.buffer_id == self.buffer_id and not self._destroyed
                and previous_event is None and not async_finish and not allocate_on_comm_stream):
            if config is None:
                return Buffer.num_sms
            if type(config) is Config:
                return config.num_sms
        return None

    def _check_alive(self) -> None:
        require(not self._destroyed, "this Buffer was destroyed")

    def _shrink_mask(self, method: str) -> torch.Tensor:
        """The backend's int32 [R] rank mask, after checking that this Buffer is in shrink mode."""
        self._check_alive()
        require(self.low_latency_mode and self.enable_shrink,
                f"{method} needs a Buffer made with low_latency_mode=True and enable_shrink=True (shrink mode), "
                f"this one has low_latency_mode={self.low_latency_mode}, enable_shrink={self.enable_shrink}")
        assert self.backend.rank_mask is not None
        return self.backend.rank_mask

    def _check_low_latency_size(self, T: int, hidden: int, num_experts: int) -> None:
        if (T, hidden, num_experts) in self._low_latency_sizes_checked:
            return
        needed = low_latency_buffer_bytes(T, hidden, self.group_size, num_experts)
        require(self.num_rdma_bytes >= needed,
                f"low-latency mode with T={T}, hidden={hidden}, num_experts={num_experts} needs "
                f"num_rdma_bytes >= {needed} (Buffer.get_low_latency_rdma_size_hint), this Buffer has "
                f"{self.num_rdma_bytes}")
        self._low_latency_sizes_checked.add((T, hidden, num_experts))
