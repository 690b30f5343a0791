"""Send plan and count exchange for dispatch (DeepEP's notify_dispatch), in one program.

Part 1, the send plan (local): scanning ``is_token_in_rank`` once gives, for every
destination rank r, the list of tokens sent there in token order (``token_list[r]``) and for
every token its position in each list (``send_pos``, an exclusive prefix count; row N holds
the totals). The dispatch kernel gathers rows through ``token_list``; the combine kernel
finds returned rows through ``send_pos``. A cached dispatch reuses both.

Part 1 may also start from ``topk_idx`` itself (``FROM_TOPK``: a caller that has no use for
``get_dispatch_layout``'s three tensors, V2's fresh dispatch): what the layout kernel would give,
without its launch and two of its allocations on the host. The launch then has a program per
tile of tokens (``_layout_share``): each works out its tokens' ranks (a bit per rank of their
experts), writes their ``is_token_in_rank`` rows, and counts their ids per expert and those out
of range into its own row of the result's tail. The last program to finish goes on alone as
the one-program kernel does: it sums the rows and runs the send plan and the exchange. No
program waits for another, so the tiles need not run at once.

Part 2, the exchange: every rank writes its per-rank counts, the counts of the experts that
live on each peer, and a signature of the call (``SIGNATURE_NAMES``) into that peer's payload
slot, then releases the peer's flag for this rank. After acquiring all R flags a rank holds
the full count matrix and builds ``rank_prefix_matrix``, its per-expert receive counts, and
which signature words differ between ranks. Slots alternate between two parities, so a fast
rank's next exchange never overwrites a slot a slow peer has not read yet.

A dispatch whose host does not read the result at the call (``report_to_status``: one with
``num_worst_tokens``) would leave a disagreement unseen: the kernel writes it into the status
word instead, which the host reads, without a sync, when a later call starts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tritonep.backends.nvlink.memory import MAX_LOCAL_EXPERTS, SIGNATURE_WORDS, SymmetricBuffer
from tritonep.device.signals import fence_system, last_program_done, publish, store_relaxed, wait_at_least
from tritonep.device.status_codes import PHASE_DISAGREEMENT, PHASE_NOTIFY
from tritonep.runtime import kernel_names
from tritonep.runtime.launcher import FastLauncher, next_power_of_2
from tritonep.runtime.platform import GPU_KERNELS

# The host mailbox (int64, pinned): [flag = the exchange's epoch, result words...].
MAILBOX_HEADER = 1
_HEADER = tl.constexpr(MAILBOX_HEADER)

# What each signature word holds, for the host's messages. Word 4 is not compared: it carries a
# rank's out-of-range expert ids (``get_dispatch_layout`` counted them), summed over the ranks.
SIGNATURE_NAMES = ("hidden size (4-byte words)", "scale words", "top-k", "num_experts", None,
                   "num_max_tokens_per_rank")
INVALID_IDS_WORD = 4
_INVALID_IDS, _INVALID_IDS_BIT = tl.constexpr(INVALID_IDS_WORD), tl.constexpr(1 << INVALID_IDS_WORD)
# From topk_idx, a token's ranks are the bits of one int64.
MAX_FROM_TOPK_RANKS = 64
# From topk_idx: ids per tile of a program (as the layout kernel's tiles), and at most this many
# programs (each adds a row of counts for the last one to sum).
LAYOUT_TILE_IDS, MAX_LAYOUT_PROGRAMS = 4096, 32


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _token_ranks(topk_idx_ptr, tokens, num_tokens, num_topk, num_experts, experts_per_rank, ranks,
                 TOPK_PAD: tl.constexpr, ALL_EXPERTS_PAD: tl.constexpr):
    """From the tokens' top-k ids: [tokens, ranks] 1 where a token has an expert on that rank,
    the tile's ids per expert, and its ids outside [-1, E) (which land nowhere)."""
    slots = tl.arange(0, TOPK_PAD)
    mask = (tokens < num_tokens)[:, None] & (slots < num_topk)[None, :]
    ids = tl.load(topk_idx_ptr + tokens[:, None].to(tl.int64) * num_topk + slots[None, :], mask=mask, other=-1)
    valid = (ids >= 0) & (ids < num_experts)
    local = tl.where(valid, ids, -1).to(tl.int32)   # (32-bit division: a 64-bit one is emulated, and slow)
    # One bit per destination rank, so that two experts on one rank count the token once.
    one = tl.full(local.shape, 1, tl.int64)
    rank_bits = tl.reduce(tl.where(valid, one << (tl.maximum(local, 0) // experts_per_rank).to(tl.int64), 0), 1, _or)
    in_rank = ((rank_bits[:, None] >> ranks[None, :].to(tl.int64)) & 1).to(tl.int32)
    flat = tl.reshape(local, [local.shape[0] * TOPK_PAD], can_reorder=True)
    expert_hits = tl.histogram(tl.maximum(flat, 0), ALL_EXPERTS_PAD, mask=flat >= 0)
    bad = tl.sum(tl.sum(((ids < -1) | (ids >= num_experts)).to(tl.int32), axis=1), axis=0)
    return in_rank, expert_hits, bad


@triton.jit
def _expert_counts_word(NUM_RANKS: tl.constexpr, experts_per_rank):
    """Where a FROM_TOPK exchange keeps its per-expert counts in its result (``result_words``);
    the programs' rows (``ALL_EXPERTS_PAD`` counts, then the ids out of range) follow."""
    return NUM_RANKS * NUM_RANKS + experts_per_rank + 2 + NUM_RANKS * experts_per_rank


@triton.jit
def _layout_share(topk_idx_ptr, is_token_in_rank_ptr, rows_ptr, done_ptr, num_tokens, num_topk, num_experts,
                  experts_per_rank, NUM_RANKS: tl.constexpr, RANKS_PAD: tl.constexpr, LAYOUT_T: tl.constexpr,
                  TOPK_PAD: tl.constexpr, ALL_EXPERTS_PAD: tl.constexpr):
    """This program's tiles of tokens (``LAYOUT_T`` each, every num_programs-th): their rows of
    ``is_token_in_rank``, and into ``rows_ptr``'s row for this program their ids per expert and
    those out of range. Returns whether this program finished last (``last_program_done``)."""
    ranks = tl.arange(0, RANKS_PAD)
    per_expert = tl.zeros([ALL_EXPERTS_PAD], dtype=tl.int32)
    bad = tl.zeros((), dtype=tl.int32)
    for t0 in range(tl.program_id(0) * LAYOUT_T, num_tokens, tl.num_programs(0) * LAYOUT_T):
        tokens = t0 + tl.arange(0, LAYOUT_T)
        in_rank, expert_hits, tile_bad = _token_ranks(topk_idx_ptr, tokens, num_tokens, num_topk, num_experts,
                                                      experts_per_rank, ranks, TOPK_PAD, ALL_EXPERTS_PAD)
        tl.store(is_token_in_rank_ptr + tokens[:, None].to(tl.int64) * NUM_RANKS + ranks[None, :], in_rank != 0,
                 mask=(tokens < num_tokens)[:, None] & (ranks < NUM_RANKS)[None, :])
        per_expert += expert_hits
        bad += tile_bad
    row = rows_ptr + tl.program_id(0) * (ALL_EXPERTS_PAD + 1)
    tl.store(row + tl.arange(0, ALL_EXPERTS_PAD), per_expert)
    tl.store(row + ALL_EXPERTS_PAD, bad)
    return last_program_done(done_ptr)


@triton.jit
def _sum_layout_rows(rows_ptr, counts_ptr, num_experts, ALL_EXPERTS_PAD: tl.constexpr):
    """The last program: every program's ids per expert into ``counts_ptr``; returns the ids out
    of range. (L2 loads: the rows were written on other SMs.)"""
    all_experts = tl.arange(0, ALL_EXPERTS_PAD)
    per_expert = tl.zeros([ALL_EXPERTS_PAD], dtype=tl.int32)
    bad = tl.zeros((), dtype=tl.int32)
    for p in range(0, tl.num_programs(0)):
        row = rows_ptr + p * (ALL_EXPERTS_PAD + 1)
        per_expert += tl.load(row + all_experts, cache_modifier=".cg")
        bad += tl.load(row + ALL_EXPERTS_PAD, cache_modifier=".cg")
    tl.store(counts_ptr + all_experts, per_expert, mask=all_experts < num_experts)
    tl.debug_barrier()   # every thread reads slices of the counts next
    return bad


@kernel_names.jit("tritonep::intranode::notify_counts",
                  do_not_specialize=["num_tokens", "notify_epoch", "rank", "experts_per_rank", "timeout_ns",
                                     "hidden_words", "scale_words", "num_topk", "num_experts", "max_tokens_per_rank",
                                     "report_to_status"])
def notify_dispatch_kernel(
    is_token_in_rank_ptr, topk_idx_ptr, num_tokens, num_tokens_per_expert_ptr, hidden_words, scale_words, num_topk,
    num_experts, max_tokens_per_rank, report_to_status, invalid_ids_ptr,
    token_list_ptr, token_list_stride, send_pos_ptr, result_ptr, host_result_ptr,
    peer_base_ptrs, rank, notify_epoch, experts_per_rank, status_ptr, timeout_ns, layout_done_ptr,
    NOTIFY_FLAG_WORD: tl.constexpr, PAYLOAD_BYTE_OFFSET: tl.constexpr, PAYLOAD_WORDS: tl.constexpr,
    EXPERT_WORDS: tl.constexpr, SIGNATURE: tl.constexpr,
    NUM_RANKS: tl.constexpr, RANKS_PAD: tl.constexpr, EXPERTS_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    EXCHANGE: tl.constexpr, FROM_TOPK: tl.constexpr, LAYOUT_T: tl.constexpr, TOPK_PAD: tl.constexpr,
    ALL_EXPERTS_PAD: tl.constexpr, GPU: tl.constexpr,
):
    go = True
    if FROM_TOPK:   # (each program its tiles; the last one goes on)
        counts_ptr = result_ptr + _expert_counts_word(NUM_RANKS, experts_per_rank)
        rows_ptr = counts_ptr + num_experts
        go = _layout_share(topk_idx_ptr, is_token_in_rank_ptr, rows_ptr, layout_done_ptr, num_tokens, num_topk,
                           num_experts, experts_per_rank, NUM_RANKS, RANKS_PAD, LAYOUT_T, TOPK_PAD, ALL_EXPERTS_PAD)
    if go:
        _send_plan_and_exchange(
            is_token_in_rank_ptr, num_tokens, num_tokens_per_expert_ptr, hidden_words, scale_words, num_topk,
            num_experts, max_tokens_per_rank, report_to_status, invalid_ids_ptr, token_list_ptr, token_list_stride,
            send_pos_ptr, result_ptr, host_result_ptr, peer_base_ptrs, rank, notify_epoch, experts_per_rank,
            status_ptr, timeout_ns, NOTIFY_FLAG_WORD, PAYLOAD_BYTE_OFFSET, PAYLOAD_WORDS, EXPERT_WORDS, SIGNATURE,
            NUM_RANKS, RANKS_PAD, EXPERTS_PAD, BLOCK_T, EXCHANGE, FROM_TOPK, ALL_EXPERTS_PAD, GPU)


@triton.jit
def _send_plan_and_exchange(
    is_token_in_rank_ptr, num_tokens, num_tokens_per_expert_ptr, hidden_words, scale_words, num_topk, num_experts,
    max_tokens_per_rank, report_to_status, invalid_ids_ptr,
    token_list_ptr, token_list_stride, send_pos_ptr, result_ptr, host_result_ptr,
    peer_base_ptrs, rank, notify_epoch, experts_per_rank, status_ptr, timeout_ns,
    NOTIFY_FLAG_WORD: tl.constexpr, PAYLOAD_BYTE_OFFSET: tl.constexpr, PAYLOAD_WORDS: tl.constexpr,
    EXPERT_WORDS: tl.constexpr, SIGNATURE: tl.constexpr,
    NUM_RANKS: tl.constexpr, RANKS_PAD: tl.constexpr, EXPERTS_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    EXCHANGE: tl.constexpr, FROM_TOPK: tl.constexpr, ALL_EXPERTS_PAD: tl.constexpr, GPU: tl.constexpr,
):
    """The one program's work: parts 1 and 2 of the module's docstring."""
    ranks = tl.arange(0, RANKS_PAD)
    rank_mask = ranks < NUM_RANKS

    # ---- part 1: send plan ------------------------------------------------------------
    carry = tl.zeros([RANKS_PAD], dtype=tl.int32)
    for t0 in range(0, num_tokens, BLOCK_T):
        tokens = t0 + tl.arange(0, BLOCK_T)
        mask = (tokens < num_tokens)[:, None] & rank_mask[None, :]
        offsets = tokens[:, None].to(tl.int64) * NUM_RANKS + ranks[None, :]
        # (L2 loads: from topk_idx, other programs of the launch wrote most rows)
        in_rank = tl.load(is_token_in_rank_ptr + offsets, mask=mask, other=0, cache_modifier=".cg").to(tl.int32)
        position = carry[None, :] + tl.cumsum(in_rank, axis=0) - in_rank
        tl.store(send_pos_ptr + offsets, position, mask=mask)
        tl.store(token_list_ptr + ranks[None, :].to(tl.int64) * token_list_stride + position,
                 tokens[:, None] + 0 * position, mask=mask & (in_rank != 0))
        carry += tl.sum(in_rank, axis=0)
    tl.store(send_pos_ptr + num_tokens.to(tl.int64) * NUM_RANKS + ranks, carry, mask=rank_mask)

    if EXCHANGE:
        # ---- part 2: write my counts into every rank's slot, then release its flag --------
        parity = notify_epoch % 2
        experts = tl.arange(0, EXPERTS_PAD)
        expert_mask = experts < experts_per_rank
        # The call's signature (SIGNATURE_NAMES), then zeros.
        words = tl.arange(0, SIGNATURE)
        invalid_ids = tl.load(invalid_ids_ptr)
        if FROM_TOPK:
            # The counts go through the result's tail (``result_words``): each peer's slice is read
            # back by every thread below, which a register tensor cannot give.
            num_tokens_per_expert_ptr = result_ptr + _expert_counts_word(NUM_RANKS, experts_per_rank)
            invalid_ids += _sum_layout_rows(num_tokens_per_expert_ptr + num_experts, num_tokens_per_expert_ptr,
                                            num_experts, ALL_EXPERTS_PAD)
        signature = tl.where(words == 0, hidden_words, tl.where(words == 1, scale_words, tl.where(
            words == 2, num_topk, tl.where(words == 3, num_experts, tl.where(
                words == _INVALID_IDS, invalid_ids, tl.where(words == 5, max_tokens_per_rank, 0))))))
        for r in range(0, NUM_RANKS):
            peer_base = tl.load(peer_base_ptrs + r)
            slot = (peer_base + PAYLOAD_BYTE_OFFSET).to(tl.pointer_type(tl.int32)) \
                + (parity * NUM_RANKS + rank) * PAYLOAD_WORDS
            tl.store(slot + ranks, carry, mask=rank_mask)
            peer_experts = tl.load(num_tokens_per_expert_ptr + r * experts_per_rank + experts, mask=expert_mask)
            tl.store(slot + NUM_RANKS + experts, peer_experts, mask=expert_mask)
            tl.store(slot + NUM_RANKS + EXPERT_WORDS + words, signature)
            publish(peer_base.to(tl.pointer_type(tl.int64)) + NOTIFY_FLAG_WORD + rank, notify_epoch.to(tl.int64))

        # ---- wait for every source, then read the full count matrix ----------------------
        my_base = tl.load(peer_base_ptrs + rank)
        my_flags = my_base.to(tl.pointer_type(tl.int64)) + NOTIFY_FLAG_WORD
        for s in range(0, NUM_RANKS):
            wait_at_least(my_flags + s, notify_epoch.to(tl.int64), status_ptr, timeout_ns, PHASE_NOTIFY, s, GPU)
        slots = (my_base + PAYLOAD_BYTE_OFFSET).to(tl.pointer_type(tl.int32)) + parity * NUM_RANKS * PAYLOAD_WORDS
        sources = tl.arange(0, RANKS_PAD)
        source_mask = sources < NUM_RANKS
        matrix_mask = source_mask[:, None] & rank_mask[None, :]
        count_matrix = tl.load(slots + sources[:, None] * PAYLOAD_WORDS + ranks[None, :], mask=matrix_mask,
                               other=0, cache_modifier=".cv")
        prefix = tl.cumsum(count_matrix, axis=0)
        tl.store(result_ptr + sources[:, None] * NUM_RANKS + ranks[None, :], prefix, mask=matrix_mask)
        received = tl.load(slots + sources[:, None] * PAYLOAD_WORDS + NUM_RANKS + experts[None, :],
                           mask=source_mask[:, None] & expert_mask[None, :], other=0, cache_modifier=".cv")
        tl.store(result_ptr + NUM_RANKS * NUM_RANKS + experts, tl.sum(received, axis=0), mask=expert_mask)
        # Per source and local expert, the pairs received from sources 0..s (an inclusive prefix,
        # like rank_prefix_matrix): where each source's pairs start in an expert's expanded block.
        tl.store(result_ptr + NUM_RANKS * NUM_RANKS + experts_per_rank + 2 + sources[:, None] * experts_per_rank
                 + experts[None, :], tl.cumsum(received, axis=0), mask=source_mask[:, None] & expert_mask[None, :])
        signatures = tl.load(slots + sources[:, None] * PAYLOAD_WORDS + NUM_RANKS + EXPERT_WORDS + words[None, :],
                             mask=source_mask[:, None], other=0, cache_modifier=".cv")
        # Bit w set: some rank's signature word w differs from this rank's. Every rank sees the
        # same words, so every rank finds a disagreement alike.
        differs = (signatures != signature[None, :]) & source_mask[:, None] & (words != _INVALID_IDS)[None, :]
        differing_words = tl.sum(tl.max(differs.to(tl.int32), axis=0) << words, axis=0)
        tl.store(result_ptr + NUM_RANKS * NUM_RANKS + experts_per_rank, differing_words)
        # A rank's out-of-range expert ids: any rank with some stops every rank.
        invalid = tl.sum(tl.sum(tl.where(words[None, :] == _INVALID_IDS, signatures, 0), axis=1), axis=0)
        tl.store(result_ptr + NUM_RANKS * NUM_RANKS + experts_per_rank + 1, invalid)

        # ---- the same words into the host's mailbox (pinned memory), then its flag ----------
        # The host polls the flag instead of queuing a copy and waiting on an event: the
        # counts reach it a copy launch and an event round trip sooner. (A timed-out wait above
        # wrote the status word, host memory too, before this fence.)
        host_words = host_result_ptr + _HEADER
        tl.store(host_words + sources[:, None] * NUM_RANKS + ranks[None, :], prefix.to(tl.int64), mask=matrix_mask)
        tl.store(host_words + NUM_RANKS * NUM_RANKS + experts, tl.sum(received, axis=0).to(tl.int64), mask=expert_mask)
        tl.store(host_words + NUM_RANKS * NUM_RANKS + experts_per_rank, differing_words.to(tl.int64))
        tl.store(host_words + NUM_RANKS * NUM_RANKS + experts_per_rank + 1, invalid.to(tl.int64))
        # Out-of-range ids set the bit of their word: the status word names both problems.
        problems = differing_words | tl.where(invalid != 0, _INVALID_IDS_BIT, 0)
        if (report_to_status != 0) & (problems != 0):
            tl.store(status_ptr, (problems + PHASE_DISAGREEMENT * 65536 + 1).to(tl.int64))
        fence_system(GPU)
        store_relaxed(host_result_ptr, notify_epoch.to(tl.int64), GPU)


# Per call only these change; the rest (this rank's memory, status, time-out) is fixed per
# engine, which the caller's ``owner`` key stands for.
_NOTIFY = FastLauncher(notify_dispatch_kernel, changing=(
    "is_token_in_rank_ptr", "topk_idx_ptr", "num_tokens", "num_tokens_per_expert_ptr", "hidden_words", "scale_words",
    "num_topk", "num_experts", "max_tokens_per_rank", "report_to_status", "token_list_ptr", "token_list_stride",
    "send_pos_ptr", "result_ptr", "notify_epoch", "experts_per_rank"))


def layout_programs(num_tokens: int, num_topk: int) -> tuple[int, int]:
    """A FROM_TOPK launch's tile of tokens and its programs: a tile per program, as many as the
    tokens fill (at most ``MAX_LAYOUT_PROGRAMS``)."""
    tile = min(max(16, LAYOUT_TILE_IDS // next_power_of_2(num_topk)), next_power_of_2(max(num_tokens, 1)))
    return tile, max(1, min(MAX_LAYOUT_PROGRAMS, -(-num_tokens // tile)))


def check_word(num_ranks: int, experts_per_rank: int) -> int:
    """Where the exchange's two check words (the bitmask of differing signature words, the
    out-of-range ids) sit in its result."""
    return num_ranks * num_ranks + experts_per_rank


def source_expert_word(num_ranks: int, experts_per_rank: int) -> int:
    """Where the per-source, per-local-expert prefix [R, E/R] starts in the exchange's result."""
    return check_word(num_ranks, experts_per_rank) + 2


def result_words(num_ranks: int, experts_per_rank: int, num_experts: int = 0, programs: int = 0) -> int:
    """Words of an exchange's result (``notify_dispatch``). From ``topk_idx``, ``num_experts``
    counts and a row per program follow (``_expert_counts_word``)."""
    rows = programs * (next_power_of_2(num_experts) + 1) if programs else 0
    return source_expert_word(num_ranks, experts_per_rank) + num_ranks * experts_per_rank + num_experts + rows


def mailbox_words(num_ranks: int) -> int:
    """Size of the host mailbox ``notify_dispatch`` writes: header, then the largest result."""
    return MAILBOX_HEADER + num_ranks * num_ranks + MAX_LOCAL_EXPERTS + 2


def notify_dispatch(
    memory: SymmetricBuffer,
    is_token_in_rank: torch.Tensor | None,
    topk_idx: torch.Tensor | None,
    num_tokens_per_expert: torch.Tensor | None,
    signature: tuple[int, int, int, int, int],
    report_to_status: bool,
    invalid_ids: torch.Tensor,
    notify_epoch: int,
    status: torch.Tensor,
    timeout_ns: int,
    mailbox: torch.Tensor,
    layout_done: torch.Tensor,
    owner: object,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Returns ``(token_list [R, N] int32, send_pos [N+1, R] int32, result, is_token_in_rank)``.

    The routing comes as ``get_dispatch_layout``'s ``is_token_in_rank`` and
    ``num_tokens_per_expert``, or, with ``is_token_in_rank`` None, as ``topk_idx`` itself (int64
    [N, K], contiguous; at most ``MAX_FROM_TOPK_RANKS`` ranks): the kernel then works both out
    (``FROM_TOPK``), returns the ``is_token_in_rank`` it wrote, and counts the ids outside
    [-1, E) with those of ``invalid_ids``.
    ``signature``: (hidden in 4-byte words, scale words, top-k, experts, T) of this call; with
    the out-of-range ids counted so far (``invalid_ids``, int32 [1]) it goes to every peer.
    ``report_to_status``: the host will not read the result at this call, so a disagreement or
    out-of-range ids go into ``status`` too (``PHASE_DISAGREEMENT``).

    ``result`` (int32, None without exchange) holds ``rank_prefix_matrix`` (R*R), the
    per-local-expert receive counts (E/R), the bitmask of signature words that differ, the
    out-of-range expert ids counted over all ranks (these two from ``check_word``), and, from
    ``source_expert_word``, [s, e]: the (token, k) pairs of local expert e that sources 0..s
    send (R * E/R); from ``topk_idx``, this rank's ids per expert (E) follow. The kernel also
    writes the words before ``source_expert_word`` into ``mailbox`` (int64, pinned host memory of
    ``mailbox_words(R)``) from word 1, and then ``notify_epoch`` into word 0.
    ``layout_done``: int64 [1], zero between launches: a FROM_TOPK launch's programs count
    themselves done there (``last_program_done``).
    ``owner``: a key that stands for ``memory``, ``invalid_ids``, ``status``, ``timeout_ns``,
    ``mailbox`` and ``layout_done`` (equal keys promise equal values), so a repeated launch converts
    only the rest.
    Without ``num_tokens_per_expert`` (nor ``topk_idx``) only the send plan is built (no
    communication).
    """
    num_ranks, num_experts = memory.num_ranks, signature[3]
    from_topk = is_token_in_rank is None
    routing = topk_idx if from_topk else is_token_in_rank
    assert routing is not None
    num_tokens = routing.shape[0]
    exchange = from_topk or num_tokens_per_expert is not None
    experts_per_rank = num_experts // num_ranks if exchange else 0
    if experts_per_rank > MAX_LOCAL_EXPERTS:
        raise ValueError(f"at most {MAX_LOCAL_EXPERTS} experts per rank are supported, got {experts_per_rank}")
    if from_topk and num_ranks > MAX_FROM_TOPK_RANKS:
        raise ValueError(f"the count exchange works out the layout itself for at most {MAX_FROM_TOPK_RANKS} ranks")
    # Separate allocations: carving them out of one takes longer on the host (slicing and viewing
    # a tensor costs more than allocating one).
    device = routing.device
    # From topk_idx: the tile and programs of the layout's share, and the result's tail for them.
    layout_t = programs = topk_pad = all_experts_pad = 1
    tail_experts = tail_programs = 0
    if from_topk:
        is_token_in_rank = torch.empty(num_tokens, num_ranks, dtype=torch.bool, device=device)
        num_topk = routing.shape[1]
        layout_t, programs = layout_programs(num_tokens, num_topk)
        topk_pad, all_experts_pad = next_power_of_2(num_topk), next_power_of_2(num_experts)
        tail_experts, tail_programs = num_experts, programs
    token_list = torch.empty(num_ranks, max(num_tokens, 1), dtype=torch.int32, device=device)
    send_pos = torch.empty(num_tokens + 1, num_ranks, dtype=torch.int32, device=device)
    result = torch.empty(result_words(num_ranks, experts_per_rank, tail_experts, tail_programs),
                         dtype=torch.int32, device=device) if exchange else None
    block_t = min(1024, next_power_of_2(num_tokens))
    experts_pad = next_power_of_2(experts_per_rank)

    def constants() -> dict:   # made only when the setup is new (FastLauncher)
        layout = memory.signals
        return dict(
            NOTIFY_FLAG_WORD=layout.notify_flag, PAYLOAD_BYTE_OFFSET=layout.notify_payload * 8,
            PAYLOAD_WORDS=layout.payload_words, EXPERT_WORDS=MAX_LOCAL_EXPERTS, SIGNATURE=SIGNATURE_WORDS,
            NUM_RANKS=num_ranks, RANKS_PAD=triton.next_power_of_2(num_ranks), EXPERTS_PAD=experts_pad,
            BLOCK_T=block_t, EXCHANGE=exchange, FROM_TOPK=from_topk, LAYOUT_T=layout_t, TOPK_PAD=topk_pad,
            ALL_EXPERTS_PAD=all_experts_pad, GPU=GPU_KERNELS)

    _NOTIFY(programs, (owner, block_t, experts_pad, exchange, from_topk, layout_t, topk_pad, all_experts_pad), (
        is_token_in_rank, topk_idx if from_topk else send_pos, num_tokens,
        num_tokens_per_expert if num_tokens_per_expert is not None else send_pos, *signature,
        int(report_to_status), invalid_ids,
        token_list, token_list.stride(0), send_pos, result if exchange else send_pos, mailbox,
        memory.peer_base_ptrs, memory.rank, notify_epoch, max(experts_per_rank, 1), status, timeout_ns, layout_done,
    ), constants, 8)
    return token_list, send_pos, result, is_token_in_rank
