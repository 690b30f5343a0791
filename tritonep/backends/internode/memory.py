"""The internode backend's symmetric heap: where it comes from, and the two pointer tables.

``TransportHeap`` is one allocation of the same size on every rank, with:

* ``transport_table`` (int64 [R]) and ``base``: what the transport's operations take
  (``transport.py``): each rank's NVSHMEM PE for ``NVSHMEM``, each rank's heap address as mapped
  here for ``STORES``;
* ``node_peer_ptrs`` (int64 [R]): the heap addresses of the ranks of this rank's own node, as
  mapped here, and 0 for every rank of another node. The in-node (NVLink) stage reads and
  writes through this table only, so no pointer ever crosses a node boundary: traffic between
  nodes, real or simulated, goes through the transport or faults. The low-latency kernels get
  both in one table (``low_latency_peer_table``).

``STORES`` reuses the NVLink backend's ``SymmetricBuffer`` (torch symmetric memory, CUDA IPC for
ranks sharing a GPU, /dev/shm files under the interpreter). ``NVSHMEM`` allocates from torch's
NVSHMEM symmetric-memory backend; ``require_nvshmem`` says what to install when it is missing.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tritonep.backends.internode.transport import NVSHMEM, STORES, TRANSPORT_NAMES
from tritonep.backends.nvlink.memory import SymmetricBuffer, give_back_released
from tritonep.core.checks import InputError
from tritonep.core.rank_agreement import on_every_rank
from tritonep.rank_pool import SHARED_GPUS_VARIABLE
from tritonep.runtime.platform import INTERPRET

TRANSPORT_VARIABLE = "TRITONEP_TRANSPORT"
NVSHMEM_INSTALL_HINT = ("install NVSHMEM for the CUDA of your torch build (pip install nvidia-nvshmem-cu12, or "
                        "-cu13), or point NVSHMEM_LIB_DIR at the folder holding libnvshmem_device.bc; or run "
                        f"with {TRANSPORT_VARIABLE}=stores (plain stores: one host only)")


def choose_transport() -> int:
    """The transport id for this process: ``TRITONEP_TRANSPORT`` (``nvshmem`` or ``stores``), else
    NVSHMEM on GPUs with one rank each and plain stores where NVSHMEM cannot run (Triton's
    interpreter, ranks sharing a GPU). InputError for a setting that cannot work here."""
    setting = os.environ.get(TRANSPORT_VARIABLE, "").lower()
    shared = INTERPRET or os.environ.get(SHARED_GPUS_VARIABLE) == "1"
    if setting not in ("", "nvshmem", "stores"):
        raise InputError(f"{TRANSPORT_VARIABLE}={setting!r}: expected 'nvshmem' or 'stores'")
    if setting == "stores" or (setting == "" and shared):
        return STORES.value
    if shared:
        raise InputError(f"{TRANSPORT_VARIABLE}=nvshmem: NVSHMEM needs one GPU per rank (it refuses several "
                         f"processes on one GPU, and does not run under TRITON_INTERPRET=1); use "
                         f"{TRANSPORT_VARIABLE}=stores")
    require_nvshmem()
    return NVSHMEM.value


def require_nvshmem() -> None:
    """InputError, naming what to install, unless torch's NVSHMEM backend and its Triton device
    library are usable here. Local: no communication."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
        from torch.distributed._symmetric_memory import _nvshmem_triton
    except ImportError as error:
        raise InputError(f"the internode backend's NVSHMEM transport needs torch.distributed's symmetric memory "
                         f"({error}); {NVSHMEM_INSTALL_HINT}") from None
    if not symm_mem.is_nvshmem_available():
        raise InputError(f"torch reports NVSHMEM unavailable (torch.distributed._symmetric_memory."
                         f"is_nvshmem_available() is False): {NVSHMEM_INSTALL_HINT}")
    if not hasattr(_nvshmem_triton, "putmem_signal_block"):
        raise InputError("torch defines no NVSHMEM Triton device functions here (no Triton or no CUDA build): "
                         f"{NVSHMEM_INSTALL_HINT}")
    try:
        _nvshmem_triton.NvshmemLibFinder.find_device_library()
    except RuntimeError as error:
        raise InputError(f"{error}: {NVSHMEM_INSTALL_HINT}") from None


