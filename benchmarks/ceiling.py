"""The link ceiling of normal mode: what NVLink carries when every rank pushes the same remote
bytes to every peer at once, as a dispatch or combine does.

Each rank sends a chunk of ``remote_bytes / (R - 1)`` random bytes to each peer, straight into
the peer's symmetric memory, all ranks at once, peers in rotated order (rank + 1, rank + 2, ...)
so that no peer is everyone's first. Measured three ways in the same run: SM stores from one
Triton kernel (``push_kernel``, at several program counts, each program taking a peer's blocks
in turn or a contiguous span of them), the copy engines (one stream per peer, no SM), and both
at once (the copy engines take a share of each chunk, SM stores the rest). The ceiling is the
best of them; each way is checked to deliver every chunk before it is timed.
Timing as for the calls (``timing.median_us``); GB/s = remote bytes out per GPU / time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from . import timing

PROGRAM_COUNTS = (24, 48, 96)   # programs of the SM kernel, split evenly over the peers
SPLIT_SHARES = (0.5, 0.7)       # the copy engines' share of the bytes when both push at once


def _chunk(source: int, target: int, words: int, num_ranks: int, device: torch.device) -> torch.Tensor:
    """The random int64 words rank ``source`` sends rank ``target``: any rank can make them again."""
    generator = torch.Generator(device=device).manual_seed(1 + source * num_ranks + target)
    return torch.randint(-(1 << 62), 1 << 62, (words,), generator=generator, dtype=torch.int64, device=device)


def _delivered(group: dist.ProcessGroup, push: object, memory: torch.Tensor, words: int) -> bool:
    """Whether one ``push`` on every rank leaves each peer's chunk in this rank's memory; on every rank."""
    rank, num_ranks = group.rank(), group.size()
    memory.zero_()
    torch.cuda.synchronize()
    dist.barrier(group=group)
    push()
    torch.cuda.synchronize()
    dist.barrier(group=group)
    ok = all(torch.equal(memory[peer * words:(peer + 1) * words], _chunk(peer, rank, words, num_ranks, memory.device))
             for peer in range(num_ranks) if peer != rank)
    agreed = torch.tensor([int(ok)], device=memory.device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    return bool(agreed)


def measure(group: dist.ProcessGroup, remote_bytes: int, iters: int) -> dict:
    """The ceiling for ``remote_bytes`` of remote rows per rank (the largest over the ranks is
    used everywhere: symmetric memory has one size): GB/s out per GPU of each way, and the best."""
    import torch.distributed._symmetric_memory as symm_mem

    from .push_kernel import BLOCK, push

    rank, num_ranks = group.rank(), group.size()
    if num_ranks == 1:
        return {"skipped": "one rank: no peers"}
    device = torch.device("cuda", torch.cuda.current_device())
    # Whole blocks per peer: chunks start 16-byte aligned and the kernel's word count divides by
    # 16, so its loads and stores are 16-byte vectors.
    words = max(int(timing.slowest(group, remote_bytes)) // (num_ranks - 1) // 8 // BLOCK * BLOCK, BLOCK)
    memory = symm_mem.empty(words * num_ranks, dtype=torch.int64, device=device)
    handle = symm_mem.rendezvous(memory, group.group_name)
    peers = [(rank + step) % num_ranks for step in range(1, num_ranks)]
    targets = [handle.get_buffer(peer, (words,), torch.int64, storage_offset=rank * words) for peer in peers]
    sources = torch.cat([_chunk(rank, peer, words, num_ranks, device) for peer in peers])
    addresses = torch.tensor([target.data_ptr() for target in targets], dtype=torch.int64, device=device)
    streams = [torch.cuda.Stream() for _ in peers]

    def copy_engines(head: int = words, sm_push: Callable[[], None] | None = None) -> None:
        """The first ``head`` words of each peer's chunk on the copy engines; ``sm_push`` (the
        rest) on the SMs meanwhile."""
        current = torch.cuda.current_stream()
        for index, (target, stream) in enumerate(zip(targets, streams)):
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                target[:head].copy_(sources[index * words:index * words + head], non_blocking=True)
        if sm_push is not None:
            sm_push()
        for stream in streams:
            current.wait_stream(stream)

    def split(share: float, programs_per_peer: int) -> Callable[[], None]:
        """Copy engines and SM stores at once, the copy engines taking ``share`` of the bytes."""
        head = round(words * share / BLOCK) * BLOCK
        tails = sources.view(len(peers), words)[:, head:].contiguous().view(-1)
        tail_addresses = addresses + head * 8
        return lambda: copy_engines(head, lambda: push(tails, tail_addresses, programs_per_peer))

    per_peer = sorted({max(programs // len(peers), 1) for programs in PROGRAM_COUNTS})
    ways = {}
    for n in per_peer:
        for strided, suffix in ((True, ""), (False, "_spans")):
            ways[f"sm_stores_{n * len(peers)}_programs{suffix}"] = lambda n=n, strided=strided: push(
                sources, addresses, n, strided)
    ways["copy_engines"] = copy_engines
    # Both at once, as a design that splits a call's bytes between them would run.
    for share in SPLIT_SHARES:
        for n in (per_peer[0], per_peer[-1]):
            ways[f"copy_engines_{round(share * 100)}pct_and_sm_stores_{n * len(peers)}_programs"] = split(share, n)
    sent = words * 8 * len(peers)
    report: dict = {"remote_bytes": sent, "gbps": {}}
    for name, way in ways.items():
        if not _delivered(group, way, memory, words):
            report.setdefault("failed", []).append(name)
            continue
        report["gbps"][name] = sent / timing.median_us(group, way, iters) / 1e3
    if report["gbps"]:
        report["best"] = max(report["gbps"], key=report["gbps"].get)
        report["best_gbps"] = report["gbps"][report["best"]]
    dist.barrier(group=group)   # no peer still writes into this rank's memory when it is freed
    return report
