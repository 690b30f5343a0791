"""The internode transport's operations, each checked across processes.

A ring: every rank puts a block of its heap into the next rank's and signals it, waits for the
previous rank's block, then adds to a counter on rank 0, which waits for all of them. Run with
plain stores (``STORES``) on CPU ranks under Triton's interpreter, and with NVSHMEM on two or
more GPUs (marked gpu). A wait nobody answers must give up, write its phase and peer into the
status word, and turn into an error that names the rank, its node and the phase.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from tritonep.backends.internode.transport import launch, put_signal, signal_add, wait_signal
from tritonep.runtime import kernel_names

BLOCK_BYTES = 4096            # the block each rank puts
SIGNAL_OFFSET = 0             # word the ring's put signals
COUNTER_OFFSET = 8            # word on rank 0 every rank adds to
SOURCE_OFFSET = 4096          # this rank's block
LANDING_OFFSET = 8192         # the block from the previous rank
HEAP_BYTES = 16384


@kernel_names.jit("tritonep::test::transport_ring", do_not_specialize=["rank", "num_ranks", "epoch"])
def ring_kernel(transport_table, heap_base, rank, num_ranks, epoch, status_ptr, timeout_ns,
                NBYTES: tl.constexpr, SIGNAL: tl.constexpr, COUNTER: tl.constexpr, SOURCE: tl.constexpr,
                LANDING: tl.constexpr, PHASE: tl.constexpr, GPU: tl.constexpr, TRANSPORT: tl.constexpr):
    nxt = (rank + 1) % num_ranks
    previous = (rank + num_ranks - 1) % num_ranks
    stamp = epoch.to(tl.int64) << 32
    put_signal(transport_table, heap_base, LANDING, SOURCE, NBYTES, SIGNAL, stamp + NBYTES, nxt, TRANSPORT, 256,
               GPU)
    wait_signal(heap_base, SIGNAL, stamp + NBYTES, status_ptr, timeout_ns, PHASE, previous, GPU)
    signal_add(transport_table, heap_base, COUNTER, 1, 0, TRANSPORT)
    if rank == 0:
        wait_signal(heap_base, COUNTER, epoch * num_ranks, status_ptr, timeout_ns, PHASE, num_ranks - 1, GPU)


@triton.jit
def lone_wait_kernel(heap_base, status_ptr, timeout_ns, peer, PHASE: tl.constexpr, GPU: tl.constexpr):
    wait_signal(heap_base, 0, 1, status_ptr, timeout_ns, PHASE, peer, GPU)


def ring(group, ranks_per_node: int, epochs: int = 2) -> dict:
    """Every rank's view after ``epochs`` rounds of the ring (run on each rank)."""
    from tritonep.backends.internode.memory import TransportHeap, choose_transport
    from tritonep.device.status_codes import PHASE_TRANSPORT_TEST
    from tritonep.runtime.platform import GPU_KERNELS, INTERPRET
    from tritonep.runtime.status import StatusWord

    rank, num_ranks = group.rank(), group.size()
    device = torch.device("cpu") if INTERPRET else torch.device("cuda", torch.cuda.current_device())
    transport = choose_transport()
    heap = TransportHeap(group, HEAP_BYTES, ranks_per_node, device, transport)
    status = StatusWord()
    seen = []
    for epoch in range(1, epochs + 1):
        pattern = torch.arange(BLOCK_BYTES // 4, dtype=torch.int32, device=device) * 7 + 1000 * rank + epoch
        heap.local[SOURCE_OFFSET:SOURCE_OFFSET + BLOCK_BYTES].view(torch.int32).copy_(pattern)
        torch.distributed.barrier(group)   # nobody puts into a block its owner still fills
        launch(ring_kernel, 1, (heap.transport_table, heap.base, rank, num_ranks, epoch, status.tensor, 10**10),
               dict(NBYTES=BLOCK_BYTES, SIGNAL=SIGNAL_OFFSET, COUNTER=COUNTER_OFFSET, SOURCE=SOURCE_OFFSET,
                    LANDING=LANDING_OFFSET, PHASE=PHASE_TRANSPORT_TEST, GPU=GPU_KERNELS), transport)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        landed = heap.local[LANDING_OFFSET:LANDING_OFFSET + BLOCK_BYTES].view(torch.int32).cpu().clone()
        words = heap.local[:16].view(torch.int64).cpu().tolist()
        seen.append((landed, words))
        torch.distributed.barrier(group)
    node_ptrs = heap.node_peer_ptrs.cpu().tolist()
    heap.release()
    heap.give_back()
    return {"seen": seen, "status": status.code, "transport": heap.name, "node_ptrs": node_ptrs}


def _check_ring(results: list[dict], ranks_per_node: int) -> None:
    num_ranks = len(results)
    for rank, result in enumerate(results):
        assert result["status"] == 0, result
        previous = (rank - 1) % num_ranks
        for epoch, (landed, words) in enumerate(result["seen"], start=1):
            expected = torch.arange(BLOCK_BYTES // 4, dtype=torch.int32) * 7 + 1000 * previous + epoch
            assert torch.equal(landed, expected), f"rank {rank} epoch {epoch}: wrong block"
            assert words[0] == (epoch << 32) + BLOCK_BYTES, (rank, epoch, words)
            if rank == 0:
                assert words[1] == epoch * num_ranks, words
        # The in-node table reaches this node's ranks only.
        node = rank // ranks_per_node
        for peer, pointer in enumerate(result["node_ptrs"]):
            assert (pointer != 0) == (peer // ranks_per_node == node), (rank, result["node_ptrs"])


def lone_wait(group, ranks_per_node: int) -> str:
    """A wait nobody answers: the status word, and the error the host makes of it."""
    from tritonep.backends.internode.memory import TransportHeap, choose_transport
    from tritonep.device.status_codes import PHASE_TRANSPORT_TEST
    from tritonep.runtime.platform import GPU_KERNELS, INTERPRET
    from tritonep.runtime.status import StatusWord, timeout_error

    device = torch.device("cpu") if INTERPRET else torch.device("cuda", torch.cuda.current_device())
    transport = choose_transport()
    heap = TransportHeap(group, HEAP_BYTES, ranks_per_node, device, transport)
    status = StatusWord()
    peer = group.size() - 1
    # A wait calls no NVSHMEM function: launched as any kernel (``transport.launch`` says why).
    lone_wait_kernel[(1,)](heap.base, status.tensor, 3 * 10**6, peer, PHASE=PHASE_TRANSPORT_TEST, GPU=GPU_KERNELS)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    code = status.code
    assert code == PHASE_TRANSPORT_TEST.value * 65536 + peer + 1, code
    heap.release()
    heap.give_back()
    return str(timeout_error(code, group.rank(), 3 * 10**6, "test calls", ranks_per_node))


@pytest.mark.parametrize("num_ranks,ranks_per_node", [(2, 1), (4, 2)])
def test_interpreter_stores_ring(interpreter_pools, num_ranks: int, ranks_per_node: int) -> None:
    results = interpreter_pools(num_ranks).run(ring, ranks_per_node)
    assert {r["transport"] for r in results} == {"stores"}
    _check_ring(results, ranks_per_node)


def test_interpreter_wait_gives_up_naming_rank_node_and_phase(interpreter_pools) -> None:
    messages = interpreter_pools(2).run(lone_wait, 1)
    assert "rank 0 (node 0)" in messages[0] and "waiting for rank 1 (node 1)" in messages[0], messages[0]
    assert "transport test wait" in messages[0]


def test_missing_nvshmem_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a machine without NVSHMEM (this CPU build of torch has none), asking for it raises an
    InputError that says what to install."""
    from tritonep.backends.internode import memory
    from tritonep.core.checks import InputError

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine may have NVSHMEM")
    monkeypatch.setenv(memory.TRANSPORT_VARIABLE, "nvshmem")
    with pytest.raises(InputError, match="nvidia-nvshmem"):
        memory.choose_transport()


@triton.jit
def _hook_probe_a(x_ptr):
    tl.store(x_ptr, 1)


@triton.jit
def _hook_probe_b(x_ptr):
    tl.store(x_ptr, 2)


@pytest.mark.gpu(min_gpus=1)
def test_nvshmem_wrap_keeps_an_earlier_post_compile_hook(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Torch's ``requires_nvshmem`` puts its NVSHMEM module set-up in Triton's post-compile hook
    in place of any hook set before; ``nvshmem_kernel`` chains the two, once however many kernels
    it wraps. Wrapping needs only the device library's path (an empty file stands in for it;
    nothing is compiled), but torch defines ``requires_nvshmem`` only in its CUDA builds."""
    from torch.distributed._symmetric_memory import _nvshmem_triton

    from tritonep.device import nvshmem

    (tmp_path / "libnvshmem_device.bc").write_bytes(b"")
    monkeypatch.setenv("NVSHMEM_LIB_DIR", str(tmp_path))
    monkeypatch.setattr(_nvshmem_triton.NvshmemLibFinder, "found_device_lib_path", None)
    monkeypatch.setattr(nvshmem, "_NVSHMEM_KERNELS", {})
    seen = []
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", lambda **kwargs: seen.append(kwargs["key"]))
    try:
        nvshmem.nvshmem_kernel(_hook_probe_a)
        chain = triton.knobs.runtime.jit_post_compile_hook
        nvshmem.nvshmem_kernel(_hook_probe_b)
        assert triton.knobs.runtime.jit_post_compile_hook is chain, "a second wrap must keep the one chain"
    finally:
        for kernel in (_hook_probe_a, _hook_probe_b):
            _nvshmem_triton.NvshmemKernelRegistry.deregister(kernel.fn.__name__)

    class Compiled:   # what torch's set-up reads of a compile: a kernel it was not asked to set up
        jit_function = _hook_probe_a

    chain(fn=Compiled(), key="k", compile={"device": 0})
    assert seen == ["k"]


def test_nvshmem_launch_chains_the_set_up_again_after_a_hook_replaced_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hook set after the first wrap (a profiler's; the tests' compile clock once put back the
    hook it had found) drops torch's NVSHMEM set-up from the chain, and a module compiled after
    that faults on its first NVSHMEM call. The next launch's wrap chains the set-up again. A
    stand-in for torch's module (its CPU builds lack ``requires_nvshmem``) sets the hook as
    torch's does."""
    from types import SimpleNamespace

    from tritonep.device import nvshmem

    set_up, seen = [], []

    def init_hook(**kwargs):
        set_up.append(kwargs["key"])

    def requires_nvshmem(kernel):
        triton.knobs.runtime.jit_post_compile_hook = init_hook
        return SimpleNamespace(kernel=kernel)

    torch_module = SimpleNamespace(requires_nvshmem=requires_nvshmem, _nvshmem_init_hook=init_hook)
    monkeypatch.setattr(nvshmem, "_torch_nvshmem", torch_module)
    monkeypatch.setattr(nvshmem, "_NVSHMEM_KERNELS", {})
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", None)
    nvshmem.nvshmem_kernel(_hook_probe_a)
    assert triton.knobs.runtime.jit_post_compile_hook is init_hook
    triton.knobs.runtime.jit_post_compile_hook = lambda **kwargs: seen.append(kwargs["key"])
    nvshmem.nvshmem_kernel(_hook_probe_a)

    class Compiled:
        jit_function = _hook_probe_a

    triton.knobs.runtime.jit_post_compile_hook(fn=Compiled(), key="k", compile={"device": 0})
    assert set_up == ["k"] and seen == ["k"]


def _skip_shared_gpus(pool) -> None:
    if pool.num_ranks > torch.cuda.device_count():
        pytest.skip("NVSHMEM refuses ranks sharing a GPU; the plain-stores tests cover them")


@pytest.mark.gpu(min_gpus=1)
def test_gpu_nvshmem_ring(transport_pool) -> None:
    """NVSHMEM (one GPU per rank), at 1 rank (a ring to itself), 2 nodes of 1, or nodes of 2."""
    _skip_shared_gpus(transport_pool)
    num_ranks = transport_pool.num_ranks
    ranks_per_node = 2 if num_ranks % 2 == 0 and num_ranks > 2 else 1
    results = transport_pool.run(ring, ranks_per_node, 4)
    assert {r["transport"] for r in results} == {"nvshmem"}, results
    _check_ring(results, ranks_per_node)


@pytest.mark.gpu(min_gpus=1)
def test_gpu_nvshmem_wait_gives_up(transport_pool) -> None:
    _skip_shared_gpus(transport_pool)
    messages = transport_pool.run(lone_wait, 1)
    assert "transport test wait" in messages[0]


def test_stores_ring_compiles_for_hopper() -> None:
    """The STORES kernels compile for sm_90 on a machine whose torch defines no NVSHMEM device
    functions: the NVSHMEM branches are never compiled."""
    from test_kernels_compile import I64, compile_for_hopper

    from tritonep.backends.internode.transport import STORES

    compile_for_hopper(ring_kernel, dict(transport_table=I64, heap_base=1 << 40, rank=1, num_ranks=4, epoch=3,
                                         status_ptr=I64, timeout_ns=60 * 10**9),
                       dict(NBYTES=BLOCK_BYTES, SIGNAL=SIGNAL_OFFSET, COUNTER=COUNTER_OFFSET, SOURCE=SOURCE_OFFSET,
                            LANDING=LANDING_OFFSET, PHASE=17, TRANSPORT=STORES.value))
