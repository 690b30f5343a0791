"""NVSHMEM's device functions as the kernels call them, and the two transports' names.

A kernel that writes into a peer's symmetric memory does it one of two ways, chosen by its
``TRANSPORT`` constexpr:

* ``STORES``: every peer's memory is mapped here; a remote write is a plain store through the
  peer's address (torch symmetric memory, CUDA IPC, /dev/shm files under the interpreter);
* ``NVSHMEM``: peers are reached by NVSHMEM's puts and signals, which name a remote object by its
  address in *this* rank's symmetric heap (the heaps are symmetric) and the peer by its PE.

The functions are torch's Triton bindings of NVSHMEM's device library (torch defines them where
it finds Triton and a CUDA build; None elsewhere, where the host never picks ``NVSHMEM``). Facts
that shape them (``docs/findings.md``): NVSHMEM's signal codes are 9 (set) and 10 (add); a
scalar call runs in every thread of the program, so a signal for the whole program is a block put
of no bytes; and a kernel that calls NVSHMEM must be launched through torch's
``requires_nvshmem`` (``nvshmem_kernel``), while one that calls none must not (error 7).
"""

from __future__ import annotations

import triton
import triton.language as tl

NVSHMEM = tl.constexpr(1)
STORES = tl.constexpr(2)
TRANSPORT_NAMES = {1: "nvshmem", 2: "stores"}

# NVSHMEM's nvshmemx_signal_op_t: NVSHMEM_SIGNAL_SET 9, NVSHMEM_SIGNAL_ADD 10. torch's docstrings
# give 0 and 5, which NVSHMEM 3.4 takes as an add.
SIGNAL_SET = tl.constexpr(9)
SIGNAL_ADD = tl.constexpr(10)

try:
    from torch.distributed._symmetric_memory import _nvshmem_triton as _torch_nvshmem
except ImportError:   # pragma: no cover - torch builds without distributed
    _torch_nvshmem = None
_putmem_signal_block = getattr(_torch_nvshmem, "putmem_signal_block", None)
_putmem_block = getattr(_torch_nvshmem, "putmem_block_extern_wrapper", None)
_signal_op = getattr(_torch_nvshmem, "signal_op", None)
_fence = getattr(_torch_nvshmem, "fence", None)
_quiet = getattr(_torch_nvshmem, "quiet", None)


@triton.jit
def int64(value):
    """``value`` (a scalar tensor or a plain int) as an int64 scalar."""
    return tl.zeros((), tl.int64) + value


@triton.jit
def put_signal_block(dst, src, nbytes, signal, value, op, pe):
    """Block-wide: ``nbytes`` from ``src`` to ``dst`` of ``pe``, then ``pe``'s 64-bit word at
    ``signal`` set to (``op`` SIGNAL_SET) or increased by (SIGNAL_ADD) ``value``, after the bytes.
    Addresses as this rank's heap names them. With no bytes, a signal for the whole program."""
    _putmem_signal_block(dst, src, int64(nbytes), signal, int64(value), op, pe)


@triton.jit
def put_block(dst, src, nbytes, pe):
    """Block-wide: ``nbytes`` from ``src`` (this rank's heap) to ``dst`` of ``pe``; returns once
    ``src`` may be reused, not once the bytes arrived (``quiet`` waits for that)."""
    _putmem_block(int64(dst), int64(src), int64(nbytes), pe)


@triton.jit
def set_lanes(signals, values, pes):
    """Per lane: ``pes``' 64-bit word at ``signals`` set to ``values`` (NVSHMEM's thread-level
    signal operation). A lane that several threads hold is set several times to one value, which
    is why only setting, never adding, goes through here."""
    _signal_op(signals.to(tl.int64), values.to(tl.int64), SIGNAL_SET, pes.to(tl.int32))


@triton.jit
def fence():
    """Later puts and signals of this thread to a PE are delivered after its earlier ones."""
    _fence()


@triton.jit
def quiet():
    """Every put and signal this PE issued so far, from any program, has arrived. (Calls from
    other programs count when they happened before, e.g. through ``signals.last_program_done``.)"""
    _quiet()


@triton.jit
def peer_pe(peer_table, peer, NUM_RANKS: tl.constexpr):
    """The PE of ``peer`` from a low-latency peer table: ``NUM_RANKS`` mapped addresses, then
    ``NUM_RANKS`` PEs (``nvlink/low_latency/area.py``)."""
    return tl.load(peer_table + NUM_RANKS + peer).to(tl.int32)


_NVSHMEM_KERNELS: dict = {}


def nvshmem_kernel(kernel: triton.runtime.JITFunction):
    """``kernel`` as torch's ``requires_nvshmem`` wraps it (NVSHMEM's device library linked, each
    module it compiles initialised), made once per kernel. The wrapper launches like the kernel
    (``kernel[grid](...)``, ``warmup``) and keeps its ``arg_names`` (``runtime/launcher.py``)."""
    wrapped = _NVSHMEM_KERNELS.get(kernel)
    if wrapped is None:
        earlier_hook = triton.knobs.runtime.jit_post_compile_hook
        wrapped = _NVSHMEM_KERNELS[kernel] = _torch_nvshmem.requires_nvshmem(kernel)
        wrapped.arg_names = kernel.arg_names
        _keep_post_compile_hook(earlier_hook)
    else:
        current = triton.knobs.runtime.jit_post_compile_hook
        if current is not _torch_nvshmem._nvshmem_init_hook and not getattr(current, "runs_nvshmem_setup", False):
            # A hook set since the first wrap (a profiler's, a test's compile clock) replaced the
            # chain: a module compiled now would miss torch's set-up and fault on its first
            # NVSHMEM call. Chain the set-up again in front of that hook.
            triton.knobs.runtime.jit_post_compile_hook = _torch_nvshmem._nvshmem_init_hook
            _keep_post_compile_hook(current)
    return wrapped


_SET_UP: set = set()   # (kernel, specialisation, device) whose module torch's set-up has seen


def _keep_post_compile_hook(earlier_hook) -> None:
    """``requires_nvshmem`` sets Triton's post-compile hook to torch's NVSHMEM module set-up,
    dropping whatever hook was there (a user's, a profiler's, the tests' kernel list). Put back
    a hook that runs torch's set-up, then the earlier hook. A later wrap finds the chain as the
    earlier hook and restores it as it is; and should chains nest (a hook set in between that
    calls the one before it), torch's set-up still runs once per compiled kernel."""
    nvshmem_setup = triton.knobs.runtime.jit_post_compile_hook
    if earlier_hook is None or earlier_hook is nvshmem_setup:
        return
    if getattr(earlier_hook, "runs_nvshmem_setup", False):
        triton.knobs.runtime.jit_post_compile_hook = earlier_hook
        return

    def both(**kwargs):
        compiled = (id(kwargs["fn"].jit_function), kwargs["key"], kwargs["compile"]["device"])
        if compiled not in _SET_UP:
            _SET_UP.add(compiled)
            nvshmem_setup(**kwargs)
        return earlier_hook(**kwargs)

    both.runs_nvshmem_setup = True
    triton.knobs.runtime.jit_post_compile_hook = both
