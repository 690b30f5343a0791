"""The count exchange's host side: its launch, its result in host memory, and the checks on it.

A fresh dispatch starts with the count exchange (``notify_kernel.py``): every rank learns how
many rows every rank sends where. The kernel writes the result into a pinned host mailbox and
then the mailbox's flag word, which the host polls: the counts reach it a copy launch and an
event round trip sooner than through a copy it would wait for. Every rank holds the same result,
so the checks made on it (ranks that disagree on the call, out-of-range expert ids, more rows
than staging holds, a ``num_worst_tokens`` too small) raise on every rank at the same call.

A ``num_worst_tokens`` dispatch does not wait for its result. Its disagreements reach the host
through the status word (``status_error``), read without a sync when a later call starts. Its
received counts are checked against the padding by the next call, which waits for them
(``check_padding``), unless the padding holds every row that can arrive
(``DispatchRequest.padding_is_guaranteed``: V2's R x T with T in the signature).
"""

from __future__ import annotations

import time

import torch

from tritonep.backends.base import DispatchRequest
from tritonep.backends.nvlink.memory import SymmetricBuffer
from tritonep.backends.nvlink.normal.notify_kernel import (
    INVALID_IDS_WORD,
    MAILBOX_HEADER,
    SIGNATURE_NAMES,
    mailbox_words,
    notify_dispatch,
)
from tritonep.backends.nvlink.normal.shape import DispatchShape
from tritonep.backends.nvlink.normal.state import NormalState
from tritonep.core.checks import InputError
from tritonep.device.status_codes import PHASE_DISAGREEMENT
from tritonep.runtime.platform import INTERPRET
from tritonep.runtime.status import timeout_error


