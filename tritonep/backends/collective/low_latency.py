"""Low-latency (decode) dispatch and combine with plain ``torch.distributed`` collectives.

Every (token, expert) pair travels once, in ``routing.low_latency_send_plan`` order (by global
expert, token order inside), as one packed byte row: the e4m3 (or bf16) data, its scales, the
source token index and the local expert id. Two collectives per dispatch:

1. an all_gather of a fixed-size header: the rows each rank sends to each rank, plus the call's
   shape (hidden, T, E, fp8 flags). Fixed size because ranks that disagree on E must still be
   able to compare notes: every rank then raises the same InputError instead of crashing;
2. an all_to_all_single of the rows.

The receiver places the rows in DeepEP's packed layout ``[E_local, R*T, H]`` from the expert
ids they carry: inside local expert e the blocks of source ranks 0..R-1 follow each other
(ascending, so the layout is deterministic here), token order inside. With ``return_recv_hook``
only the sends are issued and the hook does the wait and the placement, filling the returned
tensors (data, scales, count, src_info, layout_range) in place.

These functions take the process group explicitly and keep their state in the handle, so they
run unchanged on NCCL groups (the benchmark's baseline).

Shrink mode (``rank_mask``, int32 [R]: 1 where this rank masks that rank). gloo collectives
always involve every rank, so a mask cannot mean "do not talk to that rank" here; it means
zero rows. Each rank's mask row travels in the header all_gather, and rows flow between ranks
s and d only if neither masks the other ("linked"): rows for a masked rank's experts are
dropped before sending, nothing is received from it, and its experts contribute nothing to
the combine. On the rank that masks, this is exactly what the NVLink kernels do. A rank that
is masked by a peer but does not mask it back gets zero rows from that peer here, whereas the
NVLink kernels would wait for the peer and time out; masks are meant to be set consistently
(every live rank masks the failed one). A rank that has really died, so that every
collective hangs, is the later "real shrink" work (issue 11): it needs communication that
leaves the dead rank out, which gloo collectives cannot do.

A combine uses the links of its handle's dispatch AND the masks when the combine runs: a
rank masked at either time is skipped, so masking or unmasking between a dispatch and its
combine never makes a rank wait for rows nobody sends (see ``_check_combine``).

Conventions this transport chooses where DeepEP leaves things open:
* rows of ``packed_recv_x`` / scales past ``packed_recv_count[e]`` are left uninitialised and
  ``src_info`` is -1 there;
* ``dispatch_wait_recv_cost_stats`` (and the combine's ``combine_wait_recv_cost_stats``) gets
  the same wait (host nanoseconds around the wait for the one all_to_all that carries every
  source's rows) added to every linked source's entry, since one collective cannot tell the
  sources apart. On NCCL the wait only orders streams, so the value measures the host side,
  not the GPU's wait.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tritonep.backends.base import LowLatencyDispatchRequest, LowLatencyDispatchResult
from tritonep.backends.collective import packing
from tritonep.core import fp8, routing
from tritonep.core.checks import InputError
from tritonep.core.handles import LowLatencyHandle

_HEADER_NAMES = ["hidden", "num_max_dispatch_tokens_per_rank", "num_experts", "use_fp8", "round_scale",
                 "use_ue8m0"]


@dataclass
class LowLatencyLayout:
    """The receiver's placement, kept in the handle so the combine can send rows back."""

    recv_splits: list[int]  # rows received from each source rank (sent back by the combine)
    send_splits: list[int]  # pairs this rank sent to each rank (come back in the combine)
    links: torch.Tensor     # bool [R] (host): ranks rows flowed with (neither side masked the other)
    # Filled when the receive completes (by the hook with return_recv_hook):
    recv_expert: torch.Tensor | None = field(default=None)  # [Q] local expert of each row, arrival order
    recv_row: torch.Tensor | None = field(default=None)     # [Q] its row inside packed_recv_x[expert]


