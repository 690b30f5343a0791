"""The NVLink backend's shared memory: one symmetric allocation per rank, and where things live in it.

Every rank allocates the same number of bytes; peers reach each other's allocation through
the pointer table ``peer_base_ptrs`` (int64 [R], on the device). The allocation starts with
the signal area (int64 counters that peers write with release stores, then the count-exchange
slots), followed by the data area, split in two halves in normal mode (``StagingLayout``): rows
received by dispatch and rows received by combine. Separate halves let a fast rank start its
combine while a slow peer is still copying dispatch rows out.

On GPUs the allocation comes from torch symmetric memory (CUDA backend, no multicast). Under
``TRITON_INTERPRET=1`` (CPU tests) each rank's allocation is a shared file in /dev/shm that
every rank maps: the same kernels then run on CPU processes, which is how CI covers them.
"""

from __future__ import annotations

import inspect
import os
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tritonep.core.rank_agreement import on_every_rank
from tritonep.core.routing import round_up
from tritonep.rank_pool import SHARED_GPUS_VARIABLE

MAX_CHANNELS = 160            # sender programs per launch (more than a Hopper GPU has SMs)
MAX_LOCAL_EXPERTS = 1024
SIGNATURE_WORDS = 8           # (hidden words, scale words, top-k, experts, invalid ids, T, 0, 0)


@dataclass(frozen=True)
class SignalLayout:
    """Offsets, in int64 words from the allocation's start, of each counter array."""

    num_ranks: int

    @property
    def notify_flag(self) -> int:          # [R]: last count-exchange epoch each source finished
        return 0

    @property
    def dispatch_tail(self) -> int:        # [R, C]: (epoch << 32) | rows written by source s, channel c
        return self.notify_flag + self.num_ranks

    @property
    def dispatch_done(self) -> int:        # [R]: receiver programs of rank r that finished, ever
        return self.dispatch_tail + self.num_ranks * MAX_CHANNELS

    @property
    def combine_tail(self) -> int:         # [R, C]: as dispatch_tail, for the SM senders of combine
        return self.dispatch_done + self.num_ranks

    @property
    def combine_done(self) -> int:         # [R]: as dispatch_done, for combine's reducer programs
        return self.combine_tail + self.num_ranks * MAX_CHANNELS

    @property
    def combine_copy_tail(self) -> int:    # [R]: rows copied so far by source s (copy engines), 0 between calls
        return self.combine_done + self.num_ranks

    @property
    def combine_copy_finished(self) -> int:   # [1]: this rank's reducers past their last wait, this call
        return self.combine_copy_tail + self.num_ranks

    @property
    def dispatch_arrived(self) -> int:     # [R]: sender programs of source s done with their rows here, ever
        return self.combine_copy_finished + 1

    @property
    def dispatch_counted(self) -> int:     # [1]: sender programs this rank's arrival waits counted, ever
        return self.dispatch_arrived + self.num_ranks

    @property
    def notify_payload(self) -> int:       # int32 [2 parities, R sources, payload_words]
        return self.dispatch_counted + 1

    @property
    def payload_words(self) -> int:        # int32 words: counts per rank, local-expert counts, signature
        return self.num_ranks + MAX_LOCAL_EXPERTS + SIGNATURE_WORDS

    @property
    def signal_bytes(self) -> int:
        payload_bytes = 2 * self.num_ranks * self.payload_words * 4
        return round_up(self.notify_payload * 8 + payload_bytes, 4096)


