"""What a wait on a peer writes into the status word when it gives up, read by kernels and host.

A timed-out wait stores ``phase * 65536 + peer + 1`` (``device.signals.wait_at_least``); in
shrink mode a wait that masks the peer instead adds ``MASKED_BIT``. The phases are constexprs
so kernels can read them as globals; ``PHASE_NAMES`` is what the host's error message says.
"""

from __future__ import annotations

import triton.language as tl

# Phases reported in the status word when a wait times out.
# (constexpr so kernels may read them as globals)
PHASE_NOTIFY = tl.constexpr(1)
PHASE_DISPATCH_SLOT = tl.constexpr(2)     # sender waiting for the receiver to free its staging rows
PHASE_DISPATCH_DATA = tl.constexpr(3)     # receiver waiting for rows from a sender
PHASE_COMBINE_SLOT = tl.constexpr(4)
PHASE_COMBINE_DATA = tl.constexpr(5)
PHASE_LL_DISPATCH_SLOT = tl.constexpr(6)  # low-latency sender waiting for the peer to finish call m-2
PHASE_LL_DISPATCH_DATA = tl.constexpr(7)
PHASE_LL_COMBINE_SLOT = tl.constexpr(8)
PHASE_LL_COMBINE_DATA = tl.constexpr(9)
PHASE_LL_CLEAN = tl.constexpr(10)
# The internode backend's phases (backends/internode/): waits across nodes go through its
# transport, waits inside a node through the node's own pointers.
PHASE_NET_NOTIFY = tl.constexpr(11)
PHASE_NET_DISPATCH_SLOT = tl.constexpr(12)  # sender waiting for the destination node to free its landing rows
PHASE_NET_DISPATCH_DATA = tl.constexpr(13)  # a node's receiver waiting for rows a source put into the node
PHASE_NET_COMBINE_SLOT = tl.constexpr(14)
PHASE_NET_COMBINE_DATA = tl.constexpr(15)   # a source waiting for a node's partial sums
PHASE_NODE_COMBINE_DATA = tl.constexpr(16)  # the node's reducer waiting for a rank of its node
PHASE_TRANSPORT_TEST = tl.constexpr(17)     # the transport's own tests
# Not a wait: the count exchange of a dispatch whose counts the host does not read at the call
# (``num_worst_tokens``) found ranks that disagree on it; the "peer" field holds the bitmask of
# the signature words that differ (``backends/nvlink/normal/counts.py`` names them).
PHASE_DISAGREEMENT = tl.constexpr(18)
PHASE_NAMES = {
    1: "count exchange (notify)",
    2: "dispatch: waiting for the peer to release its receive area",
    3: "dispatch: waiting for rows from the peer",
    4: "combine: waiting for the peer to release its receive area",
    5: "combine: waiting for rows from the peer",
    6: "low_latency_dispatch: waiting for the peer to finish receiving the call before last",
    7: "low_latency_dispatch: waiting for rows from the peer",
    8: "low_latency_combine: waiting for the peer to finish receiving the call before last",
    9: "low_latency_combine: waiting for rows from the peer",
    10: "clean_low_latency_buffer: waiting for the peer at the barrier",
    11: "internode count exchange (notify)",
    12: "internode dispatch: waiting for the destination node to release its landing area",
    13: "internode dispatch: waiting for rows the source put into this node",
    14: "internode combine: waiting for the source to release its landing area",
    15: "internode combine: waiting for the node's partial sums",
    16: "internode combine: waiting for a rank of this node to stage its rows",
    17: "transport test wait",
    18: "count exchange: ranks disagree on a dispatch",
}

# Shrink mode: a status word with this bit set reports a peer that was masked after a time-out
# (the call went on without it), not a failure.
MASKED_BIT = tl.constexpr(1 << 40)
