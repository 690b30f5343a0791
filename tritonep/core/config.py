"""Performance knobs for normal-mode dispatch and combine (DeepEP's ``Config``).

The fields keep DeepEP's names so that code tuned for DeepEP passes them unchanged.
Backends read only what means something to them: the NVLink backend uses ``num_sms``
(programs per launch) and ``num_max_nvl_chunked_send_tokens`` (rows between progress
signals); the CPU backend uses none of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from tritonep.core.routing import round_up


@dataclass
class Config:
    num_sms: int = 20
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256

    def __post_init__(self) -> None:
        if self.num_sms <= 0:
            raise ValueError(f"Config.num_sms must be positive, got {self.num_sms}")

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of NVLink buffer needed for a dispatch of ``hidden_bytes`` per token.

        Our NVLink transport stages every received row (no ring buffer), in two halves (dispatch
        rows, combine rows), so the hint covers ``num_max_nvl_chunked_recv_tokens`` rows from
        each rank in each half, plus per-row metadata (scales, top-k, source index). Callers
        with more tokens per call should size ``num_nvl_bytes`` with
        :func:`tritonep.nvl_bytes_for`; a call that does not fit raises and says so.
        """
        rows = self.num_max_nvl_chunked_recv_tokens * num_ranks
        return round_up(2 * rows * (hidden_bytes + 512) + (1 << 20), 128)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Internode (RDMA) buffer hint; zero until the internode backend exists."""
        return 0
