"""``EPHandle``: what a V2 dispatch returns, reused by a cached dispatch and by combine.

Its public fields are DeepEP V2's, holding what V2's hold (``deep_ep/utils/refs.py`` states the
semantics), worked out from the engine's results by the backend (:mod:`tritonep.core.expert_layout`
defines them). Without a CPU sync (``do_cpu_sync=False``) the counts are device tensors and the
sizes are the worst case, as in V2. The engine's own handle and the receive-side routing ride
along privately.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tritonep.core.expert_layout import ExpertLayout
from tritonep.core.handles import DispatchHandle


@dataclass
class HandleState:
    """What the front end keeps beside the public fields (not part of V2's API)."""

    buffer_id: int                    # the ElasticBuffer that made the handle
    engine_handle: DispatchHandle     # the backend's handle: layout of the received rows
    recv_topk_idx: torch.Tensor       # [rows, K] int64: local expert ids of the received rows, -1 elsewhere
    layout: ExpertLayout              # the handle's fields, the expanded layout's slots and sources among them
    rows: int                         # rows of the non-expanded layout (the engine's, padding included)
    hidden: int
    experts_per_rank: int

    @property
    def topk_idx(self) -> torch.Tensor:
        """The EPHandle's topk_idx as made (what combine's replays read)."""
        return self.layout.topk_idx

    @property
    def slots(self) -> torch.Tensor | None:
        """int32 [rows, K]: each (row, k)'s expanded row, -1 for none (expanded only)."""
        return self.layout.slots

    @property
    def expanded_source(self) -> torch.Tensor | None:
        """int32 [expanded rows]: the row each holds, -1 on padding (expanded only)."""
        return self.layout.expanded_source


def _layout_field(name: str) -> property:
    """A read-only EPHandle field that is the handle's ``ExpertLayout.<name>``."""
    return property(lambda handle: getattr(handle._state.layout, name))


class EPHandle:
    """The routing of one V2 dispatch.

    Attributes:
        do_expand: the dispatch used the expanded layout (one row per token and local expert).
        num_experts: all experts, E.
        expert_alignment: each local expert's received count is padded to a multiple of this.
        num_max_tokens_per_rank: T, the bound on any rank's tokens (the same on all ranks).
        num_sms: the num_sms of the dispatch (combine's default).
        topk_idx: [N, K] int64, the dispatch's global expert ids (a copy with ``do_handle_copy``).
        psum_num_recv_tokens_per_scaleup_rank: int32 [num_scaleup_ranks], inclusive prefix sum of
            the tokens received from the ranks of each scale-up index (a token counted once per
            rank); the last entry is the total. With one scale-out rank these are the row
            boundaries of the received blocks, which come by source rank ascending.
        psum_num_recv_tokens_per_expert: int32 [E/R]. Not expanded: the inclusive prefix sum of
            the aligned per-expert counts. Expanded: entry i is expert i's aligned start plus its
            real count, so ``psum[i] - align(psum[i-1])`` is expert i's count and
            ``align(psum[i])`` expert i+1's first row.
        num_recv_tokens_per_expert_list: Python list of the aligned per-expert counts (empty
            without a CPU sync).
        num_unaligned_recv_tokens_per_expert: int32 [E/R], the real per-expert counts.
        recv_src_metadata: int32 [rows, K + 2] per received row: source rank * T + source token
            index, source rank * K + the first slot k whose expert is local, then (expanded
            layout) the expanded row of each slot k, -1 where slot k's expert lives elsewhere;
            -1 throughout on padding rows and, not expanded, in the last K columns.
        dst_buffer_slot_idx: int32 [N, K] per token and slot: the row that holds this token on
            the rank of that slot's expert (-1 where topk_idx is -1).
        token_metadata_at_forward, channel_linked_list: V2's hybrid-mode forwarding records;
            None (the engines here send every row directly to its rank).
        num_recv_tokens: received tokens (rows of a non-expanded recv_x), or R * T without a CPU sync.
        num_expanded_tokens: rows of an expanded recv_x: the aligned counts' sum, or the worst
            case ``align(R * T * min(K, E/R) + (expert_alignment - 1) * E/R)`` without a CPU sync.
    """

    def __init__(self, do_expand: bool, num_experts: int, expert_alignment: int, num_max_tokens_per_rank: int,
                 num_sms: int, num_recv_tokens: int, num_expanded_tokens: int | None,
                 num_recv_tokens_per_expert_list: list[int], state: HandleState) -> None:
        self.do_expand = do_expand
        self.num_experts = num_experts
        self.expert_alignment = expert_alignment
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_sms = num_sms
        # Set only when the caller replaces it; until then the layout's (its copy is viewed when first read).
        self._topk_idx: torch.Tensor | None = None
        self.num_recv_tokens = num_recv_tokens
        self._num_expanded_tokens = num_expanded_tokens   # None: the list's sum, made when first read
        self.num_recv_tokens_per_expert_list = num_recv_tokens_per_expert_list
        self.token_metadata_at_forward: torch.Tensor | None = None
        self.channel_linked_list: torch.Tensor | None = None
        self._state = state

    @property
    def num_expanded_tokens(self) -> int:
        if self._num_expanded_tokens is None:
            self._num_expanded_tokens = sum(self.num_recv_tokens_per_expert_list)
        return self._num_expanded_tokens

    @num_expanded_tokens.setter
    def num_expanded_tokens(self, value: int) -> None:
        self._num_expanded_tokens = value

    @property
    def topk_idx(self) -> torch.Tensor:
        return self._state.layout.topk_idx if self._topk_idx is None else self._topk_idx

    @topk_idx.setter
    def topk_idx(self, value: torch.Tensor) -> None:
        self._topk_idx = value

    # The device fields are views of one block (``ExpertLayout``), made when first read.
    psum_num_recv_tokens_per_scaleup_rank = _layout_field("psum_per_scaleup_rank")
    psum_num_recv_tokens_per_expert = _layout_field("psum_per_expert")
    num_unaligned_recv_tokens_per_expert = _layout_field("counts")
    recv_src_metadata = _layout_field("recv_src_metadata")
    dst_buffer_slot_idx = _layout_field("dst_buffer_slot_idx")

    def __repr__(self) -> str:
        return (f"EPHandle(do_expand={self.do_expand}, num_experts={self.num_experts}, "
                f"expert_alignment={self.expert_alignment}, num_max_tokens_per_rank={self.num_max_tokens_per_rank}, "
                f"num_recv_tokens={self.num_recv_tokens}, num_expanded_tokens={self.num_expanded_tokens})")
