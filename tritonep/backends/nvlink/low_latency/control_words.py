"""The low-latency kernels' words of the control block, as Triton constexprs.

``regions.py`` lays the block out in plain ints (the host sizes buffers with it, without Triton);
this module turns its formulas into the constexprs a kernel of each kind of call reads, so the
dispatch and the combine kernels take their words from one place.
"""

from __future__ import annotations

from typing import NamedTuple

import triton.language as tl

from tritonep.backends.nvlink.low_latency import regions as layout

DISPATCH, COMBINE = 0, 1   # the ``kind`` of the layout's formulas

MAX_RANKS = tl.constexpr(layout.MAX_RANKS)
MAX_EXPERTS = tl.constexpr(layout.MAX_EXPERTS)  # flag slots are this far apart, whatever E a call has
MAX_TOPK = tl.constexpr(layout.MAX_TOPK)
CONTROL_BYTES = tl.constexpr(layout.CONTROL_BYTES)


class CallWords(NamedTuple):
    """One kind of call's words (``regions.py`` says what each one counts)."""

    sequence_sent: tl.constexpr
    sequence_received: tl.constexpr
    done_send: tl.constexpr
    done_receive: tl.constexpr
    sent_use: tl.constexpr


def call_words(kind: int) -> CallWords:
    return CallWords(tl.constexpr(layout.SEQUENCE + 4 * kind), tl.constexpr(layout.SEQUENCE + 4 * kind + 2),
                     tl.constexpr(layout.DONE + 2 * kind), tl.constexpr(layout.DONE + 2 * kind + 1),
                     tl.constexpr(layout.SENT_USE + 2 * layout.MAX_RANKS * kind))
