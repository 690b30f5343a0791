"""The SM side of the link ceiling (``ceiling.py``): one Triton kernel in which the programs of
each peer store that peer's words straight into the peer's memory, in one of two orders."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048   # int64 words a program moves per step: 16 KB
WARPS = 16


@triton.jit
def _push_kernel(sources_ptr, targets_ptr, words_per_peer, num_peers, BLOCK: tl.constexpr, STRIDED: tl.constexpr):
    # STRIDED: the programs of one peer take its blocks in turn (block part, part + P, ...), the
    # shared probe's order; else each takes a contiguous span, as a dispatch channel takes its
    # rows. Both are timed; once the stores were 16-byte vectors they carried the same, so the
    # dispatch's channels keep their contiguous spans.
    programs_per_peer = tl.num_programs(0) // num_peers
    peer = tl.program_id(0) // programs_per_peer
    part = tl.program_id(0) % programs_per_peer
    # The targets are 16-byte aligned (ceiling.py cuts the chunks so), which the compiler cannot
    # see in an address loaded from memory: saying so lets the stores be 16-byte vectors, as the
    # library's kernels store rows.
    target = tl.multiple_of(tl.load(targets_ptr + peer).to(tl.pointer_type(tl.int64)), 16)
    source = sources_ptr + peer.to(tl.int64) * words_per_peer
    if STRIDED:
        begin, end, step = part * BLOCK, words_per_peer, programs_per_peer * BLOCK
    else:
        span = tl.cdiv(tl.cdiv(words_per_peer, programs_per_peer), BLOCK) * BLOCK
        begin = part * span
        end = tl.minimum(begin + span, words_per_peer)
        step = BLOCK
    for start in range(begin, end, step):
        offsets = start + tl.arange(0, BLOCK)
        mask = offsets < end
        tl.store(target + offsets, tl.load(source + offsets, mask=mask), mask=mask)


def push(sources: torch.Tensor, targets: torch.Tensor, programs_per_peer: int, strided: bool = True) -> None:
    """Copy ``sources`` (int64, one chunk of equal length per peer, in the order of ``targets``)
    to the addresses in ``targets`` (int64 [peers]: each peer's destination), with
    ``programs_per_peer`` programs for each peer, taking the chunk's blocks in turn
    (``strided``) or in a contiguous span each."""
    num_peers = targets.numel()
    _push_kernel[(programs_per_peer * num_peers,)](sources, targets, sources.numel() // num_peers, num_peers,
                                                   BLOCK=BLOCK, STRIDED=strided, num_warps=WARPS)
