"""Handles returned by dispatch and passed back to combine (or to a cached dispatch).

Users treat them as opaque, except that a normal-mode handle is placed like DeepEP's
intranode 6-tuple (element 0 ``rank_prefix_matrix``, 3 ``recv_src_idx``, 4
``is_token_in_rank``), or, on a group that spans nodes, like its internode 10-tuple
(``NodeDispatchHandle``), and a low-latency handle unpacks as
``(src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts)``,
both as in DeepEP. Each handle remembers the ``Buffer`` that made it, so that passing it to
another buffer raises instead of reading the wrong memory.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any

import torch

from tritonep.core.replay import ReplayTable


class DispatchHandle(tuple):
    """A 6-tuple placed like DeepEP's intranode handle, ``(rank_prefix_matrix,
    channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank,
    send_head)``, so code that indexes or unpacks it finds the same tensors where DeepEP puts them.
    This transport has no channels and no send heads: those places hold None.

    Attributes (besides the named elements):
        num_recv_rows: rows of recv_x: the received count, or num_worst_tokens when padded.
        hidden: the hidden size of the dispatch.
        buffer_id: the Buffer that made it.
        backend_state: whatever the transport cached for the cached dispatch and the combine.
        replays: the calls made with this handle that repeat cheaply (``core/replay.py``).
    """

    num_recv_rows: int
    hidden: int
    buffer_id: int
    backend_state: Any
    replays: ReplayTable

    def __new__(
        cls,
        rank_prefix_matrix: torch.Tensor,   # [R, R] int32: [i, j] = rows rank j receives from ranks 0..i
        is_token_in_rank: torch.Tensor,     # [N, R] bool on the sending rank
        recv_src_idx: torch.Tensor,         # [rows] int32: index in its source's batch (-1 on padding)
        num_recv_rows: int,
        hidden: int,
        buffer_id: int,
        backend_state: Any = None,
        *,
        elements: tuple | None = None,      # the tuple, where a subclass places the fields otherwise
    ) -> DispatchHandle:
        if elements is None:
            elements = (rank_prefix_matrix, None, None, recv_src_idx, is_token_in_rank, None)
        handle = super().__new__(cls, elements)
        handle.num_recv_rows = num_recv_rows
        handle.hidden = hidden
        handle.buffer_id = buffer_id
        handle.backend_state = backend_state
        handle.replays = ReplayTable()
        return handle

    # The named elements, read as fast as an index (a C getter, no Python frame).
    rank_prefix_matrix = property(itemgetter(0))
    recv_src_idx = property(itemgetter(3))
    is_token_in_rank = property(itemgetter(4))


class NodeDispatchHandle(DispatchHandle):
    """The handle of a group that spans nodes: a 10-tuple placed like DeepEP's internode handle,
    ``(is_token_in_rank, rdma_channel_prefix_matrix, gbl_channel_prefix_matrix,
    recv_rdma_channel_prefix_matrix, recv_rdma_rank_prefix_sum, recv_gbl_channel_prefix_matrix,
    recv_gbl_rank_prefix_sum, recv_src_meta, send_rdma_head, send_nvl_head)``. The received rows
    are ordered by source rank, then token, so the two prefix sums are columns of
    ``rank_prefix_matrix``: rows received from ranks 0..i (element 6, int32 [R]) and from nodes
    0..n (element 4, int32 [nodes]). No channels, source metadata or send heads: None there. The
    fields the library reads are the same attributes as on ``DispatchHandle``."""

    def __new__(cls, rank_prefix_matrix: torch.Tensor, is_token_in_rank: torch.Tensor,
                recv_src_idx: torch.Tensor, num_recv_rows: int, hidden: int, buffer_id: int,
                backend_state: Any = None, *, rank: int, ranks_per_node: int) -> NodeDispatchHandle:
        from_ranks = rank_prefix_matrix[:, rank].contiguous()
        from_nodes = from_ranks[ranks_per_node - 1::ranks_per_node].contiguous()
        handle = super().__new__(cls, rank_prefix_matrix, is_token_in_rank, recv_src_idx, num_recv_rows, hidden,
                                 buffer_id, backend_state, elements=(is_token_in_rank, None, None, None, from_nodes,
                                                                     None, from_ranks, None, None, None))
        handle.node_fields = (rank_prefix_matrix, recv_src_idx)
        return handle

    node_fields: tuple[torch.Tensor, torch.Tensor]   # (rank_prefix_matrix, recv_src_idx)
    rank_prefix_matrix = property(lambda self: self.node_fields[0])
    recv_src_idx = property(lambda self: self.node_fields[1])
    is_token_in_rank = property(itemgetter(0))


class LowLatencyHandle(tuple):
    """``(src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts)``.

    A plain tuple to the user; ``buffer_id`` and ``backend_state`` ride along as attributes.
    """

    buffer_id: int
    backend_state: Any

    def __new__(
        cls,
        src_info: torch.Tensor,
        layout_range: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        hidden: int,
        num_experts: int,
        buffer_id: int,
        backend_state: Any = None,
    ) -> LowLatencyHandle:
        handle = super().__new__(
            cls, (src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts)
        )
        handle.buffer_id = buffer_id
        handle.backend_state = backend_state
        return handle

    src_info = property(itemgetter(0))
    layout_range = property(itemgetter(1))
    num_max_dispatch_tokens_per_rank = property(itemgetter(2))
    hidden = property(itemgetter(3))
    num_experts = property(itemgetter(4))
