"""Low latency across nodes == the CPU backend, on groups split into simulated nodes.

The internode Buffer in low-latency mode runs the NVLink backend's low-latency engine and
kernels over its heap, every row sent straight to the expert's rank: by a store to a rank of its
node, by an NVSHMEM put to a rank of another (every rank by a store on the plain-stores
transport). The cases of ``low_latency_cases`` (fresh calls, hooks, zero-copy, ``out``, several
calls, masks, two micro-batches, CUDA-graph capture, a stalled peer) run with
``TRITONEP_GPUS_PER_NODE`` set in the ranks, so their Buffers are the internode backend's and
the CPU backend's on the same split:

* ``interpreter``: 4 CPU ranks as 2 nodes of 2, under Triton's interpreter (plain stores);
* ``gpu``, plain stores: the machine's ranks split into nodes of half of them
  (``TRITONEP_GPU_RANKS=4`` on one GPU: ranks share it, CUDA IPC; with one GPU per rank, torch
  symmetric memory, ``TRITONEP_TRANSPORT=stores``);
* ``gpu``, the default transport (``transport_pool``): NVSHMEM with one GPU per rank, at every
  split of the machine's ranks, and with ``allow_nvlink_for_low_latency_mode=False`` (every peer
  by NVSHMEM); plain stores where ranks share GPUs.
"""

from __future__ import annotations

import functools
import os

import low_latency_cases as cases
import pytest
from case_batches import check_batch
from low_latency_cases import SCHEDULES, LowLatencyCase, symmetric_masks

from tritonep.core.topology import GPUS_PER_NODE_VARIABLE
from tritonep.rank_pool import RankPool

# Transport pool: the low_latency_cases Buffers of each (split, allow_nvlink) setting, kept for the
# module (NVSHMEM's heaps are not given back one by one).
_kept_buffers: dict = {}


def on_nodes(group, ranks_per_node: int, function_name: str, *args) -> tuple[object, list[str]]:
    """On every rank: ``low_latency_cases.<function_name>(group, *args)`` with the group split
    into nodes of ``ranks_per_node``; returns its result and the backends of the Buffers it
    kept. The pool is this module's: the setting stays for its later calls."""
    os.environ[GPUS_PER_NODE_VARIABLE] = str(ranks_per_node)
    os.environ["TRITONEP_TRANSPORT"] = "stores"
    result = getattr(cases, function_name)(group, *args)
    backends = sorted({type(buffer.backend).__name__ for key, buffer in cases._state.items()
                       if key.endswith(" nvlink")})
    return result, backends


def _run(pool: RankPool, ranks_per_node: int, function_name: str, *args) -> list:
    outcomes = pool.run(on_nodes, ranks_per_node, function_name, *args)
    if function_name != "stalled_peer_error":   # which keeps no Buffer (earlier cases' may be kept)
        for _, backends in outcomes:
            assert backends == ["InternodeBackend"], backends
    return [result for result, _ in outcomes]


def compare_on_nodes(group, batch: list[LowLatencyCase], ranks_per_node: int) -> tuple[list[list[str]], list[dict]]:
    """On every rank: ``low_latency_cases.compare_low_latency_cases`` with the group split into
    nodes of ``ranks_per_node`` (``on_nodes``); Buffers not of the internode backend fail every case."""
    (problems, times), backends = on_nodes(group, ranks_per_node, "compare_low_latency_cases", batch)
    wrong = [] if backends == ["InternodeBackend"] else [f"Buffers of {backends}"]
    return [case_problems + wrong for case_problems in problems], times


def _check(pool: RankPool, batch: LowLatencyCase | list[LowLatencyCase], ranks_per_node: int = 2) -> None:
    """The cases on the internode and the CPU backend, compared on the ranks: one pool run."""
    check_batch(pool, compare_on_nodes, batch if isinstance(batch, list) else [batch], ranks_per_node)


NO_MASKS = ((),) * 4
INTERPRETER_CASES = [
    LowLatencyCase(seed=1, tokens=(6, 4, 6, 3), T=6, hidden=256, num_experts=8, num_topk=3, calls=2),
    LowLatencyCase(seed=2, tokens=(5, 0, 4, 5), T=5, hidden=256, num_experts=8, num_topk=4, use_fp8=False,
                   hook=True, zero_copy=True, use_out=True),
    LowLatencyCase(seed=3, tokens=(4, 4, 3, 4), T=4, hidden=512, num_experts=4, num_topk=2, round_scale=True,
                   use_ue8m0=True, routing="skewed"),
    # Shrink mode: rank 3 (node 1) dropped in the second round, another rank's mask changed
    # between a dispatch and its combine in the third.
    LowLatencyCase(seed=4, tokens=(4, 3, 4, 2), T=4, hidden=256, num_experts=8, num_topk=3, hook=True, calls=3,
                   masks=(NO_MASKS, symmetric_masks(4, (3,)), NO_MASKS),
                   combine_masks=(None, None, symmetric_masks(4, (0,)))),
]


