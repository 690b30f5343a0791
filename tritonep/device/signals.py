"""Device-side signalling shared by the NVLink kernels.

Every cross-GPU handshake in this backend is one of two moves:

* a **release store** of a counter into a peer's signal area, issued after the data it
  covers (``publish``); the CTA barrier before it makes sure every thread's stores are in
  flight before the single release, because Triton puts no barrier around atomics;
* a **bounded acquire wait** on a counter in our own signal area (``wait_at_least``): it
  spins until the counter reaches a target or a timeout expires. On timeout it records
  ``(phase, peer)`` in the status word and gives up, so the host raises a Python error
  naming the stalled rank and phase instead of hanging forever.

Counters only grow (they carry the call's epoch), so nothing ever has to be reset between
calls.

Shrink mode: the low-latency kernels take this rank's mask (int32 [R], 1 = masked) as a
vector over ranks (``load_rank_mask``) and neither write into nor wait for masked ranks; the
helpers below take that vector. ``GPU`` is False under ``TRITON_INTERPRET=1``, where the inline PTX is replaced by the
interpreter's atomics and the timeout counts spins instead of nanoseconds.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tritonep.device import nvshmem
from tritonep.device.status_codes import MASKED_BIT

# The interpreter has no clock: a wait gives up after timeout_ns / this many spins (each spin
# is a Python call; 2 million spins for the default 60 s).
NS_PER_INTERPRETER_SPIN = tl.constexpr(30_000)

@triton.jit
def load_acquire(pointer, GPU: tl.constexpr):
    """64-bit load with acquire semantics at system scope (visible across GPUs)."""
    if GPU:
        return tl.inline_asm_elementwise(
            "ld.acquire.sys.global.b64 $0, [$1];", "=l,l", [pointer], dtype=tl.int64, is_pure=False, pack=1
        )
    else:
        return tl.atomic_add(pointer, 0, sem="acquire", scope="sys")


@triton.jit
def load_own_counter(pointer):
    """A 64-bit counter that only this GPU's earlier launches wrote (stream order makes it
    visible): a volatile load. An acquire load would also invalidate the SM's L1, under the
    feet of the other program resident there."""
    return tl.load(pointer, volatile=True)


@triton.jit
def now_ns(GPU: tl.constexpr):
    if GPU:
        return tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )
    else:
        return tl.zeros((), dtype=tl.int64)


@triton.jit
def publish(pointer, value):
    """Make this program's earlier stores visible, then store ``value`` with release semantics."""
    tl.debug_barrier()
    tl.atomic_xchg(pointer, value, sem="release", scope="sys")


@triton.jit
def add_release(pointer, value):
    tl.debug_barrier()
    tl.atomic_add(pointer, value, sem="release", scope="sys")


@triton.jit
def failed(status_ptr):
    """Whether this rank's status word holds an error (a shrink-mode notice is none)."""
    status = tl.load(status_ptr, volatile=True)
    return (status != 0) & ((status & MASKED_BIT) == 0)


@triton.jit
def wait_at_least(pointer, target, status_ptr, timeout_ns, phase, peer, GPU: tl.constexpr):
    """Spin until ``*pointer >= target``; returns the value seen.

    On timeout, writes ``phase * 65536 + peer + 1`` to ``status_ptr`` and returns a value
    above any real counter (``TIMED_OUT``), so callers stop waiting and finish quickly; the
    host then raises instead of handing out the result.

    A time-out records nothing over an error the status word holds already: a failure found
    on the GPU after the host handed out the call (ranks that disagreed at a count exchange it
    did not read back) reaches each host only at its next call, and a rank that raises first
    makes no more calls, so the waits of its peers' queued kernels time out; the host then
    raises the first error, the one that explains the others.
    """
    value = load_acquire(pointer, GPU)
    start = now_ns(GPU)
    spins = 0
    expired = tl.zeros((), dtype=tl.int1)
    while (value < target) & (expired == 0):
        value = load_acquire(pointer, GPU)
        spins += 1
        if GPU:
            expired = (now_ns(GPU) - start) > timeout_ns
        else:
            expired = spins > timeout_ns // NS_PER_INTERPRETER_SPIN
    if expired & (value < target):   # not when the last poll saw it arrive as the time ran out
        if failed(status_ptr) == 0:
            # Tensor first: under the interpreter a constexpr plus a tensor stays a constexpr.
            tl.store(status_ptr, (peer + phase * 65536 + 1).to(tl.int64))
        value = target + (1 << 56)
    tl.debug_barrier()
    return value


