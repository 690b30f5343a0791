"""A torch.distributed process group for the processes of an mpi4py communicator.

DeepEP's ``Buffer(group=None, comm=comm)`` takes an ``mpi4py.MPI.Comm`` instead of a process
group. tritonep's backends run on torch.distributed, so :func:`group_from_comm` makes a group
over the same processes, in the same rank order (``Buffer.rank == comm.Get_rank()``), using only
the communicator's ``Get_rank``, ``Get_size``, ``bcast`` and ``allgather``:

* torch.distributed not initialised: it is initialised here, with the communicator's processes
  as the world (world rank = ``comm.Get_rank()``). Rank 0 opens a ``TCPStore`` on a free port
  and announces its address with ``comm.bcast``: 127.0.0.1 when all processes run on one host,
  else ``MASTER_ADDR`` if set, else the address of rank 0's host name. The returned group is the
  default group, which stays initialised after the Buffer is gone (destroy it with
  ``torch.distributed.destroy_process_group()`` when done).
* initialised (e.g. by ``torchrun``): a new group over the world ranks of the communicator's
  processes (gathered with ``comm.allgather``), made with ``use_local_synchronization`` so that
  processes outside the communicator need not take part. torch orders a group's ranks by world
  rank, so the communicator must list its processes in ascending world-rank order (as
  ``MPI.COMM_WORLD`` and splits of it keyed by world rank do); otherwise InputError.

The backend is NCCL when CUDA is available, else gloo. As for any NCCL group, select each
process's GPU (``torch.cuda.set_device``) before building the Buffer.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from tritonep.core.checks import InputError, require

_COMM_METHODS = ("Get_rank", "Get_size", "bcast", "allgather")


def backend_for_comm() -> str:
    """The torch.distributed backend :func:`group_from_comm` uses on this machine."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def check_comm(comm: object) -> None:
    """Raise InputError unless mpi4py is importable and ``comm`` has the communicator methods
    used here. Local: no communication."""
    try:
        import mpi4py  # noqa: F401  (only its presence is checked; comm's own methods are called)
    except ImportError:
        raise InputError("comm (an mpi4py communicator, used when group is None) needs the mpi4py package, "
                         "which is not importable here; install mpi4py or pass a torch.distributed group") from None
    missing = [name for name in _COMM_METHODS if not callable(getattr(comm, name, None))]
    require(not missing, f"comm must be an mpi4py communicator; {type(comm).__name__} lacks {', '.join(missing)}")


def group_from_comm(comm: Any) -> dist.ProcessGroup:
    """A torch process group over ``comm``'s processes, in ``comm``'s rank order (module doc).
    Collective over ``comm``."""
    check_comm(comm)
    rank, size = int(comm.Get_rank()), int(comm.Get_size())
    backend = backend_for_comm()
    if not dist.is_initialized():
        return _init_world(comm, rank, size, backend)
    world_ranks = [int(r) for r in comm.allgather(dist.get_rank())]
    if world_ranks != sorted(set(world_ranks)):
        raise InputError(f"comm lists its processes in world-rank order {world_ranks}; a torch group orders ranks "
                         f"by world rank, so Buffer ranks would differ from comm ranks. Use a communicator in "
                         f"ascending world-rank order (e.g. comm.Split(color, key=world_rank))")
    if world_ranks == list(range(dist.get_world_size())) and dist.get_backend() == backend:
        return dist.group.WORLD
    return dist.new_group(world_ranks, backend=backend, use_local_synchronization=True)


def _init_world(comm: Any, rank: int, size: int, backend: str) -> dist.ProcessGroup:
    hosts = comm.allgather(socket.gethostname())
    store = None
    address = None
    if rank == 0:
        if len(set(hosts)) == 1:
            host = "127.0.0.1"
        else:
            host = os.environ.get("MASTER_ADDR") or socket.gethostbyname(socket.gethostname())
        # Port 0: the store binds a free port itself, so no other process can take it meanwhile.
        store = dist.TCPStore(host, 0, size, is_master=True, wait_for_workers=False)
        address = (host, store.port)
    host, port = comm.bcast(address, root=0)
    if store is None:
        store = dist.TCPStore(host, port, size, is_master=False)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size)
    return dist.group.WORLD
