"""The internode transport: the remote operations the internode kernels use, done two ways.

Every kernel addresses remote memory the same way: an object lives at the same byte ``offset``
in every rank's symmetric heap, and a remote operation names it by ``(offset, peer)``. Each
kernel gets two values for that: ``heap_base`` (this rank's heap address) and ``transport_table``
(int64 [R]), and a ``TRANSPORT`` constexpr that picks what they mean:

* ``NVSHMEM`` (implementation 1): the heap is torch's NVSHMEM symmetric memory; the table holds
  each rank's NVSHMEM PE, and a remote object is named by its address in *this* rank's heap,
  as NVSHMEM wants it. NVSHMEM carries the bytes over InfiniBand/RoCE between nodes and over
  NVLink inside one; it refuses two ranks on one GPU.
* ``STORES`` (implementation 2): the table holds each rank's heap address as mapped here (torch
  symmetric memory, CUDA IPC for ranks sharing a GPU, /dev/shm files under Triton's interpreter)
  and a remote operation is a plain store through it, signalled with a release store
  (``device/signals.py``). It runs wherever the NVLink backend's kernels run.

Both take the same arguments, so a kernel tested with ``STORES`` (CPU ranks, ranks sharing one
GPU) is the kernel that ships with ``NVSHMEM``. The operations are block-wide (every thread of
the program calls them, as NVSHMEM's ``*_block`` functions require):

* ``put_signal``: ``nbytes`` from this rank's heap at ``src_offset`` to ``peer``'s heap at
  ``dst_offset``, then the 64-bit word at ``signal_offset`` of ``peer`` set to ``value`` once
  the bytes are visible there;
* ``signal_add``: add ``value`` to a 64-bit word of ``peer``, ordered after this program's
  earlier puts;
* ``wait_signal``: spin until a word of this rank's own heap reaches ``target``, bounded: on
  time-out the status word gets ``(phase, peer)`` (``device/signals.wait_at_least``) and the
  host raises naming the rank, its node and the phase.

Signal words only grow (each carries the call's epoch in its high bits, or counts), so none is
ever reset.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tritonep.device.nvshmem import (
    NVSHMEM,
    SIGNAL_ADD,
    SIGNAL_SET,
    STORES,
    TRANSPORT_NAMES,
    fence,
    int64,
    nvshmem_kernel,
    put_signal_block,
)
from tritonep.device.signals import add_release, fence_system, publish, wait_at_least

__all__ = ["NVSHMEM", "STORES", "TRANSPORT_NAMES", "launch", "put_signal", "signal_add", "wait_signal"]


@triton.jit
def _remote_word(transport_table, heap_base, offset, peer, TRANSPORT: tl.constexpr):
    """The int64 pointer of the word at ``offset`` of ``peer``'s heap, as a STORES store reaches
    it (its mapping here), or as NVSHMEM names it (the word's address in this rank's heap)."""
    if TRANSPORT == STORES:
        base = tl.load(transport_table + peer)
    else:
        base = heap_base
    return (base + offset).to(tl.pointer_type(tl.int64))


@triton.jit
def _copy_words(src, dst, num_words, BLOCK: tl.constexpr):
    """``num_words`` int32 words from ``src`` to ``dst`` by the whole program."""
    for start in range(0, num_words, BLOCK):
        words = start + tl.arange(0, BLOCK)
        mask = words < num_words
        tl.store(dst + words, tl.load(src + words, mask=mask), mask=mask)


@triton.jit
def put_signal(transport_table, heap_base, dst_offset, src_offset, nbytes, signal_offset, value, peer,
               TRANSPORT: tl.constexpr, BLOCK: tl.constexpr, GPU: tl.constexpr):
    """``nbytes`` (a multiple of 4; of 16 for full speed) of this rank's heap at ``src_offset``
    into ``peer``'s heap at ``dst_offset``, then ``peer``'s word at ``signal_offset`` set to
    ``value`` (int64), after the bytes. Block-wide; ``peer`` may be this rank. The bytes may
    have just been written by any thread of the program: they are read after a barrier and a
    system fence (a NIC reads them from outside the GPU)."""
    fence_system(GPU)
    if TRANSPORT == STORES:
        remote = tl.load(transport_table + peer)
        _copy_words((heap_base + src_offset).to(tl.pointer_type(tl.int32)),
                    (remote + dst_offset).to(tl.pointer_type(tl.int32)), nbytes // 4, BLOCK)
        publish((remote + signal_offset).to(tl.pointer_type(tl.int64)), int64(value))
    else:   # (with nbytes == 0, the signal alone)
        pe = tl.load(transport_table + peer).to(tl.int32)
        put_signal_block(heap_base + dst_offset, heap_base + src_offset, nbytes, heap_base + signal_offset, value,
                         SIGNAL_SET, pe)


@triton.jit
def signal_add(transport_table, heap_base, signal_offset, value, peer, TRANSPORT: tl.constexpr):
    """Add ``value`` to ``peer``'s int64 word at ``signal_offset``, after this program's
    earlier stores (STORES: a release add; NVSHMEM: a fence, then a put of no bytes with an
    adding signal). Block-wide: NVSHMEM's ``signal_op`` is a per-thread call, so every thread of
    the program would add; the block put signals once for the program."""
    if TRANSPORT == STORES:
        add_release(_remote_word(transport_table, heap_base, signal_offset, peer, TRANSPORT), int64(value))
    else:
        tl.debug_barrier()
        fence()
        pe = tl.load(transport_table + peer).to(tl.int32)
        put_signal_block(heap_base, heap_base, 0, heap_base + signal_offset, value, SIGNAL_ADD, pe)


@triton.jit
def wait_signal(heap_base, signal_offset, target, status_ptr, timeout_ns, phase, peer, GPU: tl.constexpr):
    """Spin until this rank's int64 word at ``signal_offset`` reaches ``target``; returns the
    value seen, or one above any real signal after a time-out, which it reports as ``(phase,
    peer)`` in the status word. Both transports write this rank's words from outside (a peer's
    store, NVSHMEM's signal operation), so one bounded acquire poll serves both."""
    word = (heap_base + signal_offset).to(tl.pointer_type(tl.int64))
    return wait_at_least(word, int64(target), status_ptr, timeout_ns, phase, int64(peer), GPU)


def launch(kernel: triton.runtime.JITFunction, grid: int, args: tuple, constants: dict, transport: int,
           num_warps: int = 4) -> None:
    """``kernel[grid](*args, **constants, TRANSPORT=transport)``, for a kernel that calls
    ``put_signal`` or ``signal_add``. With NVSHMEM it goes through torch's ``requires_nvshmem``,
    which links NVSHMEM's device library and initialises each module it compiles; that
    initialisation fails (``nvshmemx_cumodule_init`` error 7) on a module that calls no NVSHMEM
    function, so a kernel that only waits or uses node pointers is launched as any other."""
    if transport == NVSHMEM.value:
        kernel = nvshmem_kernel(kernel)
    kernel[(grid,)](*args, **constants, TRANSPORT=transport, num_warps=num_warps)

