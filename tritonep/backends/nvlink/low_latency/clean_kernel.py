"""clean_low_latency_buffer on NVLink: zero the low-latency control words, between two barriers.

One program. The first barrier makes sure every peer finished its earlier low-latency calls
(nobody still writes into this rank's control words), the second that nobody starts a new
call into them before they are zero. The barriers run over this rank's symmetric memory and
skip the ranks it masks (shrink mode), so a masked rank, dead or alive, is neither written
to nor waited for; a host-side ``dist.barrier`` would wait for every rank of the group.
The barrier words lie past ``CLEAN_END`` and survive the cleaning. Peers of another node are
reached through NVSHMEM when ``TRANSPORT`` says so (``device/signals.barrier_unmasked``).
"""

from __future__ import annotations

import triton.language as tl

from tritonep.backends.nvlink.low_latency import regions as layout
from tritonep.device.signals import barrier_unmasked, load_rank_mask
from tritonep.device.status_codes import PHASE_LL_CLEAN
from tritonep.runtime import kernel_names

CLEAN_END = tl.constexpr(layout.CLEAN_END)
BARRIER = tl.constexpr(layout.BARRIER)
BARRIER_SENT = tl.constexpr(layout.BARRIER_SENT)


@kernel_names.jit("tritonep::low_latency::clean_buffer",
                  do_not_specialize=["area", "rank", "status_address", "timeout_ns"])
def low_latency_clean_kernel(peer_base_ptrs, mask_ptr, area, rank, status_address, timeout_ns,
                             NUM_RANKS: tl.constexpr, RANKS_PAD: tl.constexpr, HAS_MASK: tl.constexpr,
                             BLOCK: tl.constexpr, GPU: tl.constexpr, TRANSPORT: tl.constexpr):
    """``mask_ptr``: this rank's int32 [R] mask (shrink mode; unused without ``HAS_MASK``).
    ``peer_base_ptrs``: the low-latency peer table (``area.py``); ``TRANSPORT``: how peers it
    maps no address for are reached (``device/nvshmem.py``)."""
    status_ptr = status_address.to(tl.pointer_type(tl.int64))
    control = (tl.load(peer_base_ptrs + rank) + area).to(tl.pointer_type(tl.int64))
    masked = load_rank_mask(mask_ptr, tl.arange(0, RANKS_PAD), NUM_RANKS, HAS_MASK)
    masked = barrier_unmasked(control, peer_base_ptrs, area, rank, masked, mask_ptr, BARRIER, BARRIER_SENT,
                              status_ptr, timeout_ns, PHASE_LL_CLEAN, NUM_RANKS, RANKS_PAD, HAS_MASK, GPU, TRANSPORT)
    for first in range(0, CLEAN_END, BLOCK):
        words = first + tl.arange(0, BLOCK)
        tl.store(control + words, tl.zeros([BLOCK], tl.int64), mask=words < CLEAN_END)
    masked = barrier_unmasked(control, peer_base_ptrs, area, rank, masked, mask_ptr, BARRIER, BARRIER_SENT,
                              status_ptr, timeout_ns, PHASE_LL_CLEAN, NUM_RANKS, RANKS_PAD, HAS_MASK, GPU, TRANSPORT)
