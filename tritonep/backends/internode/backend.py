"""The internode backend: groups that span nodes.

One heap of ``num_rdma_bytes`` per rank (``memory.TransportHeap``). Normal mode: rows cross
nodes through the transport (NVSHMEM, or plain stores where NVSHMEM cannot run) and move inside
a node over the node's own pointers (``engine.py``). Low-latency mode (a Buffer made with
``low_latency_mode=True``) runs the NVLink backend's low-latency engine and kernels over the
heap: every (token, expert) row goes straight to the expert's rank, by a store to a rank of
this node (with ``allow_nvlink``, DeepEP's allow_nvlink_for_low_latency_mode) and by an NVSHMEM
put to any other (``device/nvshmem.py``; with plain stores, every rank by a store), with the same
kernels, hooks, replays, CUDA-graph capture and shrink masks as on one node. The heap then
belongs to the low-latency calls, so such a Buffer makes no normal-mode calls.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tritonep.backends import base
from tritonep.backends.internode.engine import InternodeNormal
from tritonep.backends.internode.memory import TRANSPORT_VARIABLE, TransportHeap, choose_transport
from tritonep.backends.internode.transport import STORES
from tritonep.backends.nvlink.low_latency.backend_calls import LowLatencyBackendCalls
from tritonep.backends.nvlink.low_latency.engine import LowLatencyEngine
from tritonep.backends.nvlink.tuning import Tuning
from tritonep.core import expert_layout, topology
from tritonep.core.checks import InputError
from tritonep.core.routing import dispatch_layout
from tritonep.runtime.platform import INTERPRET

_NOT_LOW_LATENCY = ("low-latency calls on the internode backend need a Buffer made with low_latency_mode=True "
                    "(and num_rdma_bytes from Buffer.get_low_latency_rdma_size_hint(...))")
_NOT_NORMAL = ("normal-mode calls on the internode backend need a Buffer made with low_latency_mode=False: in "
               "low-latency mode its num_rdma_bytes heap holds the low-latency calls' slots")


class InternodeBackend(LowLatencyBackendCalls, base.Backend):
    def __init__(self, group: dist.ProcessGroup, buffer_id: int, num_nvl_bytes: int, num_rdma_bytes: int,
                 low_latency_mode: bool = False, allow_nvlink: bool = True) -> None:
        super().__init__(group, buffer_id)
        self._device = torch.device("cpu") if INTERPRET else torch.device("cuda", torch.cuda.current_device())
        self.ranks_per_node = topology.ranks_per_node(self.num_ranks)
        transport = choose_transport()
        if low_latency_mode and not allow_nvlink and transport == STORES.value:   # local, alike on every rank
            raise InputError(f"allow_nvlink_for_low_latency_mode=False: the plain-stores transport "
                             f"({TRANSPORT_VARIABLE}=stores, or ranks sharing GPUs) reaches every peer over NVLink; "
                             f"leave it True, or run on NVSHMEM (one GPU per rank)")
        self.heap = TransportHeap(group, num_rdma_bytes, self.ranks_per_node, self._device, transport)
        self.normal = None if low_latency_mode else InternodeNormal(
            self.heap, self.rank, self.num_ranks, self.ranks_per_node, buffer_id, self._device)
        self._low_latency = LowLatencyEngine(
            group, buffer_id, num_rdma_bytes, self._device, Tuning.from_environment(), memory=self.heap,
            ranks_per_node=self.ranks_per_node, peer_table=self.heap.low_latency_peer_table(allow_nvlink),
            transport=transport) if low_latency_mode else None
        self._nvl_area = torch.empty(num_nvl_bytes, dtype=torch.uint8, device=self._device)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def normal_mode(self) -> InternodeNormal:
        if self.normal is None:
            raise InputError(_NOT_NORMAL)
        return self.normal

    @property
    def low_latency(self) -> LowLatencyEngine:
        if self._low_latency is None:
            raise InputError(_NOT_LOW_LATENCY)
        return self._low_latency

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return dispatch_layout(topk_idx, num_experts, self.num_ranks)

    def dispatch(self, request: base.DispatchRequest) -> base.DispatchResult:
        return self.normal_mode.dispatch(request)

    def combine(self, request: base.CombineRequest) -> base.CombineResult:
        return self.normal_mode.combine(request)

    def expert_layout(self, request: base.ExpertLayoutRequest) -> base.ExpertLayout:
        # The received rows sit as on one node (source rank, then token): the plain-torch
        # definition gives V2's fields from them, on the device, without a host sync.
        return expert_layout.expert_layout(request, self.rank)

    # Low-latency mode: the NVLink backend's engine over this heap (module doc); its calls come
    # from LowLatencyBackendCalls.

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: torch.Size | None, offset: int,
                                use_rdma_buffer: bool) -> torch.Tensor:
        data = (self.heap.local if use_rdma_buffer else self._nvl_area)[offset:]
        view = data[: data.numel() // dtype.itemsize * dtype.itemsize].view(dtype)
        return view if size is None else view[: torch.Size(size).numel()].view(size)

    def destroy(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        dist.barrier(group=self.group)
        if self._low_latency is not None:
            self._low_latency.release()   # its outputs, and the heap
        self.heap.release()
        self.heap.give_back()
