"""Which backend a front end gets, and what DeepEP's constructor options mean to it.

``Buffer.__init__`` calls these before any communication: a group of the gloo backend gets the
collective (CPU) backend, an NCCL group the NVLink backend (``TRITONEP_BACKEND`` overrides);
options a backend cannot honour raise here (the table in docs/ARCHITECTURE.md), options that
mean nothing to it are accepted.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tritonep.backends.base import Backend
from tritonep.core import topology
from tritonep.core.checks import InputError, require


def backend_kind(group_backend: str) -> str:
    """"collective" or "nvlink" for a group of this torch.distributed backend: gloo -> the
    collective (CPU) backend; NCCL -> the NVLink backend.

    ``TRITONEP_BACKEND=collective`` forces the collective backend on any group (NCCL included),
    which is what the benchmark's all_to_all_single baseline uses; ``=nvlink`` the NVLink backend
    (on gloo groups under ``TRITON_INTERPRET=1``, how the CPU tests run its kernels).
    """
    choice = os.environ.get("TRITONEP_BACKEND", "auto")
    if choice == "collective" or (choice == "auto" and group_backend != "nccl"):
        return "collective"
    return "nvlink"


def check_backend_options(kind: str, group_backend: str, low_latency_mode: bool,
                           allow_nvlink_for_low_latency_mode: bool, use_fabric: bool, num_nodes: int = 1) -> None:
    """Raise for DeepEP options that ask for something the chosen backend cannot do (the table
    in docs/ARCHITECTURE.md); options that mean nothing to it are accepted. ``num_nodes``: how
    many nodes the group spans (more than one: the internode backend, which checks
    ``allow_nvlink_for_low_latency_mode`` against its transport). Local: no communication."""
    if low_latency_mode and not allow_nvlink_for_low_latency_mode:
        if kind == "nvlink" and num_nodes == 1:
            raise InputError("allow_nvlink_for_low_latency_mode=False: the NVLink backend moves low-latency traffic "
                             "over NVLink only and has no other path; leave it True")
        if kind == "collective" and group_backend == "nccl":
            raise InputError("allow_nvlink_for_low_latency_mode=False: the collective backend on an NCCL group lets "
                             "NCCL choose its transport, which is NVLink inside a node; leave it True")
    if use_fabric and kind == "nvlink":
        from tritonep.backends.nvlink.memory import fabric_memory_available
        from tritonep.runtime.platform import INTERPRET

        device = torch.device("cpu") if INTERPRET else torch.device("cuda", torch.cuda.current_device())
        require(fabric_memory_available(device),
                f"use_fabric=True: torch symmetric memory does not allocate with CUDA fabric handles on {device} "
                f"(it uses them by itself only where the GPU and driver support fabric memory, e.g. multi-node "
                f"NVLink systems with IMEX; never under the Triton interpreter); use use_fabric=False")


def check_node_split(kind: str, num_nodes: int, ranks_per_node: int, num_rdma_bytes: int = 0,
                     low_latency_mode: bool = False) -> None:
    """Raise if the chosen backend cannot serve a group that spans ``num_nodes`` nodes: on GPUs
    such a group gets the internode backend, which needs ``num_rdma_bytes`` for its heap (in
    either mode). Local: runs before any allocation or communication."""
    if kind != "nvlink" or num_nodes == 1:
        return
    split = (f"the group spans {num_nodes} nodes of {ranks_per_node} ranks ({topology.GPUS_PER_NODE_VARIABLE} "
             f"or DeepEP's nodes of 8)")
    if num_rdma_bytes <= 0:
        raise InputError(f"{split}: the internode backend moves rows between nodes through a heap of "
                         f"num_rdma_bytes, so num_rdma_bytes must be > 0 (got {num_rdma_bytes})")


def make_backend(kind: str, group: dist.ProcessGroup, buffer_id: int, num_nvl_bytes: int, num_rdma_bytes: int,
                 low_latency_mode: bool, allow_nvlink_for_low_latency_mode: bool = True) -> Backend:
    """The backend ``backend_kind`` chose, over ``group``. Collective: every rank calls it."""
    if kind == "collective":
        from tritonep.backends.collective import CollectiveBackend

        return CollectiveBackend(group, buffer_id, num_nvl_bytes, num_rdma_bytes, low_latency_mode)
    if topology.num_nodes(group.size()) > 1:
        from tritonep.backends.internode.backend import InternodeBackend

        return InternodeBackend(group, buffer_id, num_nvl_bytes, num_rdma_bytes, low_latency_mode,
                                allow_nvlink_for_low_latency_mode)
    from tritonep.backends.nvlink import NvlinkBackend

    return NvlinkBackend(group, buffer_id, num_nvl_bytes, num_rdma_bytes, low_latency_mode)
