"""Send plan and count exchange for dispatch (DeepEP's notify_dispatch), in one program.

Part 1, the send plan (local): scanning ``is_token_in_rank`` once gives, for every
destination rank r, the list of tokens sent there in token order (``token_list[r]``) and for
every token its position in each list (``send_pos``, an exclusive prefix count; row N holds
the totals). The dispatch kernel gathers rows through ``token_list``; the combine kernel
finds returned rows through ``send_pos``. A cached dispatch reuses both.

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
from tritonep.device.signals import fence_system, publish, store_relaxed, wait_at_least
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


@kernel_names.jit("tritonep::intranode::notify_counts",
                  do_not_specialize=["num_tokens", "notify_epoch", "rank", "experts_per_rank", "timeout_ns",
                                     "hidden_words", "scale_words", "num_topk", "num_experts", "max_tokens_per_rank",
                                     "report_to_status"])
def notify_dispatch_kernel(
    is_token_in_rank_ptr, num_tokens, num_tokens_per_expert_ptr, hidden_words, scale_words, num_topk, num_experts,
    max_tokens_per_rank, report_to_status, invalid_ids_ptr,
    token_list_ptr, token_list_stride, send_pos_ptr, result_ptr, host_result_ptr,
    peer_base_ptrs, rank, notify_epoch, experts_per_rank, status_ptr, timeout_ns,
    NOTIFY_FLAG_WORD: tl.constexpr, PAYLOAD_BYTE_OFFSET: tl.constexpr, PAYLOAD_WORDS: tl.constexpr,
    EXPERT_WORDS: tl.constexpr, SIGNATURE: tl.constexpr,
    NUM_RANKS: tl.constexpr, RANKS_PAD: tl.constexpr, EXPERTS_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    EXCHANGE: tl.constexpr, GPU: tl.constexpr,
):
    ranks = tl.arange(0, RANKS_PAD)
    rank_mask = ranks < NUM_RANKS

    # ---- part 1: send plan ------------------------------------------------------------
    carry = tl.zeros([RANKS_PAD], dtype=tl.int32)
    for t0 in range(0, num_tokens, BLOCK_T):
        tokens = t0 + tl.arange(0, BLOCK_T)
        mask = (tokens < num_tokens)[:, None] & rank_mask[None, :]
        offsets = tokens[:, None].to(tl.int64) * NUM_RANKS + ranks[None, :]
        in_rank = tl.load(is_token_in_rank_ptr + offsets, mask=mask, other=0).to(tl.int32)
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
    "is_token_in_rank_ptr", "num_tokens", "num_tokens_per_expert_ptr", "hidden_words", "scale_words", "num_topk",
    "num_experts", "max_tokens_per_rank", "report_to_status", "token_list_ptr", "token_list_stride", "send_pos_ptr",
    "result_ptr", "notify_epoch", "experts_per_rank"))


def check_word(num_ranks: int, experts_per_rank: int) -> int:
    """Where the exchange's two check words (the bitmask of differing signature words, the
    out-of-range ids) sit in its result."""
    return num_ranks * num_ranks + experts_per_rank


def source_expert_word(num_ranks: int, experts_per_rank: int) -> int:
    """Where the per-source, per-local-expert prefix [R, E/R] starts in the exchange's result."""
    return check_word(num_ranks, experts_per_rank) + 2


def mailbox_words(num_ranks: int) -> int:
    """Size of the host mailbox ``notify_dispatch`` writes: header, then the largest result."""
    return MAILBOX_HEADER + num_ranks * num_ranks + MAX_LOCAL_EXPERTS + 2


def notify_dispatch(
    memory: SymmetricBuffer,
    is_token_in_rank: torch.Tensor,
    num_tokens_per_expert: torch.Tensor | None,
    signature: tuple[int, int, int, int, int],
    report_to_status: bool,
    invalid_ids: torch.Tensor,
    notify_epoch: int,
    status: torch.Tensor,
    timeout_ns: int,
    mailbox: torch.Tensor,
    owner: object,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Returns ``(token_list [R, N] int32, send_pos [N+1, R] int32, result)``.

    ``signature``: (hidden in 4-byte words, scale words, top-k, experts, T) of this call; with
    the out-of-range ids counted so far (``invalid_ids``, int32 [1]) it goes to every peer.
    ``report_to_status``: the host will not read the result at this call, so a disagreement or
    out-of-range ids go into ``status`` too (``PHASE_DISAGREEMENT``).

    ``result`` (int32, None without exchange) holds ``rank_prefix_matrix`` (R*R), the
    per-local-expert receive counts (E/R), the bitmask of signature words that differ, the
    out-of-range expert ids counted over all ranks (these two from ``check_word``), and, from
    ``source_expert_word``, [s, e]: the (token, k) pairs of local expert e that sources 0..s
    send (R * E/R). The kernel also writes all but the last into ``mailbox`` (int64, pinned host
    memory of ``mailbox_words(R)``) from word 1, and then ``notify_epoch`` into word 0.
    ``owner``: a key that stands for ``memory``, ``invalid_ids``, ``status``, ``timeout_ns`` and
    ``mailbox`` (equal keys promise equal values), so a repeated launch converts only the rest.
    Without ``num_tokens_per_expert`` only the send plan is built (no communication).
    """
    num_tokens, num_ranks = is_token_in_rank.shape
    exchange = num_tokens_per_expert is not None
    experts_per_rank = num_tokens_per_expert.shape[0] // num_ranks if exchange else 0
    if experts_per_rank > MAX_LOCAL_EXPERTS:
        raise ValueError(f"at most {MAX_LOCAL_EXPERTS} experts per rank are supported, got {experts_per_rank}")
    # Three allocations: carving them out of one takes longer on the host (slicing and viewing a
    # tensor costs more than allocating one).
    device = is_token_in_rank.device
    token_list = torch.empty(num_ranks, max(num_tokens, 1), dtype=torch.int32, device=device)
    send_pos = torch.empty(num_tokens + 1, num_ranks, dtype=torch.int32, device=device)
    result = torch.empty(source_expert_word(num_ranks, experts_per_rank) + num_ranks * experts_per_rank,
                         dtype=torch.int32, device=device) if exchange else None
    block_t = min(1024, next_power_of_2(num_tokens))
    experts_pad = next_power_of_2(experts_per_rank)

    def constants() -> dict:   # made only when the setup is new (FastLauncher)
        layout = memory.signals
        return dict(
            NOTIFY_FLAG_WORD=layout.notify_flag, PAYLOAD_BYTE_OFFSET=layout.notify_payload * 8,
            PAYLOAD_WORDS=layout.payload_words, EXPERT_WORDS=MAX_LOCAL_EXPERTS, SIGNATURE=SIGNATURE_WORDS,
            NUM_RANKS=num_ranks, RANKS_PAD=triton.next_power_of_2(num_ranks), EXPERTS_PAD=experts_pad,
            BLOCK_T=block_t, EXCHANGE=exchange, GPU=GPU_KERNELS)

    _NOTIFY(1, (owner, block_t, experts_pad, exchange), (
        is_token_in_rank, num_tokens, num_tokens_per_expert if exchange else send_pos, *signature,
        int(report_to_status), invalid_ids,
        token_list, token_list.stride(0), send_pos, result if exchange else send_pos, mailbox,
        memory.peer_base_ptrs, memory.rank, notify_epoch, max(experts_per_rank, 1), status, timeout_ns,
    ), constants, 8)
    return token_list, send_pos, result
