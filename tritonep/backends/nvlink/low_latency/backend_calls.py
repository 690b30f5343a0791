"""The Backend interface's low-latency calls, handed to a ``LowLatencyEngine``.

The NVLink backend runs the engine over its own symmetric allocation and the internode backend
over its heap; both answer the four low-latency calls the same way, so both take them from
this mixin. A backend that uses it has a ``low_latency`` property (its engine, or an
``InputError`` saying why it has none) and the ``rank_mask`` every ``Backend`` holds.
"""

from __future__ import annotations

import torch

from tritonep.backends import base
from tritonep.backends.nvlink.low_latency.engine import LowLatencyEngine
from tritonep.core.handles import LowLatencyHandle
from tritonep.core.replay import Replay


class LowLatencyBackendCalls:
    """Mixed in before ``base.Backend``, so its methods fill the interface's low-latency slots."""

    low_latency: LowLatencyEngine
    rank_mask: torch.Tensor | None

    def low_latency_dispatch(self, request: base.LowLatencyDispatchRequest,
                             replay: Replay | None = None) -> base.LowLatencyDispatchResult:
        return self.low_latency.dispatch(request, self.rank_mask, replay)

    def low_latency_combine(self, request: base.LowLatencyCombineRequest,
                            replay: Replay | None = None) -> base.LowLatencyCombineResult:
        return self.low_latency.combine(request, self.rank_mask, replay)

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        return self.low_latency.get_next_low_latency_combine_buffer(handle)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        # The engine zeroes its control words, which do not depend on the sizes DeepEP's call names.
        self.low_latency.clean(self.rank_mask)
