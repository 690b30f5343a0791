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
from tritonep.core.expert_layout import ExpertLayout, ExpertLayoutRequest, HandleFieldsRequest
from tritonep.core.handles import DispatchHandle, LowLatencyHandle
from tritonep.core.replay import Replay


@dataclass
class DispatchRequest:
    x: torch.Tensor                       # [N, H] bf16, or fp8 e4m3 when x_scales is given
    x_scales: torch.Tensor | None         # [N, H/128] float32 or [N, H/512] int32, any strides
    topk_idx: torch.Tensor | None         # [N, K] int64 global expert ids, -1 = none
    topk_weights: torch.Tensor | None     # [N, K] float32
    # [N, R] bool. None in a fresh request only to a backend whose ``layout_in_dispatch`` is True:
    # it works out get_dispatch_layout's results from topk_idx itself (as do the two below).
    is_token_in_rank: torch.Tensor | None
    num_tokens_per_rank: torch.Tensor | None  # [R] int32 (None in cached mode)
    num_tokens_per_expert: torch.Tensor | None  # [E] int32 (None in cached mode)
    num_experts: int                      # E (0 in cached mode)
    expert_alignment: int
    num_worst_tokens: int
    cached_handle: DispatchHandle | None  # a handle from an earlier dispatch: reuse its layout
    config: Config
    # V2's T (0: not given, as from V1): every rank sends at most T tokens and the backends
    # compare T across ranks like the hidden size, so num_worst_tokens = R * T always suffices.
    num_max_tokens_per_rank: int = 0
    # With num_worst_tokens, False: the caller has ``expert_layout`` queued next on the same
    # stream (V2's fresh dispatch), so a backend whose expert layout writes the padding rows' empty
    # values (source -1, expert -1, weight 0) may leave them unwritten: that launch instead of
    # three fills.
    pad_outputs: bool = True
    # V2's handle fields (not expanded): a backend that can writes them in the dispatch itself and
    # returns them as ``DispatchResult.layout``; None: not asked.
    handle_fields: HandleFieldsRequest | None = None

    def padding_is_guaranteed(self, num_ranks: int) -> bool:
        """Whether num_worst_tokens holds every row that can arrive, so that no later call needs
        to check the received counts: R * T rows when every rank passes the same T (a rank whose
        T differs makes the count exchange report the disagreement instead)."""
        T = self.num_max_tokens_per_rank
        return T > 0 and self.num_worst_tokens >= num_ranks * T


@dataclass
class DispatchResult:
    recv_x: torch.Tensor
    recv_x_scales: torch.Tensor | None
    recv_topk_idx: torch.Tensor | None
    recv_topk_weights: torch.Tensor | None
    num_recv_tokens_per_expert_list: list[int] | None
    handle: DispatchHandle
    # A cached dispatch's replay: called as replay(x, x_scales), it returns recv_x (or
    # (recv_x, recv_x_scales)) or None. None: this call cannot be replayed.
    replay: Replay | None = None
    # V2's handle fields when ``DispatchRequest.handle_fields`` asked and the backend wrote them.
    layout: ExpertLayout | None = None


@dataclass
class OwnSlots:
    """V2's combined weights: slot k of a token takes its weight only from the rank of k's expert
    (V1's: the sum over every rank the token went to). Said for either end of the combine, so
    that a backend can apply it where its weights already pass: at the token's rank, or at the
    expert ranks before the weights leave."""

    topk_idx: torch.Tensor                # [N, K] int64, the dispatch's global expert ids (-1: none)
    experts_per_rank: int                 # E/R: slot k's rank is topk_idx[t, k] // experts_per_rank
    recv_topk_idx: torch.Tensor           # [M, K] int64 per received row: local expert ids, -1 for other ranks'

    def masked(self, topk_weights: torch.Tensor) -> torch.Tensor:
        """The received rows' weights with every other rank's slot zeroed (a new tensor)."""
        return topk_weights.masked_fill(self.recv_topk_idx < 0, 0.0)