class TransportHeap:
    """``nbytes`` of symmetric heap on every rank of ``group``, zeroed, with the transport's table
    and the in-node pointer table (see the module doc). Collective.

    Attributes:
        local: uint8 tensor over this rank's heap.
        base: its address; offsets in the kernels are from here.
        transport_table, node_peer_ptrs: int64 [R] on the device.
        transport: NVSHMEM or STORES (an int).
    """

    def __init__(self, group: dist.ProcessGroup, nbytes: int, ranks_per_node: int, device: torch.device,
                 transport: int) -> None:
        self.group, self.transport = group, transport
        node = group.rank() // ranks_per_node
        self._stores: SymmetricBuffer | None = None
        self._keep_alive: list = []
        if transport == STORES.value:
            self._stores = SymmetricBuffer(group, nbytes, device, interpret=INTERPRET)
            start = self._stores.data_offset
            self.local = self._stores.local[start:start + nbytes]
            addresses = [peer.data_ptr() + start for peer in self._stores.peers]
            table = addresses
        else:
            addresses, table = self._allocate_nvshmem(group, nbytes, device)
        self.base = self.local.data_ptr()
        self.transport_table = torch.tensor(table, dtype=torch.int64, device=device)
        self.node_peer_ptrs = torch.tensor([address if peer // ranks_per_node == node else 0
                                            for peer, address in enumerate(addresses)], dtype=torch.int64,
                                           device=device)
        self.local.zero_()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier(group=group)

    @property
    def name(self) -> str:
        return TRANSPORT_NAMES[self.transport]

    # What the low-latency engine takes of an allocation (``nvlink/low_latency/area.py``): the heap
    # starts at offset 0, and its kernels reach peers through ``low_latency_peer_table``.
    data_offset = 0

    @property
    def data_bytes(self) -> int:
        return self.local.numel()

    def low_latency_peer_table(self, nvlink: bool = True) -> torch.Tensor:
        """The low-latency kernels' ``peer_base_ptrs``. ``STORES``: every rank's heap address,
        each remote write a store. ``NVSHMEM``: the addresses of the ranks a store reaches (this
        node's with ``nvlink``, DeepEP's allow_nvlink_for_low_latency_mode; else this rank alone),
        0 for the others, which NVSHMEM reaches, then every rank's PE."""
        if self.transport == STORES.value:
            return self.transport_table
        rank = self.group.rank()
        ranks = torch.arange(self.group.size(), dtype=torch.int64, device=self.node_peer_ptrs.device)
        mapped = self.node_peer_ptrs if nvlink else torch.where(ranks == rank, self.node_peer_ptrs, 0)
        return torch.cat([mapped, self.transport_table])

    def _allocate_nvshmem(self, group: dist.ProcessGroup, nbytes: int,
                          device: torch.device) -> tuple[list[int], list[int]]:
        """torch's NVSHMEM symmetric memory: the heap, every in-node peer's mapping (0 where
        NVSHMEM gives none: other nodes), and every rank's PE (its global rank)."""
        import torch.distributed._symmetric_memory as symm_mem

        def allocate() -> torch.Tensor:
            symm_mem.set_backend("NVSHMEM")
            return symm_mem.empty(nbytes, dtype=torch.uint8, device=device)

        self.local = on_every_rank(group, allocate, f"allocating {nbytes} bytes of NVSHMEM symmetric memory")
        handle = symm_mem.rendezvous(self.local, group.group_name)
        self._keep_alive.append(handle)
        rank = group.rank()
        addresses = []
        for peer in range(group.size()):
            if peer == rank:
                addresses.append(self.local.data_ptr())
                continue
            try:
                addresses.append(handle.get_buffer(peer, (nbytes,), torch.uint8).data_ptr())
            except RuntimeError:   # no load/store path to that rank: another node
                addresses.append(0)
        return addresses, [dist.get_global_rank(group, peer) for peer in range(group.size())]

    def release(self) -> None:
        """Drop this rank's references to the heaps (see ``SymmetricBuffer.release``)."""
        if self._stores is not None:
            self._stores.release()
        self._keep_alive.clear()
        self.local = torch.empty(0, dtype=torch.uint8, device=self.local.device)

    def give_back(self) -> None:
        """Collective, after ``release`` on every rank."""
        give_back_released(self.group, [self._stores])