class CountExchange:
    """One engine's count exchanges: its mailbox, its out-of-range id counter, and the checks.

    ``timeout_ns``, given to each method, is the engine's: how long the kernels wait for a
    peer, which also bounds how long the host polls.
    """

    def __init__(self, state: NormalState, rank: int, num_ranks: int) -> None:
        self.state, self.rank, self.num_ranks = state, rank, num_ranks
        # The exchange writes its result here (pinned host memory) and the host polls it.
        self.mailbox = torch.zeros(mailbox_words(num_ranks), dtype=torch.int64, device="cpu",
                                   pin_memory=not INTERPRET)
        self.mailbox_view = self.mailbox.numpy()
        # Out-of-range expert ids that get_dispatch_layout counted; the exchange sends the count
        # to every rank with the call's signature.
        self.invalid_ids = torch.zeros(1, dtype=torch.int32, device=state.device)
        # An exchange from topk_idx counts its finished programs here (zero between launches).
        self.layout_done = torch.zeros(1, dtype=torch.int64, device=state.device)

    def start(self, memory: SymmetricBuffer, request: DispatchRequest, shape: DispatchShape, timeout_ns: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Launch the next exchange (the send plan and the counts of a fresh dispatch):
        ``(token_list, send_pos, result, is_token_in_rank)`` (``notify_kernel.notify_dispatch``),
        from the request's layout, or from its ``topk_idx`` alone when it has none."""
        state = self.state
        state.notify_epoch += 1
        # The exchange's fixed arguments (memory, ids counter, status, time-out, mailbox, done counter) are
        # this engine's under the current tuning: the launch generation stands for them.
        return notify_dispatch(
            memory, request.is_token_in_rank, request.topk_idx, request.num_tokens_per_expert,
            (shape.x_words, shape.scale_words, shape.num_topk, request.num_experts, request.num_max_tokens_per_rank),
            request.num_worst_tokens > 0, self.invalid_ids, state.notify_epoch, state.status.tensor, timeout_ns,
            self.mailbox, self.layout_done, state.launch_generation)

    def result(self, epoch: int, words: int, timeout_ns: int, what: str) -> list[int]:
        """The result words of exchange ``epoch`` from the host mailbox, once its flag shows the
        exchange done (the host sync of a fresh dispatch). The poll is bounded: past the
        kernels' own time-out it waits for the stream (its waits on peers are bounded), then
        raises if the flag is still missing. Raises a time-out error if the exchange gave up."""
        box = self.mailbox_view
        if box[0] != epoch:
            deadline = time.monotonic() + timeout_ns / 1e9 + 5.0
            while box[0] != epoch:
                if time.monotonic() > deadline:
                    # The GPU may simply be busy with earlier work: wait for it, then decide.
                    torch.cuda.current_stream(self.state.device).synchronize()
                    if box[0] != epoch:
                        raise TimeoutError(f"rank {self.rank}: {what}: the count exchange (notify, epoch {epoch}) "
                                           f"never reported its result to the host")
        code = self.state.status.code   # a wait that timed out wrote it before the flag
        if code:
            raise self.status_error(code, timeout_ns, what)
        return box[MAILBOX_HEADER: MAILBOX_HEADER + words].tolist()

    def wait_counts(self, shape: DispatchShape, timeout_ns: int) -> list[int]:
        """The counts of this fresh dispatch's exchange, checked on every rank alike: the
        mailbox words (``rank_prefix_matrix`` row-major, the per-local-expert counts, the
        disagreeing ranks, the out-of-range ids)."""
        R = self.num_ranks
        host = self.result(self.state.notify_epoch, R * R + shape.experts_per_rank + 2, timeout_ns, "dispatch")
        self._check_agreement(host[-2], host[-1])
        received = host[R * (R - 1): R * R]
        if max(received) > shape.capacity:
            worst = received.index(max(received))
            raise InputError(f"rank {worst} would receive {max(received)} rows but the NVLink buffer "
                             f"holds {shape.capacity} rows of {shape.row_bytes} bytes; make the Buffer with more "
                             f"num_nvl_bytes")
        return host

    def _check_agreement(self, differing_words: int, invalid_ids: int) -> None:
        """Raise on every rank, before any row moves, if the count exchange found a problem."""
        if invalid_ids:
            self.invalid_ids.zero_()
            raise InputError(f"topk_idx had {invalid_ids} entries (over all ranks) outside [-1, num_experts); "
                             "nothing was dispatched")
        if differing_words:
            raise InputError(f"ranks called dispatch with different arguments: {_problems(differing_words)}")

    def status_error(self, code: int, timeout_ns: int, calls: str) -> Exception:
        """The error for a set status word: a timed-out wait, or the disagreement that a
        num_worst_tokens dispatch's exchange reported. Either stays in the word: the ranks meet
        it at different calls, so none of them may go on."""
        phase, problems = divmod(code - 1, 65536)
        if phase != PHASE_DISAGREEMENT:
            return timeout_error(code, self.rank, timeout_ns, calls)
        return InputError(f"rank {self.rank}: an earlier dispatch that did not read its counts on the host "
                          f"(num_worst_tokens, or V2's do_cpu_sync=False) found {_problems(problems)}, so its "
                          "outputs may be wrong. This Buffer cannot be used any more.")

    def remember_padding(self, num_worst_tokens: int) -> None:
        """A num_worst_tokens dispatch does not wait for its counts: the next call checks them
        (from the mailbox, still holding this exchange's result then). Not under CUDA-graph
        capture, where the exchange does not run until a replay."""
        if INTERPRET or not torch.cuda.is_current_stream_capturing():
            self.state.unchecked_padding = (self.state.notify_epoch, num_worst_tokens)

    def check_padding(self, timeout_ns: int) -> None:
        """Every rank holds the same received counts, so with equal num_worst_tokens every rank
        raises here, at the same call, before any communication."""
        state = self.state
        if state.unchecked_padding is None:
            return
        epoch, limit = state.unchecked_padding
        # The counts are gone once a later exchange overwrote the mailbox (a CUDA graph's
        # replay of a captured dispatch does, between eager calls), and under capture the host
        # may not wait for the GPU: then the check is dropped, rather than waiting for an epoch
        # that will never come back.
        capturing = not INTERPRET and torch.cuda.is_current_stream_capturing()
        if self.mailbox_view[0] != epoch and (capturing or self.mailbox_view[0] > epoch):
            state.unchecked_padding = None
            return
        state.unchecked_padding = None
        R = self.num_ranks
        # The last row of rank_prefix_matrix: what each rank received (exchanged a call ago, so
        # normally long finished).
        counts = self.result(epoch, R * R, timeout_ns, "a num_worst_tokens dispatch")[R * (R - 1):]
        if max(counts) > limit:
            worst = counts.index(max(counts))
            raise InputError(f"the previous dispatch had num_worst_tokens={limit}, but rank {worst} received "
                             f"{max(counts)} rows: rows past num_worst_tokens were dropped there. Use a larger "
                             f"num_worst_tokens (an upper bound on any rank's received rows).")


def _problems(bits: int) -> str:
    """What a bitmask of signature words (the exchange's check word) says went wrong."""
    names = [name for word, name in enumerate(SIGNATURE_NAMES) if name is not None and bits >> word & 1]
    found = [f"ranks that disagree on {', '.join(names)}"] if names else []
    if bits >> INVALID_IDS_WORD & 1:
        found.append("topk_idx entries outside [-1, num_experts)")
    return " and ".join(found)