@triton.jit
def last_program_done(done_ptr):
    """True in exactly one program of the launch: the last to call this.

    Each program adds one to a local counter after its work; the program that brings it to
    ``num_programs`` resets it to zero for the next launch (which starts only after this one
    ends, in stream order) and may then publish "the whole launch is done". The acq_rel
    atomic chains every program's earlier stores before whatever the last one releases.
    """
    tl.debug_barrier()
    previous = tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="gpu")
    last = previous == tl.num_programs(0) - 1
    if last:
        tl.atomic_xchg(done_ptr, 0, sem="relaxed", scope="gpu")
    return last


@triton.jit
def wait_all_at_least(pointers, targets, waiting, status_ptr, timeout_ns, phase, peers, mask_ptr, saved_mask_ptr,
                      NUM_RANKS: tl.constexpr, SHRINK: tl.constexpr, GPU: tl.constexpr):
    """``wait_at_least`` on a vector of counters at once (lanes where ``waiting``; every lane's
    pointer must be valid): the polls of all lanes are in flight together instead of one after
    another. Returns the values seen; lanes that gave up return ``targets + 2**56`` (see
    ``gave_up``): above any real counter, and 0 in the low 32 bits, where the low-latency
    dispatch flags carry their row counts.

    On a time-out it records the first lagging lane's ``peers`` entry in the status word, and the
    host raises. In shrink mode (``SHRINK``, DeepEP's enable_shrink; the low-latency kernels) a
    peer that does not answer is masked instead, as DeepEP does: ``mask_ptr[peer]`` (the Buffer's
    mask, what ``low_latency_query_mask_buffer`` shows) and ``saved_mask_ptr[peer]`` (the mask
    this call uses, which its receive half or combine reads) become 1, and the status word gets a
    notice with ``MASKED_BIT`` that the host turns into a warning. A lane also gives up at once
    when its peer is in the call's mask already, put there by another program's time-out, so a
    dead rank costs one time-out per launch, not one per wait. Only ``saved_mask_ptr`` is polled:
    a mask the user changes while a call is in flight applies from the next call. Without
    ``SHRINK`` the mask pointers are not touched."""
    asked = waiting
    if SHRINK:
        waiting = waiting & (tl.load(saved_mask_ptr + peers, mask=waiting & (peers < NUM_RANKS), other=0,
                                     volatile=True) == 0)
    values = tl.where(waiting, load_acquire(pointers, GPU), targets)
    start = now_ns(GPU)
    spins = 0
    expired = tl.zeros((), dtype=tl.int1)
    while (tl.sum((waiting & (values < targets)).to(tl.int32), axis=0) > 0) & (expired == 0):
        lagging = waiting & (values < targets)
        values = tl.where(lagging, load_acquire(pointers, GPU), values)
        if SHRINK:
            waiting = waiting & (tl.load(saved_mask_ptr + peers, mask=lagging, other=0, volatile=True) == 0)
        spins += 1
        if GPU:
            expired = (now_ns(GPU) - start) > timeout_ns
        else:
            expired = spins > timeout_ns // NS_PER_INTERPRETER_SPIN
    lagging = waiting & (values < targets)
    # Only lanes still waiting count: in its last poll a lane may have seen its counter arrive,
    # or its peer masked by another program, just as the time ran out.
    if expired & (tl.sum(lagging.to(tl.int32), axis=0) > 0):
        code = tl.zeros((), tl.int64) + phase * 65536 + tl.min(tl.where(lagging, peers, 1 << 30), axis=0) + 1
        if SHRINK:
            tl.atomic_xchg(mask_ptr + peers, 1, mask=lagging, sem="relaxed")
            tl.atomic_xchg(saved_mask_ptr + peers, 1, mask=lagging, sem="relaxed")
            code += MASKED_BIT
        tl.store(status_ptr, code)
    values = tl.where(waiting & ~lagging, values, tl.where(asked, targets + (1 << 56), targets))
    tl.debug_barrier()
    return values


@triton.jit
def gave_up(values, targets):
    """Lanes of ``wait_all_at_least`` that stopped waiting (a time-out, or shrink mode's mask)."""
    return values >= targets + (1 << 56)