@pytest.mark.parametrize("case", INTERPRETER_CASES, ids=lambda c: f"seed{c.seed}")
def test_interpreter_two_nodes_of_two(interpreter_pools, case: LowLatencyCase) -> None:
    _check(interpreter_pools(4), case)


def refused_without_nvlink(group) -> str:
    from nvlink_cases import make_buffer

    import tritonep as deep_ep

    try:
        make_buffer(group, "nvlink", {GPUS_PER_NODE_VARIABLE: "2"}, num_rdma_bytes=1 << 22, low_latency_mode=True,
                    allow_nvlink_for_low_latency_mode=False)
    except deep_ep.InputError as error:
        return str(error)
    return ""


def test_interpreter_no_nvlink_refused_on_plain_stores(interpreter_pools) -> None:
    """allow_nvlink_for_low_latency_mode=False across nodes needs NVSHMEM: plain stores (here,
    under the interpreter) reach every peer over NVLink, so every rank refuses, before any
    communication."""
    for message in interpreter_pools(4).run(refused_without_nvlink):
        assert "allow_nvlink_for_low_latency_mode=False: the plain-stores transport" in message, message


def test_interpreter_two_micro_batches(interpreter_pools) -> None:
    case = LowLatencyCase(seed=5, tokens=(4, 3, 4, 4), T=4, hidden=256, num_experts=8, num_topk=3)
    problems = _run(interpreter_pools(4), 2, "two_micro_batches", case, "interleaved")
    assert all(not p for p in problems), problems


# ---------------------------------------------------------------------------------- GPUs
def _tokens(pool: RankPool, T: int, count: int) -> tuple[int, ...]:
    return (count,) * pool.num_ranks


def _split(pool: RankPool) -> int:
    assert pool.num_ranks % 2 == 0, "the GPU tests split the ranks into two nodes"
    return pool.num_ranks // 2


@pytest.mark.gpu(min_gpus=1)
@pytest.mark.parametrize("options", [dict(), dict(use_fp8=False, hook=True), dict(zero_copy=True, use_out=True),
                                     dict(round_scale=True, use_ue8m0=True, calls=3)], ids=str)
def test_gpu_decode_shape(gpu_pool, options: dict) -> None:
    """DeepEP's decode shape (T=128, hidden 7168, top-8) on two simulated nodes."""
    R = gpu_pool.num_ranks
    _check(gpu_pool, LowLatencyCase(seed=31, tokens=_tokens(gpu_pool, 128, 120), T=128, hidden=7168,
                                    num_experts=8 * R, num_topk=8, **options), _split(gpu_pool))


@pytest.mark.gpu(min_gpus=1)
def test_gpu_masks(gpu_pool) -> None:
    R = gpu_pool.num_ranks
    none = ((),) * R
    _check(gpu_pool, LowLatencyCase(seed=32, tokens=_tokens(gpu_pool, 128, 100), T=128, hidden=7168,
                                    num_experts=8 * R, num_topk=8, hook=True, calls=3,
                                    masks=(none, symmetric_masks(R, (R - 1,)), none),
                                    combine_masks=(None, None, symmetric_masks(R, (0,)))), _split(gpu_pool))


@pytest.mark.gpu(min_gpus=1)
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_gpu_two_micro_batches(gpu_pool, schedule: str) -> None:
    R = gpu_pool.num_ranks
    case = LowLatencyCase(seed=33, tokens=_tokens(gpu_pool, 128, 128), T=128, hidden=7168, num_experts=8 * R,
                          num_topk=8)
    problems = _run(gpu_pool, _split(gpu_pool), "two_micro_batches", case, schedule)
    assert all(not p for p in problems), problems


@pytest.mark.gpu(min_gpus=1)
@pytest.mark.parametrize("masked", [False, True])
def test_gpu_cuda_graph_replay(gpu_pool, masked: bool) -> None:
    problems = _run(gpu_pool, _split(gpu_pool), "graph_replay", 34, 3, masked)
    assert all(not p for p in problems), problems


