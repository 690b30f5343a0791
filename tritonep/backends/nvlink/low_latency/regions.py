"""Where the low-latency path keeps things in its symmetric allocation (``num_rdma_bytes``).

Plain Python (the CPU front end sizes buffers with it); kernels wrap the word indices
in ``tl.constexpr``. All offsets are bytes from the start of the area. The control block has a fixed size, so
calls with different (T, hidden, E) on one Buffer agree on it; the data regions after it are
sized per call (every rank makes the same call, so every rank computes the same offsets).

Control block (int64 words). Calls alternate between two slots; the host picks the slot
(``call % 2``), the GPU counts the uses of each slot, so a captured graph that replays a call
keeps counting and receive hooks may run in any order:
  ``SEQUENCE + 4*kind + 2*direction + slot``
                     uses of the slot finished on this rank (kind 0 dispatch, 1 combine;
                     direction 0 sent, 1 received).
  ``DONE + 2*kind + direction``
                     programs of the running launch that finished (``last_program_done``).
  ``DONE + 4``       programs of the running dispatch send that wrote all their rows.
  ``DONE + 5``       a word that stores aimed at masked ranks go to instead (never read).
  ``DISPATCH_FREED + slot*MAX_RANKS + r`` (and ``COMBINE_FREED``)
                     uses of the slot that rank r finished receiving: r writes them into every
                     peer it does not mask. A sender starting use n of a slot waits there for
                     the use in ``SENT_USE`` (n-1 without masks).
  ``DISPATCH_FLAGS + slot*MAX_EXPERTS + e*R + s``
                     ``(use << 32) | rows`` written by source s once its rows for local
                     expert e are in this rank's receive slot. (Slots are MAX_EXPERTS apart so
                     that calls with different E never read each other's flags: uses of one
                     slot only grow, but the two slots count separately.)
  ``COMBINE_FLAGS + slot*MAX_EXPERTS + g``
                     use number written by expert g's rank once its rows for this rank
                     (the source of the tokens) are in this rank's combine slot.
  ``SENT_USE + 2*MAX_RANKS*kind + slot*MAX_RANKS + r``
                     the last use of the slot in which this rank wrote into rank r (shrink
                     mode skips masked ranks, so this can lag the slot's use count). A sender
                     waits for r's ``FREED`` word to reach it before writing into r again.
  ``DISPATCH_COUNTS + slot*MAX_EXPERTS + g``
                     ``(use << 32) | rows`` this rank sends to global expert g, staged by the
                     dispatch send's programs for its last program, which raises the flags.
  ``BARRIER + r``, ``BARRIER_SENT + r``
                     clean_low_latency_buffer's barriers: how many barriers rank r held with
                     this rank (r writes it here), and how many this rank held with r (masked
                     ranks are skipped, so the counts are per pair). Cleaning zeroes every word
                     before ``CLEAN_END`` but not these, so the barrier survives it. (Nor the staged
                     counts: every dispatch writes them before it reads them.)

Data regions, two slots each:
  dispatch receive  [E/R, R, T] messages: the row (e4m3 bytes or bf16), then fp8 scales,
                    then (token, k), padded to 16 bytes;
  combine receive   [T, MAX_TOPK] bf16 rows: expert outputs for (token, k) of this rank;
  zero-copy buffers [E/R, R*T, hidden] bf16 (``get_next_low_latency_combine_buffer``);
  dispatch send     [T] messages: with NVSHMEM, where a token's message is put from (a put's
                    source lies in the sender's heap). The combine's puts send from the
                    zero-copy buffers, as DeepEP's do.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_RANKS = 64
MAX_EXPERTS = 2048
MAX_TOPK = 11

SEQUENCE = 0
DONE = 8
DISPATCH_FREED = 16
COMBINE_FREED = DISPATCH_FREED + 2 * MAX_RANKS
DISPATCH_FLAGS = COMBINE_FREED + 2 * MAX_RANKS
COMBINE_FLAGS = DISPATCH_FLAGS + 2 * MAX_EXPERTS
SENT_USE = COMBINE_FLAGS + 2 * MAX_EXPERTS
CLEAN_END = SENT_USE + 4 * MAX_RANKS
BARRIER = CLEAN_END
BARRIER_SENT = BARRIER + MAX_RANKS
DISPATCH_COUNTS = BARRIER_SENT + MAX_RANKS
CONTROL_BYTES = (DISPATCH_COUNTS + 2 * MAX_EXPERTS) * 8 // 4096 * 4096 + 4096


def message_words(hidden: int, use_fp8: bool) -> tuple[int, int, int]:
    """(data words, scale words, message words) of one dispatch message, in int32 words."""
    data = hidden // 4 if use_fp8 else hidden // 2
    scales = hidden // 128 if use_fp8 else 0
    return data, scales, (data + scales + 2 + 3) // 4 * 4


@dataclass(frozen=True)
class LowLatencyRegions:
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_ranks: int
    num_experts: int

    @property
    def dispatch_slot_bytes(self) -> int:   # sized for bf16 messages, the larger kind
        _, _, words = message_words(self.hidden, False)
        return self.num_experts * self.num_max_dispatch_tokens_per_rank * words * 4

    @property
    def combine_slot_bytes(self) -> int:
        return self.num_max_dispatch_tokens_per_rank * MAX_TOPK * self.hidden * 2

    @property
    def zero_copy_bytes(self) -> int:
        return self.num_experts * self.num_max_dispatch_tokens_per_rank * self.hidden * 2

    @property
    def dispatch_offset(self) -> int:
        return CONTROL_BYTES

    @property
    def combine_offset(self) -> int:
        return self.dispatch_offset + 2 * self.dispatch_slot_bytes

    @property
    def zero_copy_offset(self) -> int:
        return self.combine_offset + 2 * self.combine_slot_bytes

    @property
    def dispatch_send_bytes(self) -> int:
        _, _, words = message_words(self.hidden, False)
        return self.num_max_dispatch_tokens_per_rank * words * 4

    @property
    def dispatch_send_offset(self) -> int:
        return self.zero_copy_offset + 2 * self.zero_copy_bytes

    @property
    def total_bytes(self) -> int:
        return self.dispatch_send_offset + 2 * self.dispatch_send_bytes
