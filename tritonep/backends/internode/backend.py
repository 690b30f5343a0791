"""The internode backend: groups that span nodes, normal mode.

One heap of ``num_rdma_bytes`` per rank (``memory.TransportHeap``); rows cross nodes through
the transport (NVSHMEM, or plain stores where NVSHMEM cannot run) and move inside a node over
the node's own pointers (``engine.py``). Low-latency mode across nodes is not built: a Buffer
with ``low_latency_mode=True`` on such a group is refused by ``backends/choice.py``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tritonep.backends import base
from tritonep.backends.internode.engine import InternodeNormal
from tritonep.backends.internode.memory import TransportHeap, choose_transport
from tritonep.core import topology
from tritonep.core.checks import InputError
from tritonep.core.handles import LowLatencyHandle
from tritonep.core.replay import Replay
from tritonep.core.routing import dispatch_layout
from tritonep.runtime.platform import INTERPRET

_LOW_LATENCY = "the internode backend has no low-latency mode yet (docs/INTERNODE.md)"


class InternodeBackend(base.Backend):
    def __init__(self, group: dist.ProcessGroup, buffer_id: int, num_nvl_bytes: int, num_rdma_bytes: int) -> None:
        super().__init__(group, buffer_id)
        self._device = torch.device("cpu") if INTERPRET else torch.device("cuda", torch.cuda.current_device())
        self.ranks_per_node = topology.ranks_per_node(self.num_ranks)
        self.heap = TransportHeap(group, num_rdma_bytes, self.ranks_per_node, self._device, choose_transport())
        self.normal = InternodeNormal(self.heap, self.rank, self.num_ranks, self.ranks_per_node, buffer_id,
                                      self._device)
        self._nvl_area = torch.empty(num_nvl_bytes, dtype=torch.uint8, device=self._device)

    @property
    def device(self) -> torch.device:
        return self._device

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return dispatch_layout(topk_idx, num_experts, self.num_ranks)

    def dispatch(self, request: base.DispatchRequest) -> base.DispatchResult:
        return self.normal.dispatch(request)

    def combine(self, request: base.CombineRequest) -> base.CombineResult:
        return self.normal.combine(request)

    def low_latency_dispatch(self, request: base.LowLatencyDispatchRequest,
                             replay: Replay | None = None) -> base.LowLatencyDispatchResult:
        raise InputError(_LOW_LATENCY)

    def low_latency_combine(self, request: base.LowLatencyCombineRequest,
                            replay: Replay | None = None) -> base.LowLatencyCombineResult:
        raise InputError(_LOW_LATENCY)

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        raise InputError(_LOW_LATENCY)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        raise InputError(_LOW_LATENCY)

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: torch.Size | None, offset: int,
                                use_rdma_buffer: bool) -> torch.Tensor:
        data = (self.heap.local if use_rdma_buffer else self._nvl_area)[offset:]
        view = data[: data.numel() // dtype.itemsize * dtype.itemsize].view(dtype)
        return view if size is None else view[: torch.Size(size).numel()].view(size)

    def destroy(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        dist.barrier(group=self.group)
        self.heap.release()
        self.heap.give_back()
