"""The status word: how a kernel that gave up waiting on a peer tells the host, with no sync.

Kernels write a timed-out wait's (phase, peer) straight into one pinned host int64, which the
GPU reaches under unified addressing; the host reads it with no copy before each call and
raises (or, in shrink mode, warns) naming the rank and the phase.
"""

from __future__ import annotations

import torch

from tritonep.device.status_codes import MASKED_BIT, PHASE_NAMES
from tritonep.runtime.platform import INTERPRET


class StatusWord:
    """One pinned int64 per engine: ``address`` goes to the kernels, ``view`` is read by the host
    (a numpy view: reading it costs no torch dispatch)."""

    __slots__ = ("tensor", "view", "address")

    def __init__(self) -> None:
        self.tensor = torch.zeros(1, dtype=torch.int64, device="cpu", pin_memory=not INTERPRET)
        self.view = self.tensor.numpy()
        self.address = self.tensor.data_ptr()

    @property
    def code(self) -> int:
        return int(self.view[0])

    def clear(self) -> None:
        self.view[0] = 0


def masked_after_timeout_message(code: int, rank: int, timeout_ns: int) -> str:
    """The warning for a status word with ``MASKED_BIT`` (shrink mode)."""
    phase, peer = divmod((code & ~MASKED_BIT.value) - 1, 65536)
    return (f"tritonep: rank {rank} timed out after {timeout_ns / 1e9:.0f} s in phase "
            f"'{PHASE_NAMES.get(phase, phase)}' waiting for rank {peer}, and masked it (enable_shrink=True): "
            f"calls go on without that rank until low_latency_update_mask_buffer unmasks it")


def timeout_error(code: int, rank: int, timeout_ns: int, calls: str, ranks_per_node: int | None = None
                  ) -> RuntimeError:
    """The error for a status word a timed-out wait wrote (``phase * 65536 + peer + 1``); with
    ``ranks_per_node`` (a group that spans nodes) it names both ranks' nodes too."""
    phase, peer = divmod(code - 1, 65536)
    where = "" if ranks_per_node is None else f" (node {rank // ranks_per_node})"
    peer_where = "" if ranks_per_node is None else f" (node {peer // ranks_per_node})"
    return RuntimeError(
        f"tritonep: rank {rank}{where} timed out after {timeout_ns / 1e9:.0f} s in phase "
        f"'{PHASE_NAMES.get(phase, phase)}' waiting for rank {peer}{peer_where}; that rank stalled or made a "
        f"different sequence of {calls}. This Buffer cannot be used any more.")
