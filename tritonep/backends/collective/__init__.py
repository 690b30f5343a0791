"""The collective backend: DeepEP's Buffer on plain ``torch.distributed`` collectives.

It is the CPU backend (gloo), the reference the GPU backends are tested against, and, forced
with ``TRITONEP_BACKEND=collective`` on NCCL, the "all_to_all_single" baseline of the
benchmark. ``normal.py`` holds dispatch/combine, ``low_latency.py`` the decode path; this
class only adds the memory DeepEP exposes (``get_local_buffer_tensor``, the double-buffered
low-latency combine area) and routes calls.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tritonep.backends import base
from tritonep.backends.collective import low_latency, normal
from tritonep.core import expert_layout, topology
from tritonep.core.checks import require
from tritonep.core.expert_layout import ExpertLayout, ExpertLayoutRequest
from tritonep.core.handles import LowLatencyHandle
from tritonep.core.replay import Replay

__all__ = ["CollectiveBackend"]


class CollectiveBackend(base.Backend):
    """Arguments:
        group: the expert-parallel process group (gloo with CPU tensors, or NCCL with CUDA ones).
        buffer_id: the owning Buffer's id, stamped into every handle.
        num_nvl_bytes, num_rdma_bytes: sizes of the two byte areas ``get_local_buffer_tensor``
            views; the low-latency combine buffers live in the RDMA area. Both are allocated
            lazily (on first use) because the collectives themselves never need them.
        low_latency_mode: accepted for symmetry; the front end checks it.
    """

    def __init__(self, group: dist.ProcessGroup, buffer_id: int, num_nvl_bytes: int, num_rdma_bytes: int,
                 low_latency_mode: bool) -> None:
        super().__init__(group, buffer_id)
        if dist.get_backend(group) == "nccl":
            self._device = torch.device("cuda", torch.cuda.current_device())
        else:
            self._device = torch.device("cpu")
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self._memory: dict[bool, torch.Tensor] = {}
        # Which of the two low-latency combine buffers the next combine sends from.
        self._combine_buffer_index = 0
        # A group that spans nodes gets DeepEP's internode handle (its results are one node's).
        per_node = topology.ranks_per_node(group.size())
        self.ranks_per_node = per_node if per_node < group.size() else None

    @property
    def device(self) -> torch.device:
        return self._device

    # ---- memory --------------------------------------------------------------------------
    def _area(self, use_rdma_buffer: bool) -> torch.Tensor:
        if use_rdma_buffer not in self._memory:
            size = self.num_rdma_bytes if use_rdma_buffer else self.num_nvl_bytes
            self._memory[use_rdma_buffer] = torch.empty(size, dtype=torch.uint8, device=self._device)
        return self._memory[use_rdma_buffer]

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: torch.Size | None, offset: int,
                                use_rdma_buffer: bool) -> torch.Tensor:
        """A view aliasing ``offset..`` of the NVLink (or RDMA) byte area."""
        area = self._area(use_rdma_buffer)
        element = dtype.itemsize
        require(offset % element == 0, f"offset {offset} is not a multiple of the {dtype} element size {element}")
        count = int(torch.Size(size).numel()) if size is not None else (area.numel() - offset) // element
        require(offset + count * element <= area.numel(),
                f"a {count}-element {dtype} view at offset {offset} needs {offset + count * element} bytes; "
                f"the buffer has {area.numel()}")
        view = area[offset:offset + count * element].view(dtype)
        return view.view(size) if size is not None else view

    def destroy(self) -> None:
        self._memory.clear()

    # ---- normal mode ---------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: torch.Tensor,
                            num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return normal.get_dispatch_layout(topk_idx, num_experts, self.num_ranks)

    def dispatch(self, request: base.DispatchRequest) -> base.DispatchResult:
        return normal.dispatch(self.group, self.buffer_id, request, self.ranks_per_node)

    def combine(self, request: base.CombineRequest) -> base.CombineResult:
        combined_x, combined_weights = normal.combine(self.group, request.x, request.handle, request.weights_to_sum(),
                                                      request.bias)
        return base.CombineResult(combined_x, combined_weights)

    def expert_layout(self, request: ExpertLayoutRequest) -> ExpertLayout:
        # Plain torch: the definition the NVLink kernel is tested against.
        return expert_layout.expert_layout(request, self.rank)

    # ---- low-latency mode ----------------------------------------------------------------
    def low_latency_dispatch(self, request: base.LowLatencyDispatchRequest,
                             replay: Replay | None = None) -> base.LowLatencyDispatchResult:
        return low_latency.dispatch(self.group, self.buffer_id, request, self.rank_mask)

    def low_latency_combine(self, request: base.LowLatencyCombineRequest,
                            replay: Replay | None = None) -> base.LowLatencyCombineResult:
        """With ``zero_copy`` the rows are read from the current combine buffer (where the caller
        wrote them via ``get_next_low_latency_combine_buffer``); every combine then flips to the
        other buffer, so two combines in flight never share memory."""
        source = self.get_next_low_latency_combine_buffer(request.handle) if request.zero_copy else request.x
        self._combine_buffer_index ^= 1
        combined_x, hook = low_latency.combine(self.group, source, request.topk_idx, request.topk_weights,
                                               request.handle, request.return_recv_hook, request.out,
                                               request.wait_stats, self.rank_mask)
        return base.LowLatencyCombineResult(combined_x, hook)

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        T, hidden = handle.num_max_dispatch_tokens_per_rank, handle.hidden
        shape = torch.Size((handle.num_experts // self.num_ranks, self.num_ranks * T, hidden))
        buffer_bytes = shape.numel() * 2
        return self.get_local_buffer_tensor(torch.bfloat16, shape, self._combine_buffer_index * buffer_bytes, True)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """Zero the low-latency area. No communication (so no rank, masked or not, is waited
        for): nothing here reads peers' memory."""
        self._area(True).zero_()
