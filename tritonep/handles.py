"""Handles returned by dispatch and passed back to combine (or to a cached dispatch).

Users treat them as opaque, except that element 0 of a normal-mode handle is the
``rank_prefix_matrix`` and a low-latency handle unpacks as
``(src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts)``,
both as in DeepEP. Each handle remembers the ``Buffer`` that made it, so that passing it to
another buffer raises instead of reading the wrong memory.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


class DispatchHandle(NamedTuple):
    # [R, R] int32: [i, j] = rows rank j receives from ranks 0..i (cumulative over sources).
    rank_prefix_matrix: torch.Tensor
    # [N, R] bool on the sending rank: token t was sent to rank r.
    is_token_in_rank: torch.Tensor
    # [rows] int32: index, in its source rank's batch, of each received row (-1 on padding rows).
    recv_src_idx: torch.Tensor
    # Rows of recv_x: the received count, or num_worst_tokens when the caller padded.
    num_recv_rows: int
    hidden: int
    buffer_id: int
    # Whatever the transport cached for the cached dispatch and the combine (send positions ...).
    backend_state: Any = None


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