@triton.jit
def fence_system(GPU: tl.constexpr):
    """Order this program's earlier stores (all threads: barrier first) before its later ones,
    at system scope: data, fence, then flags written with ``store_relaxed``."""
    tl.debug_barrier()
    if GPU:
        tl.inline_asm_elementwise("fence.acq_rel.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                                  pack=1)


@triton.jit
def store_relaxed(pointer, value, GPU: tl.constexpr):
    """A 64-bit relaxed store at system scope: strong (a waiting peer's acquire load pairs with
    it through the fence before), and unlike an atomic exchange it does not wait for a reply."""
    if GPU:
        tl.inline_asm_elementwise("st.relaxed.sys.global.b64 [$1], $2; mov.u32 $0, 0;", "=r,l,l",
                                  [pointer, value.to(tl.int64)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.atomic_xchg(pointer, value.to(tl.int64), sem="relaxed", scope="sys")


@triton.jit
def write_peer_word(pointer, peer_table, peer, value, heap_base, NUM_RANKS: tl.constexpr, TRANSPORT: tl.constexpr,
                    GPU: tl.constexpr):
    """Block-wide: set a peer's int64 word to ``value``. ``pointer``: the word's address worked
    out from ``peer``'s entry of the peer table, as a store reaches it. A relaxed store
    (``store_relaxed``) there; or, with ``NVSHMEM`` where the entry is 0 (a rank NVSHMEM reaches:
    ``pointer`` is then the word's offset in the heap), a signal of no bytes to the peer's PE,
    naming the word by its address in this rank's heap (``heap_base``). Ordered after this
    program's earlier writes only if the caller fenced them: ``fence_system`` for stores,
    ``nvshmem.quiet`` for puts. Every thread must pass the same ``peer``."""
    if TRANSPORT == nvshmem.NVSHMEM:
        if tl.load(peer_table + peer) == 0:
            nvshmem.put_signal_block(heap_base, heap_base, 0, heap_base + pointer.to(tl.int64), value,
                                     nvshmem.SIGNAL_SET, nvshmem.peer_pe(peer_table, peer, NUM_RANKS))
        else:
            store_relaxed(pointer, value, GPU)
    else:
        store_relaxed(pointer, value, GPU)


@triton.jit
def load_rank_mask(mask_ptr, ranks, NUM_RANKS: tl.constexpr, HAS_MASK: tl.constexpr):
    """Shrink mode: for each lane of ``ranks``, whether the int32 [R] mask at ``mask_ptr`` masks
    that rank. All False without a mask (``HAS_MASK`` False, ``mask_ptr`` unused) and on pad lanes."""
    if HAS_MASK:
        masked = tl.load(mask_ptr + ranks, mask=ranks < NUM_RANKS, other=0) != 0
    else:
        masked = ranks < 0
    return masked


@triton.jit
def save_rank_mask(out_ptr, masked, ranks, NUM_RANKS: tl.constexpr, HAS_MASK: tl.constexpr):
    """Store ``masked`` as int32 [R] at ``out_ptr``: the mask this call uses, which its own
    waits poll (``wait_all_at_least``) and a later launch reuses.

    Every program stores it (the same values) before it polls it. With program 0 alone storing,
    a program that started first could poll the slot's previous call's mask, and a rank masked
    then but not now counted as given up: that program sent it nothing, and the rank timed out
    waiting: with hundreds of programs per launch they do not all start together. A time-out that masks a rank while
    a late program still stores its own copy may be undone there; that program then waits for
    the rank itself, and masks it again on its time-out."""
    if HAS_MASK:
        tl.store(out_ptr + ranks, masked.to(tl.int32), mask=ranks < NUM_RANKS)
        tl.debug_barrier()   # the whole program's copy is stored before any of its threads polls it


@triton.jit
def rank_masked(masked, ranks, peer):
    """``masked`` (a vector over ``ranks``) at one rank ``peer``."""
    return tl.sum(tl.where(ranks == peer, masked.to(tl.int32), 0), axis=0) > 0


@triton.jit
def ranks_masked(masked, ranks, peers):
    """``masked`` (a vector over ``ranks``) at each rank of the vector ``peers``."""
    return tl.sum(tl.where(peers[:, None] == ranks[None, :], masked.to(tl.int32)[None, :], 0), axis=1) > 0


@triton.jit
def begin_low_latency_send(control, sequence_sent, freed, sent_use, slot, masked, mask_ptr, saved_mask_ptr,
                           status_ptr, timeout_ns, phase, NUM_RANKS: tl.constexpr, RANKS_PAD: tl.constexpr,
                           MAX_RANKS: tl.constexpr, SHRINK: tl.constexpr, GPU: tl.constexpr):
    """(use number of the slot, ranks to skip) for a low-latency send, after every rank it
    writes into finished receiving the last use of the slot that this rank wrote into it (the
    peers write ``freed + slot * MAX_RANKS + peer``; ``sent_use + slot * MAX_RANKS + peer``
    holds that use, the previous one unless masks skipped the peer). Ranks in ``masked`` are
    not waited for: this send writes nothing into them. In shrink mode a rank that does not
    answer in time joins them (``wait_all_at_least``)."""
    call = load_own_counter(control + sequence_sent + slot) + 1
    ranks = tl.arange(0, RANKS_PAD)
    words = slot * MAX_RANKS + tl.minimum(ranks, NUM_RANKS - 1)
    last_written = tl.load(control + sent_use + words)
    values = wait_all_at_least(control + freed + words, last_written, (ranks < NUM_RANKS) & (masked == 0), status_ptr,
                               timeout_ns, phase, ranks, mask_ptr, saved_mask_ptr, NUM_RANKS, SHRINK, GPU)
    return call, masked | gave_up(values, last_written)


@triton.jit
def finish_low_latency_launch(control, peer_base_ptrs, area, slot, rank, masked, sequence_sent, sequence_received,
                              sent_use, done_send, done_receive, freed, heap_base, NUM_RANKS: tl.constexpr,
                              RANKS_PAD: tl.constexpr, MAX_RANKS: tl.constexpr, DO_SEND: tl.constexpr,
                              DO_RECV: tl.constexpr, GPU: tl.constexpr, TRANSPORT: tl.constexpr):
    """The last program of a low-latency launch advances the slot's use counters. After a send
    it records the use as the last one written into each rank not in ``masked``; after a
    receive it tells every source not in ``masked`` that this rank's slot may be written by its
    next use (``write_peer_word``: a store, or an NVSHMEM signal to a peer of another node; only
    reads of the slot came before, so there is nothing to fence for it)."""
    if DO_RECV:
        done_word = control + done_receive
    else:
        done_word = control + done_send
    if last_program_done(done_word):
        ranks = tl.arange(0, RANKS_PAD)
        if DO_SEND:
            sent = load_own_counter(control + sequence_sent + slot) + 1
            tl.store(control + sequence_sent + slot, sent)
            tl.store(control + sent_use + slot * MAX_RANKS + ranks, sent + tl.zeros([RANKS_PAD], tl.int64),
                     mask=(ranks < NUM_RANKS) & (masked == 0))
        if DO_RECV:
            received = load_own_counter(control + sequence_received + slot) + 1
            tl.store(control + sequence_received + slot, received)
            fence_system(GPU)
            for source in range(0, NUM_RANKS):
                if not rank_masked(masked, ranks, source):
                    peer_control = (tl.load(peer_base_ptrs + source) + area).to(tl.pointer_type(tl.int64))
                    write_peer_word(peer_control + freed + slot * MAX_RANKS + rank, peer_base_ptrs, source, received,
                                    heap_base, NUM_RANKS, TRANSPORT, GPU)


@triton.jit
def barrier_unmasked(control, peer_base_ptrs, area, rank, masked, mask_ptr, barrier, barrier_sent, status_ptr,
                     timeout_ns, phase, NUM_RANKS: tl.constexpr, RANKS_PAD: tl.constexpr, SHRINK: tl.constexpr,
                     GPU: tl.constexpr, TRANSPORT: tl.constexpr):
    """One program: return once every rank not in ``masked`` reached its matching barrier, with
    this program's earlier stores visible to them. Counts are per pair of ranks: this rank's
    n-th barrier with rank p (``barrier_sent + p``) writes n into p's ``barrier + rank`` and
    waits for its own ``barrier + p`` to reach n. Masked ranks are skipped and their counts stay
    put, so a rank that was masked (and idle) for a while is waited for correctly once unmasked.
    Returns the ranks skipped: ``masked``, and in shrink mode the ranks masked after a time-out.

    With ``NVSHMEM`` every put and signal this rank issued before (an earlier call's rows, its
    "slot freed" words) has arrived before its barrier count leaves (``nvshmem.quiet``): a peer
    that passes the barrier sees no more of them."""
    ranks = tl.arange(0, RANKS_PAD)
    words = tl.minimum(ranks, NUM_RANKS - 1)
    linked = (ranks < NUM_RANKS) & (masked == 0)
    counts = tl.load(control + barrier_sent + words) + 1
    tl.store(control + barrier_sent + words, counts, mask=linked)
    fence_system(GPU)
    if TRANSPORT == nvshmem.NVSHMEM:
        nvshmem.quiet()
    for peer in range(0, NUM_RANKS):
        if not rank_masked(masked, ranks, peer):
            peer_control = (tl.load(peer_base_ptrs + peer) + area).to(tl.pointer_type(tl.int64))
            write_peer_word(peer_control + barrier + rank, peer_base_ptrs, peer,
                            tl.sum(tl.where(ranks == peer, counts, 0), axis=0), control.to(tl.int64) - area, NUM_RANKS,
                            TRANSPORT, GPU)
    values = wait_all_at_least(control + barrier + words, counts, linked, status_ptr, timeout_ns, phase, ranks,
                               mask_ptr, mask_ptr, NUM_RANKS, SHRINK, GPU)
    return masked | gave_up(values, counts)