@pytest.mark.gpu(min_gpus=1)
def test_gpu_race_loop(gpu_pool) -> None:
    """30 random cases back to back (sizes, options, hooks) across the node split."""
    import random

    rng = random.Random(7)
    R = gpu_pool.num_ranks
    batch = []
    for i in range(30):
        T = rng.choice([1, 16, 128])
        use_fp8 = rng.random() < 0.6
        batch.append(LowLatencyCase(
            seed=600 + i, tokens=tuple(rng.randint(0, T) for _ in range(R)), T=T, hidden=rng.choice([2048, 7168]),
            num_experts=R * rng.choice([4, 36]), num_topk=rng.choice([1, 8]), use_fp8=use_fp8,
            round_scale=use_fp8 and rng.random() < 0.5, hook=rng.random() < 0.5, zero_copy=rng.random() < 0.3,
            routing=rng.choice(["random", "skewed", "one_expert"]), calls=2))
    _check(gpu_pool, batch, _split(gpu_pool))


@pytest.mark.gpu(min_gpus=1)
def test_gpu_stalled_peer_names_rank_and_phase(gpu_pool) -> None:
    messages = _run(gpu_pool, _split(gpu_pool), "stalled_peer_error")
    assert "rank 0 (node 0)" in messages[0] and "waiting for rank" in messages[0], messages[0]
    assert all(m == "" for m in messages[1:]), messages


# ---------------------------------------------------------------------- GPUs, default transport
def use_transport(ranks_per_node: int, allow_nvlink: bool) -> str:
    """In a rank: the next ``low_latency_cases`` Buffers on the transport the internode backend
    picks by default (NVSHMEM with one GPU per rank), the group split into nodes of
    ``ranks_per_node``, kept per setting. Returns the setting's name."""
    os.environ[GPUS_PER_NODE_VARIABLE] = str(ranks_per_node)
    os.environ.pop("TRITONEP_TRANSPORT", None)
    cases._state = _kept_buffers.setdefault((ranks_per_node, allow_nvlink), {})
    cases.buffer_options = {"allow_nvlink_for_low_latency_mode": allow_nvlink}
    return f"{ranks_per_node} per node, nvlink {allow_nvlink}"


def _transports(ranks_per_node: int, allow_nvlink: bool) -> list[str]:
    """The transports of the Buffers kept for a setting, in this rank."""
    kept = _kept_buffers.get((ranks_per_node, allow_nvlink), {})
    return sorted({buffer.backend.heap.name for key, buffer in kept.items() if key.endswith(" nvlink")})


def on_transport(group, ranks_per_node: int, allow_nvlink: bool, function_name: str, *args) -> tuple[object, list]:
    """On every rank: ``low_latency_cases.<function_name>(group, *args)`` after ``use_transport``;
    returns its result and the transports of the Buffers it used."""
    use_transport(ranks_per_node, allow_nvlink)
    return getattr(cases, function_name)(group, *args), _transports(ranks_per_node, allow_nvlink)


def compare_on_transports(group, batch: list[LowLatencyCase],
                          settings: list[tuple[int, bool]]) -> tuple[list[list[str]], list[dict]]:
    """On every rank: each case at each setting (``use_transport``) against one oracle
    (``low_latency_cases.compare_low_latency_cases``); Buffers on another transport than the one
    expected (NVSHMEM with one GPU per rank, plain stores for ranks sharing GPUs) fail every case."""
    import torch

    problems, times = cases.compare_low_latency_cases(
        group, batch, settings=[functools.partial(use_transport, *setting) for setting in settings])
    expected = ["stores"] if group.size() > torch.cuda.device_count() else ["nvshmem"]
    wrong = [f"{setting}: Buffers on {_transports(*setting)}, expected {expected}" for setting in settings
             if _transports(*setting) != expected]
    return [case_problems + wrong for case_problems in problems], times


