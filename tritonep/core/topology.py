"""How a group's ranks split into nodes.

Ranks ``n * g .. n * g + g - 1`` form node ``n``, where g (ranks per node) is, first found:

1. ``TRITONEP_GPUS_PER_NODE``: lets the tests simulate nodes inside one host, or states the node
   size where nothing else does;
2. ``LOCAL_WORLD_SIZE``, the processes per node that the launcher (torchrun, and launchers that
   follow it) started: a group of at most that many ranks is one node, a larger group spans nodes
   of that size (it must be a multiple of it: the launcher numbers ranks node by node);
3. DeepEP's rule: a group of up to 8 ranks is one node, a larger multiple of 8 spans nodes of 8
   GPUs (DeepEP's ``num_rdma_ranks = R / 8``). Any other size (12 CPU ranks, say: DeepEP refuses
   it, tritonep's CPU backend takes any rank count) is one node.

Local: no communication, so a Buffer (and a size hint) knows its split before it talks to anyone.
"""

from __future__ import annotations

import os

from tritonep.core.checks import InputError

GPUS_PER_NODE_VARIABLE = "TRITONEP_GPUS_PER_NODE"
LAUNCHER_VARIABLE = "LOCAL_WORLD_SIZE"   # torchrun's processes per node
DEEP_EP_NVLINK_PEERS = 8   # DeepEP's NUM_MAX_NVL_PEERS: ranks that share a node's NVLink domain


def ranks_per_node(num_ranks: int) -> int:
    """Ranks in each node of a group of ``num_ranks`` ranks (see module doc); InputError if
    ``TRITONEP_GPUS_PER_NODE`` does not split them into whole nodes."""
    setting = os.environ.get(GPUS_PER_NODE_VARIABLE, "")
    if setting:
        try:
            per_node = int(setting)
        except ValueError:
            per_node = 0
        if per_node <= 0 or num_ranks % per_node:
            raise InputError(f"{GPUS_PER_NODE_VARIABLE}={setting!r} must be a positive int that divides the "
                             f"group's {num_ranks} ranks into whole nodes")
        return per_node
    launched = os.environ.get(LAUNCHER_VARIABLE, "")
    if launched.isdigit() and int(launched) > 0:
        per_node = int(launched)
        if num_ranks <= per_node:
            return num_ranks
        if num_ranks % per_node:
            raise InputError(f"a group of {num_ranks} ranks does not fill whole nodes of {LAUNCHER_VARIABLE}="
                             f"{per_node} processes; set {GPUS_PER_NODE_VARIABLE} to the ranks per node")
        return per_node
    if num_ranks % DEEP_EP_NVLINK_PEERS:
        return num_ranks
    return DEEP_EP_NVLINK_PEERS


def num_nodes(num_ranks: int) -> int:
    """Nodes a group of ``num_ranks`` ranks spans."""
    return num_ranks // ranks_per_node(num_ranks)
