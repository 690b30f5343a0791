"""The SM side of the link ceiling (``ceiling.py``): one Triton kernel in which the programs of
each peer store that peer's words, block by block, straight into the peer's memory."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048   # int64 words a program moves per step: 16 KB
WARPS = 16


@triton.jit
def _push_kernel(sources_ptr, targets_ptr, words_per_peer, num_peers, BLOCK: tl.constexpr):
    # The programs of one peer take its blocks in turn (block part, part + P, part + 2P, ...)
    # rather than a contiguous span each: at the same program count the strided order carries
    # more bytes over NVLink (docs/findings.md), and a ceiling must be the best the SMs reach.
    programs_per_peer = tl.num_programs(0) // num_peers
    peer = tl.program_id(0) // programs_per_peer
    part = tl.program_id(0) % programs_per_peer
    target = tl.load(targets_ptr + peer).to(tl.pointer_type(tl.int64))
    source = sources_ptr + peer.to(tl.int64) * words_per_peer
    for start in range(part * BLOCK, words_per_peer, programs_per_peer * BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        mask = offsets < words_per_peer
        tl.store(target + offsets, tl.load(source + offsets, mask=mask), mask=mask)


def push(sources: torch.Tensor, targets: torch.Tensor, programs_per_peer: int) -> None:
    """Copy ``sources`` (int64, one chunk of equal length per peer, in the order of ``targets``)
    to the addresses in ``targets`` (int64 [peers]: each peer's destination), with
    ``programs_per_peer`` programs for each peer."""
    num_peers = targets.numel()
    _push_kernel[(programs_per_peer * num_peers,)](sources, targets, sources.numel() // num_peers, num_peers,
                                                   BLOCK=BLOCK, num_warps=WARPS)