def _gpu_splits(num_ranks: int) -> list[int]:
    """Ranks per node: every split of the ranks into two or more nodes."""
    return [g for g in range(1, num_ranks) if num_ranks % g == 0 and num_ranks // g >= 2]


def _on_transport(pool: RankPool, ranks_per_node: int, allow_nvlink: bool, function_name: str, *args) -> list:
    import torch

    expected = ["stores"] if pool.num_ranks > torch.cuda.device_count() else ["nvshmem"]
    outcomes = pool.run(on_transport, ranks_per_node, allow_nvlink, function_name, *args)
    for _, transports in outcomes:
        assert transports == expected, (transports, expected)
    return [result for result, _ in outcomes]


def _transport_settings(pool: RankPool) -> list[tuple[int, bool]]:
    """Every split with NVLink inside nodes; the last one also with every peer over NVSHMEM (plain
    stores, where ranks share GPUs, have no such mode; with one rank per node, every peer is over
    NVSHMEM already)."""
    import torch

    splits = _gpu_splits(pool.num_ranks)
    nvshmem = pool.num_ranks <= torch.cuda.device_count() and splits[-1] > 1
    return [(g, True) for g in splits] + ([(splits[-1], False)] if nvshmem else [])


def _transport_cases(R: int) -> list[LowLatencyCase]:
    none = ((),) * R
    return [
        LowLatencyCase(seed=41, tokens=(120,) * R, T=128, hidden=7168, num_experts=8 * R, num_topk=8),
        LowLatencyCase(seed=42, tokens=(128,) * R, T=128, hidden=7168, num_experts=8 * R, num_topk=8,
                       use_fp8=False, hook=True, zero_copy=True, use_out=True, calls=2),
        LowLatencyCase(seed=43, tokens=tuple(8 * (r % 3) for r in range(R)), T=16, hidden=2048,
                       num_experts=4 * R, num_topk=4, round_scale=True, use_ue8m0=True, routing="skewed", calls=3),
        LowLatencyCase(seed=44, tokens=(100,) * R, T=128, hidden=7168, num_experts=8 * R, num_topk=8, hook=True,
                       calls=3, masks=(none, symmetric_masks(R, (R - 1,)), none),
                       combine_masks=(None, None, symmetric_masks(R, (0,)))),
    ]


@pytest.mark.gpu(min_gpus=2)
def test_gpu_transport_matches_cpu_backend(transport_pool) -> None:
    """The decode shape (fp8 and bf16, hooks, zero-copy with ``out``, UE8M0, skewed routing,
    ranks without tokens, masks changed between a dispatch and its combine) on NVSHMEM at every
    split of the machine's ranks, and with every peer over NVSHMEM."""
    check_batch(transport_pool, compare_on_transports, _transport_cases(transport_pool.num_ranks),
                _transport_settings(transport_pool))


@pytest.mark.gpu(min_gpus=2)
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_gpu_transport_two_micro_batches(transport_pool, schedule: str) -> None:
    R = transport_pool.num_ranks
    case = LowLatencyCase(seed=45, tokens=(128,) * R, T=128, hidden=7168, num_experts=8 * R, num_topk=8)
    for ranks_per_node, allow_nvlink in _transport_settings(transport_pool):
        problems = _on_transport(transport_pool, ranks_per_node, allow_nvlink, "two_micro_batches", case, schedule)
        assert all(not p for p in problems), (ranks_per_node, allow_nvlink, problems)


@pytest.mark.gpu(min_gpus=2)
@pytest.mark.parametrize("masked", [False, True])
def test_gpu_transport_cuda_graph_replay(transport_pool, masked: bool) -> None:
    ranks_per_node, allow_nvlink = _transport_settings(transport_pool)[-1]
    problems = _on_transport(transport_pool, ranks_per_node, allow_nvlink, "graph_replay", 46, 3, masked)
    assert all(not p for p in problems), problems


@pytest.mark.gpu(min_gpus=2)
def test_gpu_transport_race_loop(transport_pool) -> None:
    """20 random cases back to back (sizes, options, hooks) at each transport setting. The
    shapes the kernels are specialised on (hidden, top-k, experts) stay DeepEP's: this loop checks
    the transport's waits and releases across calls, and each new specialisation is an NVSHMEM
    compile of seconds; the plain-stores race loop (``test_gpu_race_loop``) varies them."""
    import random

    rng = random.Random(8)
    R = transport_pool.num_ranks
    for setting in _transport_settings(transport_pool):
        batch = []
        for i in range(20):
            T = rng.choice([1, 16, 128])
            use_fp8 = rng.random() < 0.6
            batch.append(LowLatencyCase(
                seed=700 + i, tokens=tuple(rng.randint(0, T) for _ in range(R)), T=T, hidden=7168,
                num_experts=R * 8, num_topk=8, use_fp8=use_fp8, round_scale=use_fp8 and rng.random() < 0.5,
                hook=rng.random() < 0.5, zero_copy=rng.random() < 0.3,
                routing=rng.choice(["random", "skewed", "one_expert"]), calls=2))
        check_batch(transport_pool, compare_on_transports, batch, [setting])


@pytest.mark.gpu(min_gpus=1)
def test_nvshmem_kernels_compile_for_hopper() -> None:
    """Every low-latency kernel's NVSHMEM variant compiles for sm_90 with NVSHMEM's device library
    linked, and calls NVSHMEM (a module that calls none must not be initialised: findings)."""
    from test_kernels_compile import BF16, F32, I8, I32, I64, LOW_LATENCY_MODES, compile_all_for_hopper

    from tritonep.backends.internode.memory import require_nvshmem
    from tritonep.backends.nvlink.low_latency.clean_kernel import low_latency_clean_kernel
    from tritonep.backends.nvlink.low_latency.combine_kernel import low_latency_combine_kernel
    from tritonep.backends.nvlink.low_latency.dispatch_kernel import low_latency_dispatch_kernel
    from tritonep.core.checks import InputError
    from tritonep.device.nvshmem import NVSHMEM

    try:
        require_nvshmem()
    except InputError as error:
        pytest.skip(str(error))
    from torch.distributed._symmetric_memory._nvshmem_triton import NvshmemLibFinder

    libraries = (("libnvshmem_device", NvshmemLibFinder.find_device_library()),)
    common = dict(mask_ptr=I32, peer_base_ptrs=I64, area=0, my_area=1 << 36, rank=1, status_address=1 << 40,
                  timeout_ns=60 * 10**9, num_max_tokens=128, experts_per_rank=32, send_area=(1 << 36) + (1 << 30))
    jobs = []
    for do_send, do_recv in LOW_LATENCY_MODES:
        jobs.append((
            low_latency_dispatch_kernel,
            dict(common, x_ptr=BF16, x_row_stride=7168, topk_idx_ptr=I64, num_tokens=128, out_x_ptr=I32,
                 out_scales_ptr=F32, out_src_info_ptr=I32, out_topk_slot_ptr=I8, out_layout_range_ptr=I64,
                 out_count_ptr=I32, recv_stats_ptr=I32, wait_stats_ptr=I64, saved_mask_ptr=I32, slot=1,
                 slot_bytes=1 << 28),
            dict(NUM_RANKS=4, HIDDEN=7168, HIDDEN_PAD=8192, NUM_TOPK=8, PAIRS_PAD=1024, USE_FP8=True,
                 ROUND_SCALE=False, USE_UE8M0=False, HAS_RECV_STATS=False, HAS_WAIT_STATS=False, HAS_MASK=True,
                 DO_SEND=do_send, DO_RECV=do_recv, GROUPS_PAD=64, RANKS_PAD=4, TOPK_PAD=8, RECV_ROWS=4, BLOCK=2048,
                 TRANSPORT=NVSHMEM),
            16, libraries))
        jobs.append((
            low_latency_combine_kernel,
            dict(common, x_ptr=I32, expert_stride=512 * 7168, row_stride=7168, src_info_ptr=I32, topk_slot_ptr=I8,
                 layout_range_ptr=I64, topk_idx_ptr=I64, topk_weights_ptr=F32, num_tokens=128, out_ptr=BF16,
                 out_row_stride=7168, wait_stats_ptr=I64, dispatch_mask_ptr=I32, combine_mask_ptr=I32, slot=0,
                 combine_offset=1 << 29, slot_bytes=1 << 25),
            dict(NUM_RANKS=4, RANKS_PAD=4, HIDDEN=7168, NUM_TOPK=8, TOPK_PAD=8, HAS_WAIT_STATS=False,
                 HAS_MASK=False, DO_SEND=do_send, DO_RECV=do_recv, ROWS=2, BLOCK=2048, REDUCE_BLOCK=2048,
                 TRANSPORT=NVSHMEM),
            16, libraries))
    jobs.append((
        low_latency_clean_kernel,
        dict(peer_base_ptrs=I64, mask_ptr=I32, area=0, rank=1, status_address=1 << 40, timeout_ns=60 * 10**9),
        dict(NUM_RANKS=4, RANKS_PAD=4, HAS_MASK=False, BLOCK=1024, TRANSPORT=NVSHMEM), 4, libraries))
    for (kernel, *_), ptx in zip(jobs, compile_all_for_hopper(jobs)):
        assert "nvshmem" in ptx, kernel.fn.__name__
