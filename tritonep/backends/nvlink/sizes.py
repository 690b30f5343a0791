"""How many bytes the NVLink backend needs: the size hints users call before making a Buffer (both front ends)."""

from __future__ import annotations

from tritonep.backends.nvlink.low_latency.regions import LowLatencyRegions
from tritonep.core.routing import round_up


def low_latency_buffer_bytes(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                             num_experts: int) -> int:
    """Bytes of the low-latency area (``num_rdma_bytes``): control words plus two (double-buffered)
    sets of a dispatch receive area for [E, T] fp8-or-bf16 messages, a combine receive area for
    [T, 11] bf16 rows and a zero-copy combine buffer of [E, T] bf16 rows."""
    regions = LowLatencyRegions(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)
    return round_up(regions.total_bytes, 1 << 20)


def nvl_bytes_for(num_tokens: int, hidden: int, num_ranks: int, num_topk: int = 8) -> int:
    """``num_nvl_bytes`` that lets every rank receive ``num_tokens`` rows from every rank.

    The NVLink backend stages each received row at its final index (no ring buffer), in two
    halves: dispatch rows (bf16 or fp8 with scales, top-k ids and weights, source index) and
    combine rows (bf16 with top-k weights).
    """
    rows = num_tokens * num_ranks
    dispatch_row = hidden * 2 + (hidden // 128) * 4 + 12 * num_topk + 4
    combine_row = hidden * 2 + 4 * num_topk
    return round_up(2 * rows * max(dispatch_row, combine_row) + (1 << 20), 1 << 20)