@dataclass
class CombineRequest:
    x: torch.Tensor                       # [M, H] bf16, M = handle.num_recv_rows
    handle: DispatchHandle
    topk_weights: torch.Tensor | None     # [M, K] float32
    bias: tuple[torch.Tensor | None, torch.Tensor | None]   # each [N, H] bf16 or None
    config: Config
    own_slots: OwnSlots | None = None     # with topk_weights: V2's combined weights (None: V1's sum)

    def weights_to_sum(self) -> torch.Tensor | None:
        """The top-k weights for a backend that sums every rank's copy of a token's weights:
        with ``own_slots``, every other rank's slots zeroed first (``OwnSlots.masked``)."""
        if self.topk_weights is None or self.own_slots is None:
            return self.topk_weights
        return self.own_slots.masked(self.topk_weights)


@dataclass
class CombineResult:
    combined_x: torch.Tensor              # [N, H] bf16
    combined_topk_weights: torch.Tensor | None   # [N, K] float32
    # Called as replay(x, topk_weights) for a combine of the same handle without bias: returns
    # (combined_x, combined_topk_weights) or None. None: this call cannot be replayed. With
    # weights it applies the request's own_slots as learnt (the same topk_idx, read again).
    replay: Replay | None = None


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


@dataclass
class LowLatencyDispatchResult:
    packed_recv_x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    packed_recv_count: torch.Tensor
    handle: LowLatencyHandle
    # With return_recv_hook the receive is finished by calling this; otherwise None.
    hook: Callable[[], None] | None
    # Called as replay(x, topk_idx, recv_stats, wait_stats) for a call of the same shape and
    # options on the caller's stream: returns low_latency_dispatch's 5-tuple or None.
    replay: Replay | None = None


@dataclass
class LowLatencyCombineRequest:
    x: torch.Tensor                       # [E/R, R*T, H] bf16
    topk_idx: torch.Tensor                # [N, K] int64
    topk_weights: torch.Tensor            # [N, K] float32
    handle: LowLatencyHandle
    zero_copy: bool
    return_recv_hook: bool
    out: torch.Tensor | None              # [N, H] bf16
    wait_stats: torch.Tensor | None       # int64 [R], combine_wait_recv_cost_stats


@dataclass
class LowLatencyCombineResult:
    combined_x: torch.Tensor
    hook: Callable[[], None] | None
    # Called as replay(x, topk_idx, topk_weights, handle, out, wait_stats) for a call of the
    # same shape and options on the caller's stream: returns low_latency_combine's 3-tuple or None.
    replay: Replay | None = None


class Backend(abc.ABC):
    """A transport for one process group. Created collectively by ``Buffer.__init__``.

    Calls that may repeat hand back a replay with their result (``core/replay.py``); the
    low-latency calls are also given the replay the front end holds for their shape, which they
    may complete and hand back.
    """

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
    @property
    def layout_in_dispatch(self) -> bool:
        """Whether a fresh ``dispatch`` may come with ``topk_idx`` alone (no ``is_token_in_rank``
        nor counts): a caller with no use for ``get_dispatch_layout``'s tensors then saves its call."""
        return False

    @abc.abstractmethod
    def get_dispatch_layout(
        self, topk_idx: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32,
        is_token_in_rank [N, R] bool)."""

    @abc.abstractmethod
    def dispatch(self, request: DispatchRequest) -> DispatchResult:
        ...

    @abc.abstractmethod
    def combine(self, request: CombineRequest) -> CombineResult:
        ...

    @abc.abstractmethod
    def expert_layout(self, request: ExpertLayoutRequest) -> ExpertLayout:
        """Where the rows of a fresh dispatch (``request.handle``, made by this backend) sit by
        expert, source and destination: DeepEP V2's handle fields, as ``core/expert_layout.py``
        defines them. Queued after the dispatch on the current stream, with no host sync. A
        backend whose dispatch honours ``DispatchRequest.pad_outputs=False`` writes the padding
        rows' empty values of that dispatch's outputs here."""

    # ---- low-latency mode ----------------------------------------------------------------
    @abc.abstractmethod
    def low_latency_dispatch(self, request: LowLatencyDispatchRequest,
                             replay: Replay | None = None) -> LowLatencyDispatchResult:
        ...

    @abc.abstractmethod
    def low_latency_combine(self, request: LowLatencyCombineRequest,
                            replay: Replay | None = None) -> LowLatencyCombineResult:
        ...

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
