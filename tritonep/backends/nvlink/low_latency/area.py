"""The low-latency mode's symmetric allocation (``num_rdma_bytes``) and where each call shape's regions lie in it.

``regions.py`` says where things are, in plain numbers; this holds the memory: the symmetric
buffer every rank maps, its control block (zeroed once here, then only by the clean kernel),
the regions of each (T, hidden, E) a call has used, checked against the allocation's size, and
the two zero-copy send buffers that ``get_next_low_latency_combine_buffer`` returns in turn.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tritonep.backends.nvlink.low_latency.regions import CONTROL_BYTES, MAX_EXPERTS, MAX_RANKS, LowLatencyRegions
from tritonep.backends.nvlink.memory import SymmetricBuffer
from tritonep.core.checks import InputError
from tritonep.runtime.platform import INTERPRET


class LowLatencyArea:
    """``offset``: where the area starts in the symmetric buffer (the kernels' ``area``);
    ``my_area``: its device address on this rank (``peer_base_ptrs[rank] + offset``).

    ``memory``: a symmetric allocation made by someone else (the internode backend's heap), with
    ``local``, ``data_offset``, ``data_bytes`` and ``release()`` as ``SymmetricBuffer`` has them;
    None allocates a ``SymmetricBuffer`` of ``num_rdma_bytes``.

    ``peer_table`` (int64, the kernels' ``peer_base_ptrs``): the address of every rank's
    allocation as mapped here, which the kernels' stores go through (``memory.peer_base_ptrs``
    when None); for kernels compiled with ``NVSHMEM`` (``device/nvshmem.py``) 0 where a rank is
    reached by NVSHMEM instead, followed by every rank's PE (2R entries)."""

    def __init__(self, group: dist.ProcessGroup, num_rdma_bytes: int, device: torch.device,
                 memory: SymmetricBuffer | None = None, peer_table: torch.Tensor | None = None) -> None:
        self.num_ranks = group.size()
        self.memory = memory if memory is not None else \
            SymmetricBuffer(group, num_rdma_bytes, device, interpret=INTERPRET)
        self.peer_base_ptrs = peer_table if peer_table is not None else self.memory.peer_base_ptrs
        self.offset = self.memory.data_offset
        self.my_area = self.memory.local.data_ptr() + self.offset
        self.memory.local[self.offset: self.offset + CONTROL_BYTES].zero_()
        self._regions: dict[tuple[int, int, int], LowLatencyRegions] = {}

    def regions(self, num_max_tokens: int, hidden: int, num_experts: int) -> LowLatencyRegions:
        """The regions of calls of this shape; raises if the allocation cannot hold them."""
        key = (num_max_tokens, hidden, num_experts)
        cached = self._regions.get(key)
        if cached is not None:
            return cached
        if num_experts > MAX_EXPERTS or self.num_ranks > MAX_RANKS:
            raise InputError(f"the NVLink low-latency mode supports up to {MAX_EXPERTS} experts and {MAX_RANKS} "
                             f"ranks, got {num_experts} experts on {self.num_ranks} ranks")
        regions = LowLatencyRegions(num_max_tokens, hidden, self.num_ranks, num_experts)
        if regions.total_bytes > self.memory.data_bytes:
            raise InputError(f"low-latency calls with T={num_max_tokens}, hidden={hidden}, num_experts={num_experts} "
                             f"need num_rdma_bytes >= {regions.total_bytes} (get_low_latency_rdma_size_hint)")
        self._regions[key] = regions
        return regions

    def _zero_copy_starts(self, num_max_tokens: int, hidden: int, num_experts: int) -> tuple[int, int, int]:
        """(byte offset in the local memory of each of the two zero-copy buffers, their bytes)."""
        regions = self.regions(num_max_tokens, hidden, num_experts)
        start = self.offset + regions.zero_copy_offset
        return start, start + regions.zero_copy_bytes, regions.zero_copy_bytes

    def zero_copy_addresses(self, num_max_tokens: int, hidden: int, num_experts: int) -> tuple[int, int]:
        """Device addresses of the two zero-copy buffers."""
        first, second, _ = self._zero_copy_starts(num_max_tokens, hidden, num_experts)
        base = self.memory.local.data_ptr()
        return base + first, base + second

    def zero_copy_buffer(self, index: int, num_max_tokens: int, hidden: int, num_experts: int) -> torch.Tensor:
        """Zero-copy buffer ``index`` (0 or 1) as bf16 [E/R, R*T, H]."""
        *starts, size = self._zero_copy_starts(num_max_tokens, hidden, num_experts)
        start = starts[index]
        view = self.memory.local[start: start + size].view(torch.bfloat16)
        return view.view(num_experts // self.num_ranks, self.num_ranks * num_max_tokens, hidden)

    def local_bytes(self) -> torch.Tensor:
        """This rank's part of the area (``get_local_buffer_tensor(use_rdma_buffer=True)``)."""
        return self.memory.local[self.offset:]

    def release(self) -> None:
        self.memory.release()
