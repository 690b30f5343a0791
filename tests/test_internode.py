"""Internode backend == CPU backend, on groups split into simulated nodes.

``TRITONEP_GPUS_PER_NODE`` splits the group; the internode Buffer (``TRITONEP_BACKEND=nvlink``
on a split group) and the CPU backend's Buffer run the same calls (``nvlink_cases``: fresh
dispatch, cached dispatches, combines, fp8 with scales, bias, num_worst_tokens) and must agree
as the NVLink backend must. A pool run takes a batch of cases, the CPU backend's side a case
ahead in a thread of each rank (``case_batches``). Three ways to run the same kernels:

* ``interpreter``: CPU ranks under Triton's interpreter, transport by plain stores, at 2 x 2
  and 3 x 2 (nodes x ranks per node); small shapes (two CPU cores run them);
* ``gpu`` with ranks sharing GPUs (``TRITONEP_GPU_RANKS=4`` on one GPU): plain stores through
  CUDA IPC;
* ``gpu`` with one GPU per rank: NVSHMEM, at 2 x 2 and 4 x 1 on 4 GPUs, 2 x 1 on 2.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist
from case_batches import check_batch, oracle_group, run_batch
from nvlink_cases import Case, cpu_oracle, make_buffer, run_and_compare
from nvlink_scenarios import empty_rows_from_numpy

from tritonep import Buffer
from tritonep.core.topology import GPUS_PER_NODE_VARIABLE
from tritonep.rank_pool import RankPool

_buffers: dict = {}


def internode_buffer(group: dist.ProcessGroup, ranks_per_node: int, rdma_bytes: int) -> Buffer:
    """The internode Buffer with the group split into nodes of ``ranks_per_node``, made once per
    split and size on this rank."""
    key = (ranks_per_node, rdma_bytes)
    if key not in _buffers:
        internode = make_buffer(group, "nvlink", {GPUS_PER_NODE_VARIABLE: str(ranks_per_node)},
                                num_rdma_bytes=rdma_bytes)
        assert type(internode.backend).__name__ == "InternodeBackend", type(internode.backend)
        _buffers[key] = internode
    return _buffers[key]


def oracle_buffer(group: dist.ProcessGroup, ranks_per_node: int) -> Buffer:
    """The CPU backend's Buffer on the oracle's gloo group, made (once on this rank) with the
    group split into nodes: it serves a split group with the one-node results, so one oracle
    serves every split."""
    if "cpu" not in _buffers:
        _buffers["cpu"] = make_buffer(oracle_group(group), "collective", {GPUS_PER_NODE_VARIABLE: str(ranks_per_node)})
    return _buffers["cpu"]


def compare_split_cases(group: dist.ProcessGroup, cases: list[Case], splits: list[int],
                        rdma_bytes: int) -> tuple[list[list[str]], list[dict]]:
    """On every rank: each case on the internode backend at each split (ranks per node) in
    ``splits``, compared with the CPU backend's results, which a thread works out once per case,
    a case ahead (``case_batches.run_batch``). Returns the mismatches and the timings of each case."""
    internode = {split: internode_buffer(group, split, rdma_bytes) for split in splits}
    cpu = oracle_buffer(group, splits[0])

    def compare(case: Case, oracle_result: tuple[dict, dict]) -> list[str]:
        return [f"{split} ranks per node: {problem}" for split in splits
                for problem in run_and_compare(internode[split], case, oracle_result)]

    return run_batch(group, cases, cpu_oracle(cpu, group), compare)


def transport_of(group: dist.ProcessGroup, ranks_per_node: int, rdma_bytes: int) -> str:
    return _buffers[(ranks_per_node, rdma_bytes)].backend.heap.name


def _check(pool: RankPool, cases: list[Case], splits: list[int], rdma_bytes: int = 1 << 22) -> None:
    """The cases on the internode backend at each split and on the CPU backend, compared on the
    ranks: one pool run."""
    check_batch(pool, compare_split_cases, cases, splits, rdma_bytes)


# Random, skewed, all-to-one and empty routings, ranks without tokens, fp8 with row-major and
# column-major scales, biases, num_worst_tokens padding, expert alignment, cached dispatches and
# combines repeated with one handle.
CASES_2X2 = [
    Case(seed=1, tokens=(9, 6, 11, 4), hidden=128, num_experts=8, num_topk=3),
    Case(seed=2, tokens=(7, 0, 5, 8), hidden=256, num_experts=16, num_topk=4, fp8=True, bias=True, repeats=2),
    Case(seed=3, tokens=(6, 9, 3, 5), hidden=128, num_experts=8, num_topk=2, routing="skewed",
         num_worst_tokens=40, expert_alignment=4),
    Case(seed=4, tokens=(5, 7, 6, 2), hidden=128, num_experts=4, num_topk=1, routing="one_rank", bias=True),
    Case(seed=5, tokens=(4, 4, 4, 4), hidden=128, num_experts=8, num_topk=2, routing="none"),
    Case(seed=6, tokens=(0, 0, 0, 0), hidden=128, num_experts=8, num_topk=2),
    Case(seed=7, tokens=(8, 3, 6, 7), hidden=256, num_experts=8, num_topk=3, fp8=True, column_major_scales=True,
         repeats=2),
]
CASES_3X2 = [
    Case(seed=11, tokens=(5, 3, 6, 0, 4, 7), hidden=128, num_experts=12, num_topk=3, bias=True),
    Case(seed=12, tokens=(4, 6, 2, 5, 3, 4), hidden=128, num_experts=6, num_topk=2, routing="skewed", fp8=True,
         repeats=2),
    Case(seed=13, tokens=(3, 4, 5, 2, 6, 3), hidden=128, num_experts=6, num_topk=1, routing="one_rank",
         num_worst_tokens=40),
]


def test_interpreter_two_nodes_of_two(interpreter_pools) -> None:
    _check(interpreter_pools(4), CASES_2X2, [2])


def test_interpreter_three_nodes_of_two(interpreter_pools) -> None:
    _check(interpreter_pools(6), CASES_3X2, [2])


def test_interpreter_empty_rows_from_numpy(interpreter_pools) -> None:
    """Empty inputs made by torch.from_numpy (zero strides) dispatch and combine across nodes as
    on one node (runtime.launcher.as_words)."""
    env = {GPUS_PER_NODE_VARIABLE: "2"}
    shapes = interpreter_pools(4).run(empty_rows_from_numpy, env, num_rdma_bytes=1 << 22)
    assert shapes == [[(0, 64), (0, 64)], [(0, 64), (5, 64)], [(0, 64), (5, 64)], [(15, 64), (5, 64)]], shapes


def test_interpreter_transport_is_plain_stores(interpreter_pools) -> None:
    pool = interpreter_pools(4)
    _check(pool, CASES_2X2[:1], [2])
    assert set(pool.run(transport_of, 2, 1 << 22)) == {"stores"}


# ---------------------------------------------------------------------------------- GPUs
GPU_CASES = [
    Case(seed=21, tokens=(512,) * 8, hidden=7168, num_experts=64, num_topk=8),
    Case(seed=22, tokens=(300,) * 8, hidden=7168, num_experts=64, num_topk=8, fp8=True, bias=True, repeats=3),
    Case(seed=23, tokens=(200,) * 8, hidden=2048, num_experts=32, num_topk=4, routing="skewed",
         num_worst_tokens=2048),
    Case(seed=24, tokens=(100,) * 8, hidden=2048, num_experts=32, num_topk=4, routing="one_rank"),
    Case(seed=25, tokens=(0,) * 8, hidden=2048, num_experts=32, num_topk=4),
]


def _gpu_splits(num_ranks: int) -> list[int]:
    """Ranks per node to try on this many GPU ranks: every split into two or more nodes."""
    return [g for g in range(1, num_ranks) if num_ranks % g == 0 and num_ranks // g >= 2]


@pytest.mark.gpu(min_gpus=2)
def test_gpu_matches_cpu_backend(transport_pool) -> None:
    """Every split of the machine's ranks into nodes, ``GPU_CASES`` in one batch, each case at
    every split against one oracle; NVSHMEM with one GPU per rank, plain stores when ranks share
    GPUs (TRITONEP_GPU_RANKS)."""
    import torch

    R = transport_pool.num_ranks
    cases = [Case(**{**case.__dict__, "tokens": case.tokens[:1] * R}) for case in GPU_CASES]
    _check(transport_pool, cases, _gpu_splits(R), 1 << 29)
    expected = "stores" if R > torch.cuda.device_count() else "nvshmem"
    for ranks_per_node in _gpu_splits(R):
        assert set(transport_pool.run(transport_of, ranks_per_node, 1 << 29)) == {expected}


RACE_BATCH = 50   # cases per pool run in the race loop: a pool run of minutes at most


@pytest.mark.gpu(min_gpus=2)
def test_gpu_race_loop(transport_pool) -> None:
    """Many calls back to back with random shapes: every wait and release across calls."""
    import random

    rng = random.Random(5)
    R = transport_pool.num_ranks
    ranks_per_node = _gpu_splits(R)[-1]
    cases = [Case(seed=100 + seed, tokens=tuple(rng.randint(0, 300) for _ in range(R)),
                  hidden=rng.choice([512, 2048, 7168]), num_experts=8 * R, num_topk=rng.choice([1, 4, 8]),
                  fp8=rng.random() < 0.4, bias=rng.random() < 0.3, routing=rng.choice(["random", "skewed"]))
             for seed in range(100)]
    for first in range(0, len(cases), RACE_BATCH):
        _check(transport_pool, cases[first:first + RACE_BATCH], [ranks_per_node], 1 << 29)


# ---------------------------------------------------------------------------------- compiling
def test_kernels_compile_for_hopper() -> None:
    """Every internode kernel compiles for sm_90 with plain stores (the NVSHMEM build needs
    NVSHMEM's device library, which the GPU machine has)."""
    from test_kernels_compile import BF16, F32, I32, I64, compile_for_hopper

    from tritonep.backends.internode import combine_kernel, dispatch_kernel
    from tritonep.backends.internode.layout import CHANNELS, NODE_BLOCK, PUT_WARPS, RECEIVE_WARPS
    from tritonep.backends.internode.transport import STORES

    common = dict(GPU=True, TRANSPORT=STORES.value)
    status = dict(status_ptr=I64, timeout_ns=60 * 10**9)
    compile_for_hopper(dispatch_kernel.notify_kernel, dict(transport_table=I64, heap_base=1 << 40, rank=1, epoch=3,
                                                           **status),
                       dict(PAYLOAD_SEND=4096, PAYLOAD_LANDING=8192, PAYLOAD_BYTES=4160, FLAG=0, NUM_RANKS=4, **common))
    compile_for_hopper(dispatch_kernel.network_send_kernel,
                       dict(transport_table=I64, heap_base=1 << 40, rank=1, node_rows_ptr=I32, cap=4096,
                            row_bytes=14608, send=1 << 20, landing=1 << 28, epoch=3, released_target=8, **status),
                       dict(TAIL=64, FREE=256, RANKS_PER_NODE=2, NUM_NODES=2, CHANNELS=CHANNELS, **common), PUT_WARPS)
    for has_scales, has_topk in ((False, True), (True, True), (False, False)):
        compile_for_hopper(dispatch_kernel.node_receive_kernel,
                           dict(node_peer_ptrs=I64, transport_table=I64, heap_base=1 << 40, rank=1, landing=1 << 28,
                                cap=4096, row_words=3652, landing_rows_ptr=I32, prefix_ptr=I32, x_words=3584,
                                scale_words=56, idx_word=3640, weights_word=3656, src_word=3664, pos_word=3665,
                                out_x_ptr=I32, out_scales_ptr=I32, out_idx_ptr=I64, out_weights_ptr=F32,
                                out_src_ptr=I32, num_out_rows=8192, kept_pos_ptr=I32, kept_rows=4096,
                                experts_per_rank=32, epoch=3, **status),
                           dict(TAIL=64, FREE=256, DONE=512, RANKS_PER_NODE=2, NUM_NODES=2, NUM_RANKS=4,
                                CHANNELS=CHANNELS, HAS_SCALES=has_scales, HAS_TOPK=has_topk, NUM_TOPK=8, TOPK_PAD=8,
                                NODE_PAD=2, ROWS=8, BLOCK=NODE_BLOCK, **common), RECEIVE_WARPS)
    compile_for_hopper(combine_kernel.stage_kernel,
                       dict(x_ptr=I32, weights_ptr=F32, num_rows=8192, hidden_words=3584, node_peer_ptrs=I64,
                            heap_base=1 << 40, rank=1, staging_x=1 << 29, staging_weights=(1 << 29) + (1 << 27),
                            epoch=3, released_target=2, **status),
                       dict(STAGED=128, STAGING_FREE=160, DONE=520, RANKS_PER_NODE=2, NUM_TOPK=8, WEIGHTS_PAD=8,
                            HAS_WEIGHTS=True, ROWS=8, BLOCK=1024, GPU=True), RECEIVE_WARPS)
    compile_for_hopper(combine_kernel.node_reduce_kernel,
                       dict(node_peer_ptrs=I64, transport_table=I64, heap_base=1 << 40, rank=1, prefix_ptr=I32,
                            landing_rows_ptr=I32, kept_pos_ptr=I32, kept_rows=4096, hidden=7168, staging_x=1 << 29,
                            staging_weights=(1 << 29) + (1 << 27), partial_send=1 << 30,
                            partial_landing=(1 << 30) + (1 << 28), cap=2048, epoch=3, released_target=2, **status),
                       dict(STAGED=128, STAGING_FREE=160, TAIL=192, FREE=448, DONE=528, RANKS_PER_NODE=2,
                            NUM_NODES=2, NUM_RANKS=4, CHANNELS=CHANNELS, WEIGHTS_PAD=8, HAS_WEIGHTS=True,
                            NODE_PAD=2, ROWS=8, BLOCK=NODE_BLOCK, **common), PUT_WARPS)
    compile_for_hopper(combine_kernel.final_reduce_kernel,
                       dict(transport_table=I64, heap_base=1 << 40, rank=1, node_pos_ptr=I32, num_tokens=4096,
                            hidden=7168, partial_landing=(1 << 30) + (1 << 28), cap=2048, bias0_ptr=BF16,
                            bias1_ptr=BF16, out_ptr=BF16, out_weights_ptr=F32, epoch=3, **status),
                       dict(TAIL=192, FREE=448, DONE=536, RANKS_PER_NODE=2, NUM_NODES=2, CHANNELS=CHANNELS, NUM_TOPK=8,
                            WEIGHTS_PAD=8, HAS_WEIGHTS=True, HAS_BIAS0=True, HAS_BIAS1=False, NODES_PAD=2, TOKENS=4,
                            BLOCK=NODE_BLOCK, **common), RECEIVE_WARPS)


def refused(group, variables: dict[str, str], **kwargs) -> str:
    """The InputError a Buffer made under ``variables`` raises, or "" if it is made."""
    from tritonep.core.checks import InputError

    try:
        make_buffer(group, "nvlink", variables, **kwargs).destroy()
    except InputError as error:
        return str(error)
    return ""


def test_split_group_refusals(nvlink_host_pools) -> None:
    """Before any communication: no num_rdma_bytes (either mode), NVSHMEM under the interpreter;
    low-latency mode is made (plain stores under the interpreter)."""
    pool = nvlink_host_pools(4)
    split = {GPUS_PER_NODE_VARIABLE: "2"}
    for message in pool.run(refused, split):
        assert "num_rdma_bytes must be > 0" in message, message
    for message in pool.run(refused, split, low_latency_mode=True):
        assert "num_rdma_bytes must be > 0" in message, message
    assert pool.run(refused, split, num_rdma_bytes=1 << 20, low_latency_mode=True, explicitly_destroy=True) == [""] * 4
    for message in pool.run(refused, {**split, "TRITONEP_TRANSPORT": "nvshmem"}, num_rdma_bytes=1 << 20):
        assert "NVSHMEM needs one GPU per rank" in message, message
