"""The small interface every transport implements.

``Buffer`` (the front end) validates all inputs, handles streams and events, and then calls
exactly one of these methods. A backend receives well-formed tensors on its own device and
returns plain tensors; it never sees user mistakes, so it can stay short.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tritonep.core.config import Config
from tritonep.core.handles import DispatchHandle, LowLatencyHandle


@dataclass
class DispatchRequest:
    x: torch.Tensor                       # [N, H] bf16, or fp8 e4m3 when x_scales is given
    x_scales: torch.Tensor | None         # [N, H/128] float32 or [N, H/512] int32, any strides
    topk_idx: torch.Tensor | None         # [N, K] int64 global expert ids, -1 = none
    topk_weights: torch.Tensor | None     # [N, K] float32
    is_token_in_rank: torch.Tensor        # [N, R] bool
    num_tokens_per_rank: torch.Tensor | None  # [R] int32 (None in cached mode)
    num_tokens_per_expert: torch.Tensor | None  # [E] int32 (None in cached mode)
    num_experts: int                      # E (0 in cached mode)
    expert_alignment: int
    num_worst_tokens: int
    cached_handle: DispatchHandle | None  # a handle from an earlier dispatch: reuse its layout
    config: Config


@dataclass
class DispatchResult:
    recv_x: torch.Tensor
    recv_x_scales: torch.Tensor | None
    recv_topk_idx: torch.Tensor | None
    recv_topk_weights: torch.Tensor | None
    num_recv_tokens_per_expert_list: list[int] | None
    handle: DispatchHandle


@dataclass
class LowLatencyDispatchRequest:
    x: torch.Tensor                       # [N, H] bf16, N <= T
    topk_idx: torch.Tensor                # [N, K] int64
    num_max_dispatch_tokens_per_rank: int  # T
    num_experts: int
    use_fp8: bool
    round_scale: bool
    use_ue8m0: bool
    cumulative_local_expert_recv_stats: torch.Tensor | None
    dispatch_wait_recv_cost_stats: torch.Tensor | None
    return_recv_hook: bool
    # The Buffer's key for this call shape in low_latency_fast_paths()[0] (None: not repeatable).
    fast_key: tuple | None = None


@dataclass
class LowLatencyDispatchResult:
    packed_recv_x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    packed_recv_count: torch.Tensor
    handle: LowLatencyHandle
    # With return_recv_hook the receive is finished by calling this; otherwise None.
    hook: Callable[[], None] | None


class Backend(abc.ABC):
    """A transport for one process group. Created collectively by ``Buffer.__init__``."""

    def __init__(self, group: dist.ProcessGroup, buffer_id: int) -> None:
        self.group = group
        self.rank = group.rank()
        self.num_ranks = group.size()
        self.buffer_id = buffer_id
        # Shrink mode (``Buffer(enable_shrink=True)``): int32 [R] on ``device``, 1 where this rank
        # masks that rank, i.e. skips it in low_latency_dispatch, low_latency_combine and
        # clean_low_latency_buffer. The front end allocates it once and writes it in stream order;
        # backends only read it. None without shrink mode (nothing is masked).
        self.rank_mask: torch.Tensor | None = None

    # ---- properties the front end needs -------------------------------------------------
    @property
    @abc.abstractmethod
    def device(self) -> torch.device:
        """Where input and output tensors live."""

    def comm_stream(self) -> torch.cuda.Stream | None:
        """The stream communication runs on, or None when calls are synchronous (CPU)."""
        return None

    def low_latency_stream(self, async_finish: bool) -> torch.cuda.Stream | None:
        """The stream low-latency calls run on (None: the caller's stream)."""
        return self.comm_stream()

    # ---- normal mode ---------------------------------------------------------------------
    @abc.abstractmethod
    def get_dispatch_layout(
        self, topk_idx: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32,
        is_token_in_rank [N, R] bool)."""

    @abc.abstractmethod
    def dispatch(self, request: DispatchRequest) -> DispatchResult:
        ...

    def repeat_cached_dispatch(self, x: torch.Tensor, scales: torch.Tensor | None, handle: DispatchHandle,
                               num_sms: int) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
        """A cached dispatch (``handle``, default options) that repeats one the backend learnt:
        its recv_x (or (recv_x, recv_scales)), launched; or None, and the caller takes the
        general path. ``x``/``scales`` are tensors, nothing else is checked yet. Default: never."""
        return None

    def repeat_combine(self, x: torch.Tensor, topk_weights: torch.Tensor | None, handle: DispatchHandle,
                       num_sms: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """A combine (no bias, default stream options) that repeats one the backend learnt:
        (combined_x, combined_topk_weights), launched; or None, and the caller takes the general
        path. ``x``/``topk_weights`` are tensors (or None), nothing else is checked yet.
        Default: never."""
        return None

    @abc.abstractmethod
    def combine(
        self,
        x: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: torch.Tensor | None,
        bias: tuple[torch.Tensor | None, torch.Tensor | None],
        config: Config,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns (combined_x [N, H] bf16, combined_topk_weights [N, K] float32 or None)."""

    # ---- low-latency mode ----------------------------------------------------------------
    @abc.abstractmethod
    def low_latency_dispatch(self, request: LowLatencyDispatchRequest) -> LowLatencyDispatchResult:
        ...

    @abc.abstractmethod
    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: LowLatencyHandle,
        zero_copy: bool,
        return_recv_hook: bool,
        out: torch.Tensor | None,
        wait_stats: torch.Tensor | None,
        fast_key: tuple | None = None,
    ) -> tuple[torch.Tensor, Callable[[], None] | None]:
        """``wait_stats``: optional int64 [R], ``combine_wait_recv_cost_stats``; ``fast_key``: the
        Buffer's key for this call shape in low_latency_fast_paths()[1]."""

    def low_latency_fast_paths(self) -> tuple[dict, dict]:
        """(dispatch, combine): call shapes this backend repeats with little host work, by the
        Buffer's keys; each value takes a call's tensors and returns the call's result, or None
        (then the Buffer takes the general path). Filled by the backend as calls run; the Buffer
        reads them, never writes. Empty dicts: every call takes the general path."""
        return {}, {}

    @abc.abstractmethod
    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        ...

    @abc.abstractmethod
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """Collective over the ranks that ``rank_mask`` does not mask."""

    # ---- raw memory ----------------------------------------------------------------------
    @abc.abstractmethod
    def get_local_buffer_tensor(self, dtype: torch.dtype, size: torch.Size | None, offset: int,
                                use_rdma_buffer: bool) -> torch.Tensor:
        ...

    @abc.abstractmethod
    def destroy(self) -> None:
        """Release the transport's memory. Collective."""