@dataclass(frozen=True)
class StagingLayout:
    """The normal mode's staging in the data area: dispatch receives rows into the first half,
    combine into the second. Each half holds as many rows of a call's shape as fit (a multiple
    of 16), every row field in a region of its own, one after the other."""

    start: int          # byte offset of the data area (a multiple of 4096)
    half_bytes: int     # bytes per half (a multiple of 4096)

    @staticmethod
    def of(memory: SymmetricBuffer) -> StagingLayout:
        return StagingLayout(memory.data_offset, memory.data_bytes // 2 // 4096 * 4096)

    def dispatch(self, x_words: int, scale_words: int, num_topk: int) -> tuple[int, list[int]]:
        """(rows, byte offsets of the x, scales, top-k ids, top-k weights and source-index
        regions) for dispatch rows of ``x_words`` 4-byte words, ``scale_words`` and ``num_topk``."""
        row_bytes = 4 * x_words + 4 * scale_words + 12 * num_topk + 4
        capacity = self.half_bytes // row_bytes // 16 * 16
        offsets, cursor = [], self.start
        for width in (4 * x_words, 4 * scale_words, 8 * num_topk, 4 * num_topk, 4):
            offsets.append(cursor)
            cursor += capacity * width
        return capacity, offsets

    def combine(self, hidden: int, num_topk: int) -> tuple[int, list[int]]:
        """(rows, byte offsets of the x and top-k weights regions) for bf16 combine rows."""
        capacity = self.half_bytes // (2 * hidden + 4 * num_topk) // 16 * 16
        start = self.start + self.half_bytes
        return capacity, [start, start + capacity * 2 * hidden]


class SymmetricBuffer:
    """``nbytes`` of data (plus the signal area) on every rank, mapped by every peer.

    Attributes:
        local: uint8 tensor over this rank's whole allocation.
        peer_base_ptrs: int64 [R] tensor of each rank's allocation address, as seen here.
        peers: uint8 tensors over each rank's whole allocation, as seen here (for copy-engine
            copies into a peer: ``peers[r][offset:offset + n].copy_(source)``).
        data_offset: byte offset of the data area; data_bytes: its size.
    """

    def __init__(self, group: dist.ProcessGroup, data_bytes: int, device: torch.device, interpret: bool) -> None:
        self.group = group
        self.rank = group.rank()
        self.num_ranks = group.size()
        self.signals = SignalLayout(self.num_ranks)
        self.data_offset = self.signals.signal_bytes
        self.data_bytes = round_up(data_bytes, 4096)
        total = self.data_offset + self.data_bytes
        self._keep_alive: list = []
        self.shares_by_ipc = not interpret and os.environ.get(SHARED_GPUS_VARIABLE) == "1"
        if interpret:
            peers = self._map_shared_files(total)
        elif self.shares_by_ipc:
            peers = self._map_ipc_handles(total, device)
        else:
            peers = self._rendezvous_symmetric(total, device)
        self.peers: list[torch.Tensor] = peers
        self.peer_base_ptrs = torch.tensor([t.data_ptr() for t in peers], dtype=torch.int64, device=device)
        self.local[: self.data_offset].zero_()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier(group=group)

    def _rendezvous_symmetric(self, total: int, device: torch.device) -> list[torch.Tensor]:
        import torch.distributed._symmetric_memory as symm_mem

        self.local = on_every_rank(self.group, lambda: symm_mem.empty(total, dtype=torch.uint8, device=device),
                                   f"allocating {total} bytes of symmetric memory")
        handle = symm_mem.rendezvous(self.local, self.group.group_name)
        self._keep_alive.append(handle)
        return [self.local if r == self.rank else handle.get_buffer(r, (total,), torch.uint8)
                for r in range(self.num_ranks)]

    def _map_ipc_handles(self, total: int, device: torch.device) -> list[torch.Tensor]:
        """Ranks that share a GPU (tests: ``RankPool`` with more ranks than GPUs). torch
        symmetric memory refuses two ranks on one device, so each rank exports a plain CUDA
        allocation with CUDA IPC, as torch.multiprocessing does for tensors passed between
        processes, and every peer maps it. Same layout, same kernels; NVLink is not involved.

        Each peer gets an export of its own. torch counts the users of an exported block with
        one counter per export, which its one receiver decrements when it lets go: one export
        shared by several peers was decremented once per peer, wrapped below zero, and kept
        the block allocated for good (every Buffer's whole allocation, on every rank).

        Each export is opened on this rank's GPU, whichever GPU holds it (ranks sharing GPUs
        that span several): CUDA maps an IPC handle into the address space of the device it is
        opened on, enabling peer access to the owner as it goes. torch opens it on the owner's
        GPU, where kernels on ours faulted on it even with peer access enabled by hand."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

        # Where an export's arguments hold the device its rebuild opens it on.
        device_at = list(inspect.signature(rebuild_cuda_tensor).parameters).index("storage_device")

        self.local = on_every_rank(self.group, lambda: torch.empty(total, dtype=torch.uint8, device=device),
                                   f"allocating {total} bytes of GPU memory")
        exports = [None if peer == self.rank else reduce_tensor(self.local) for peer in range(self.num_ranks)]
        gathered: list = [None] * self.num_ranks
        dist.all_gather_object(gathered, exports, group=self.group)

        def map_peers() -> list[torch.Tensor]:
            views = []
            for peer in range(self.num_ranks):
                if peer == self.rank:
                    views.append(self.local)
                else:
                    rebuild, args = gathered[peer][self.rank]   # the export ``peer`` made for this rank
                    if rebuild is not rebuild_cuda_tensor or not isinstance(args[device_at], int):
                        raise RuntimeError("torch's CUDA tensor export changed its layout: tritonep's ranks "
                                           "sharing GPUs cannot map each other's memory")
                    views.append(rebuild(*args[:device_at], device.index, *args[device_at + 1:]))
            return views

        # Also a barrier: every peer must have mapped this rank's allocation before any rank
        # may drop its own reference to what it received (the exporter keeps the memory alive
        # until then).
        mapped = on_every_rank(self.group, map_peers, "mapping the peers' allocations (CUDA IPC)")
        self._keep_alive.extend(mapped)
        return mapped

    def _map_shared_files(self, total: int) -> list[torch.Tensor]:
        token = [uuid.uuid4().hex if self.rank == 0 else None]
        dist.broadcast_object_list(token, src=dist.get_global_rank(self.group, 0), group=self.group)
        paths = [f"/dev/shm/tritonep-{token[0]}-{r}" for r in range(self.num_ranks)]

        def create() -> None:
            with open(paths[self.rank], "wb") as f:
                f.truncate(total)

        try:
            on_every_rank(self.group, create, f"creating a {total}-byte file in /dev/shm")
            mapped = on_every_rank(
                self.group, lambda: [torch.from_file(p, shared=True, size=total, dtype=torch.uint8) for p in paths],
                "mapping the ranks' /dev/shm files")
        finally:   # the mappings stay valid; nothing is left in /dev/shm, whatever failed
            if os.path.exists(paths[self.rank]):
                os.unlink(paths[self.rank])
        self.local = mapped[self.rank]
        self._keep_alive.extend(mapped)
        return mapped

    def signal_words(self) -> torch.Tensor:
        """This rank's signal counters as int64 (for tests and debugging)."""
        return self.local[: self.data_offset].view(torch.int64)

    def release(self) -> None:
        """Drop this rank's references to its own and its peers' memory. Symmetric memory and
        the /dev/shm files are freed with the last reference; with CUDA IPC,
        ``give_back_released`` frees it once every rank has released."""
        self._keep_alive.clear()
        self.peers = []
        self.local = torch.empty(0, dtype=torch.uint8, device=self.local.device)


def give_back_released(group: dist.ProcessGroup, memories: list[SymmetricBuffer | None]) -> None:
    """Collective, after every rank released ``memories``: memory exported through CUDA IPC stays
    allocated by its exporter until its peers have let go, and torch frees it only when asked
    (or when its allocator next runs short). Asking now gives it back at ``destroy()``."""
    if any(memory is not None and memory.shares_by_ipc for memory in memories):
        dist.barrier(group=group)
        torch.cuda.ipc_collect()


CU_MEM_HANDLE_TYPE_FABRIC = 0x8


def fabric_memory_available(device: torch.device) -> bool:
    """Whether torch symmetric memory allocates on ``device`` with CUDA fabric handles, which is
    what DeepEP's ``use_fabric=True`` asks for.

    torch picks the handle type itself (fabric where the GPU and driver allow it, else POSIX file
    descriptors), so the only exact answer is to allocate a small symmetric tensor (local: no
    rendezvous, no communication) and ask the CUDA driver which handle types that allocation
    supports. False on CPU devices (Triton interpreter) and whenever the driver cannot be asked.
    """
    if device.type != "cuda":
        return False
    import ctypes

    import torch.distributed._symmetric_memory as symm_mem

    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    driver.cuMemRetainAllocationHandle.argtypes = [ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_void_p]
    driver.cuMemGetAllocationPropertiesFromHandle.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong]
    driver.cuMemRelease.argtypes = [ctypes.c_ulonglong]
    probe = symm_mem.empty(4096, dtype=torch.uint8, device=device)
    handle = ctypes.c_ulonglong()
    if driver.cuMemRetainAllocationHandle(ctypes.byref(handle), ctypes.c_void_p(probe.data_ptr())) != 0:
        return False
    try:
        # CUmemAllocationProp: {int type; int requestedHandleTypes; CUmemLocation location; ...}, 32
        # bytes on 64-bit systems; 64 leave room.
        properties = (ctypes.c_ubyte * 64)()
        if driver.cuMemGetAllocationPropertiesFromHandle(properties, handle) != 0:
            return False
        requested = int.from_bytes(bytes(properties[4:8]), "little")
        return bool(requested & CU_MEM_HANDLE_TYPE_FABRIC)
    finally:
        driver.cuMemRelease(handle)
        del probe