def _placement(expert: torch.Tensor, recv_splits: list[int], experts_per_rank: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows in arrival order (by source, then local expert, then token) -> (row in the packed
    layout [Q], counts [E_local, R]).

    Row j of the (source s, expert e) segment goes to ``begin[e, s] + j``, where ``begin`` is
    the exclusive prefix over sources of expert e's counts.
    """
    num_ranks = len(recv_splits)
    device = expert.device
    num_rows = expert.numel()
    source = torch.repeat_interleave(torch.arange(num_ranks, dtype=torch.int64, device=device),
                                     torch.tensor(recv_splits, dtype=torch.int64, device=device),
                                     output_size=num_rows)
    segment = source * experts_per_rank + expert  # non-decreasing in arrival order
    per_segment = torch.bincount(segment, minlength=num_ranks * experts_per_rank)
    segment_start = per_segment.cumsum(0) - per_segment
    within = torch.arange(num_rows, dtype=torch.int64, device=device) - segment_start[segment]
    counts = per_segment.view(num_ranks, experts_per_rank).t()  # [E_local, R]
    begin = counts.cumsum(1) - counts
    row = begin[expert, source] + within
    return row, counts


def links_from_masks(masks: torch.Tensor) -> torch.Tensor:
    """``masks`` [R, R] (``[s, d]`` = 1: rank s masks rank d) -> bool [R, R]: True where rows may
    flow between the two ranks, i.e. neither masks the other."""
    cut = masks.bool()
    return ~(cut | cut.t())


def _mask_row(rank_mask: torch.Tensor | None, num_ranks: int, device: torch.device) -> torch.Tensor:
    if rank_mask is None:
        return torch.zeros(num_ranks, dtype=torch.int64, device=device)
    return rank_mask.to(device=device, dtype=torch.int64)


def dispatch(group: dist.ProcessGroup, buffer_id: int, request: LowLatencyDispatchRequest,
             rank_mask: torch.Tensor | None = None) -> LowLatencyDispatchResult:
    """Send each (token, expert) pair to the expert's rank and pack it per local expert.
    ``rank_mask``: shrink mode's int32 [R] (1 = masked), or None."""
    rank, num_ranks = group.rank(), group.size()
    x, topk_idx = request.x, request.topk_idx
    T, num_experts = request.num_max_dispatch_tokens_per_rank, request.num_experts
    experts_per_rank = num_experts // num_ranks
    hidden = x.shape[1]
    device = x.device
    use_fp8, use_ue8m0 = request.use_fp8, request.use_ue8m0

    token_index, _, expert, counts = routing.low_latency_send_plan(topk_idx, num_experts, num_ranks)
    header = torch.tensor([hidden, T, num_experts, int(use_fp8), int(request.round_scale), int(use_ue8m0)],
                          dtype=torch.int64, device=device)
    masks_at = num_ranks + len(_HEADER_NAMES)
    table = packing.all_gather_rows(group, torch.cat([counts.sum(1), header, _mask_row(rank_mask, num_ranks, device)]))
    packing.check_same_on_all_ranks(table[:, num_ranks:masks_at], _HEADER_NAMES, "low_latency_dispatch")
    links = links_from_masks(table[:, masks_at:])
    send_splits = (table[rank, :num_ranks] * links[rank]).tolist()
    recv_splits = (table[:, rank] * links[:, rank]).tolist()
    if not bool(links[rank].all()):   # shrink mode: drop the pairs for ranks we are not linked with
        keep = links[rank].to(device)[expert // experts_per_rank]
        token_index, expert = token_index[keep], expert[keep]

    parts: list[torch.Tensor]
    if use_fp8:
        x_fp8, scales = fp8.cast_to_fp8(x, round_scale=request.round_scale, use_ue8m0=use_ue8m0)
        parts = [packing.compact(x_fp8).view(torch.uint8).index_select(0, token_index),
                 scales.index_select(0, token_index)]
        specs = [(torch.uint8, hidden), (scales.dtype, scales.shape[1])]
    else:
        parts = [x.index_select(0, token_index)]
        specs = [(torch.bfloat16, hidden)]
    ids = torch.stack([token_index, expert % experts_per_rank], dim=1).to(torch.int32)
    parts.append(ids)
    specs.append((torch.int32, 2))
    recv, work = packing.all_to_all_rows(group, packing.pack_rows(parts), send_splits, recv_splits, async_op=True)

    slots = num_ranks * T
    packed_count = torch.zeros(experts_per_rank, dtype=torch.int32, device=device)
    src_info = torch.full((experts_per_rank, slots), -1, dtype=torch.int32, device=device)
    layout_range = torch.zeros(experts_per_rank, num_ranks, dtype=torch.int64, device=device)
    if use_fp8:
        packed_x = torch.empty(experts_per_rank, slots, hidden, dtype=fp8.FP8_DTYPE, device=device)
        scale_dtype, scale_cols = specs[1]
        # Column-major in the last two dims, as DeepEP's kernels write them.
        packed_scales = torch.empty(experts_per_rank, scale_cols, slots, dtype=scale_dtype,
                                    device=device).transpose(1, 2)
        packed: torch.Tensor | tuple[torch.Tensor, torch.Tensor] = (packed_x, packed_scales)
    else:
        packed_x = torch.empty(experts_per_rank, slots, hidden, dtype=torch.bfloat16, device=device)
        packed = packed_x
    layout = LowLatencyLayout(recv_splits, send_splits, links[rank])
    recv_stats = request.cumulative_local_expert_recv_stats
    wait_stats = request.dispatch_wait_recv_cost_stats

    def finish() -> None:
        start = time.perf_counter_ns()
        work.wait()
        waited = time.perf_counter_ns() - start
        fields = packing.unpack_rows(recv, specs)
        ids = fields[-1].to(torch.int64)
        recv_expert = ids[:, 1]
        row, expert_counts = _placement(recv_expert, recv_splits, experts_per_rank)
        packed_x.view(torch.uint8)[recv_expert, row] = fields[0].view(torch.uint8)
        if use_fp8:
            packed_scales[recv_expert, row] = fields[1]
        src_info[recv_expert, row] = ids[:, 0].to(torch.int32)
        begin = expert_counts.cumsum(1) - expert_counts
        layout_range.copy_((begin << 32) | expert_counts)
        packed_count.copy_(expert_counts.sum(1))
        layout.recv_expert, layout.recv_row = recv_expert, row
        if recv_stats is not None:
            recv_stats.add_(packed_count)
        if wait_stats is not None:
            wait_stats.add_(layout.links.to(wait_stats.device, torch.int64) * waited)

    handle = LowLatencyHandle(src_info, layout_range, T, hidden, num_experts, buffer_id, layout)
    if request.return_recv_hook:
        return LowLatencyDispatchResult(packed, packed_count, handle, finish)
    finish()
    return LowLatencyDispatchResult(packed, packed_count, handle, None)


def _check_combine(group: dist.ProcessGroup, layout: LowLatencyLayout, expected_back: torch.Tensor,
                   hidden: int, rank_mask: torch.Tensor | None) -> torch.Tensor:
    """Every rank learns whether the combine's rows line up, and all raise the same error if not.
    Returns this rank's combine links (bool [R], host): the ranks linked at the dispatch and now.

    Rank s expects ``expected_back[d]`` rows back from rank d (its topk_idx now) if they are
    linked; rank d received ``recv_splits[s]`` rows from s at dispatch and sends exactly those
    back if they are still linked. Requiring the dispatch's links too means that a rank
    unmasked between the dispatch and the combine sends nothing back (it received nothing) and
    is expected to send nothing.
    """
    num_ranks = group.size()
    device = expected_back.device
    header = torch.tensor(layout.recv_splits + [hidden], dtype=torch.int64, device="cpu")
    mine = torch.cat([expected_back.to(torch.int64).cpu(), header,
                      layout.links.to(torch.int64), _mask_row(rank_mask, num_ranks, device).cpu()])
    table = packing.all_gather_rows(group, mine.to(device))
    packing.check_same_on_all_ranks(table[:, 2 * num_ranks:2 * num_ranks + 1], ["hidden"], "low_latency_combine")
    dispatch_links = table[:, 2 * num_ranks + 1:3 * num_ranks + 1].bool()
    links = dispatch_links & dispatch_links.t() & links_from_masks(table[:, 3 * num_ranks + 1:])
    for source in range(num_ranks):
        for target in range(num_ranks):
            expected = int(table[source, target]) if links[source, target] else 0
            sent = int(table[target, num_ranks + source]) if links[target, source] else 0
            if expected != sent:
                raise InputError(
                    f"low_latency_combine: rank {source}'s topk_idx routes {expected} (token, expert) pairs to "
                    f"rank {target}, but the dispatch of this handle sent {sent}; pass the topk_idx (and "
                    f"handle) of that low_latency_dispatch")
    return links[group.rank()]


def combine(group: dist.ProcessGroup, source: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
            handle: LowLatencyHandle, return_recv_hook: bool, out: torch.Tensor | None,
            wait_stats: torch.Tensor | None = None,
            rank_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, Callable[[], None] | None]:
    """Return expert outputs to their tokens: ``out[t] = sum_k w[t, k] * y_{topk_idx[t, k]}(t)``.

    ``source`` [E_local, R*T, H] bf16 holds the expert outputs at the rows the dispatch filled.
    Each rank sends them back in arrival order; they reach the source in its own send order,
    which is recomputed from ``topk_idx`` to know the (token, k) of every returned row. One
    small all_gather first checks that every rank's topk_idx matches its dispatch (and brings
    the peers' masks: rows only travel between ranks linked at the dispatch and now).
    """
    layout: LowLatencyLayout = handle.backend_state
    if layout.recv_expert is None or layout.recv_row is None:
        raise InputError("low_latency_combine: the dispatch of this handle was not received yet; call its "
                         "recv hook first")
    num_experts, num_ranks = handle.num_experts, group.size()
    num_tokens, hidden = topk_idx.shape[0], source.shape[2]
    device = source.device
    token_index, slot_k, expert, counts = routing.low_latency_send_plan(topk_idx, num_experts, num_ranks)
    links = _check_combine(group, layout, counts.sum(1), hidden, rank_mask)
    recv_expert, recv_row = layout.recv_expert, layout.recv_row
    if not bool(links.all()):   # shrink mode: nothing travels to or from ranks we are not linked with
        kept_pairs = links.to(device)[expert // (num_experts // num_ranks)]
        token_index, slot_k = token_index[kept_pairs], slot_k[kept_pairs]
        row_source = torch.repeat_interleave(torch.arange(num_ranks, dtype=torch.int64, device="cpu"),
                                             torch.tensor(layout.recv_splits, dtype=torch.int64, device="cpu"))
        kept_rows = links[row_source].to(device)
        recv_expert, recv_row = recv_expert[kept_rows], recv_row[kept_rows]
    send_back = [count if linked else 0 for count, linked in zip(layout.recv_splits, links.tolist())]
    receive_back = [count if linked else 0 for count, linked in zip(layout.send_splits, links.tolist())]
    rows = source[recv_expert, recv_row]
    back, work = packing.all_to_all_rows(group, rows, send_back, receive_back, async_op=True)
    if out is None:
        out = torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device=device)
    result = out

    def finish() -> None:
        start = time.perf_counter_ns()
        work.wait()
        if wait_stats is not None:
            wait_stats.add_(links.to(wait_stats.device, torch.int64) * (time.perf_counter_ns() - start))
        weights = topk_weights[token_index, slot_k].unsqueeze(1)
        total = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=device)
        total.index_add_(0, token_index, back.float() * weights)
        result.copy_(total)

    if return_recv_hook:
        return result, finish
    finish()
    return result, None
