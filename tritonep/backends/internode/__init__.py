"""Internode backend: groups that span nodes (real, or simulated with TRITONEP_GPUS_PER_NODE).

Rows cross nodes only through the transport layer (``transport.py``: NVSHMEM, or plain stores
into symmetric memory for CPU ranks and ranks sharing a GPU); inside a node they move over the
node's own pointers, as the NVLink backend moves them.
"""
