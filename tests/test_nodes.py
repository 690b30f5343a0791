"""Groups split into nodes (``TRITONEP_GPUS_PER_NODE``) on the collective (CPU) backend.

The collective backend is the oracle for the internode path: under any node split its
results must be exactly those of the same routing on a one-node group of as many ranks. Each
rank function returns its results to the test process, which compares the split pool's with
the single-node pool's. A split pool's ranks get ``TRITONEP_GPUS_PER_NODE`` through
``RankPool(env=...)``; tests in this process set it with ``gpus_per_node`` and restore it after.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
import torch
from collective_inputs import random_routing, stand_in_expert
from torch_defaults import pool_options

import tritonep as deep_ep
from tritonep.core import fp8, topology
from tritonep.core.checks import InputError
from tritonep.rank_pool import RankPool

NUM_EXPERTS = 12   # divisible by 4 and 6 ranks
HIDDEN = 256
T = 6              # low-latency num_max_dispatch_tokens_per_rank
SPLITS = [(2, 2), (2, 3), (3, 2)]   # (nodes, ranks per node)
ROUTINGS = ["random", "skewed", "empty", "all_dropped"]


@contextlib.contextmanager
def gpus_per_node(value: int | None) -> Iterator[None]:
    """``TRITONEP_GPUS_PER_NODE`` set to ``value`` (unset for None) inside the block."""
    variable = topology.GPUS_PER_NODE_VARIABLE
    previous = os.environ.pop(variable, None)
    if value is not None:
        os.environ[variable] = str(value)
    try:
        yield
    finally:
        os.environ.pop(variable, None)
        if previous is not None:
            os.environ[variable] = previous


def start_pool(num_ranks: int, per_node: int | None) -> RankPool:
    with gpus_per_node(None):   # the one-node reference must not inherit a split from the caller
        return RankPool(num_ranks, timeout=120, **pool_options(),
                        env={topology.GPUS_PER_NODE_VARIABLE: str(per_node)} if per_node else None)


@pytest.fixture(scope="module", params=SPLITS, ids=lambda split: f"{split[0]}x{split[1]}")
def split(request: pytest.FixtureRequest) -> Iterator[tuple[RankPool, int]]:
    """(a pool of nodes * ranks_per_node ranks split into nodes, the number of nodes)."""
    nodes, per_node = request.param
    pool = start_pool(nodes * per_node, per_node)
    try:
        yield pool, nodes
    finally:
        pool.close()


@pytest.fixture(scope="module")
def single_node_pools() -> Iterator[dict[int, RankPool]]:
    """One-node pools by size, started on first use (the reference of every split of that size)."""
    pools: dict[int, RankPool] = {}
    yield pools
    for pool in pools.values():
        pool.close()


def single_node_pool(pools: dict[int, RankPool], num_ranks: int) -> RankPool:
    if num_ranks not in pools:
        pools[num_ranks] = start_pool(num_ranks, None)
    return pools[num_ranks]


# ---------------------------------------------------------------------------- inputs
def make_inputs(seed: int, rank: int, num_tokens: int, routing: str = "random"
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x bf16 [N, H], topk_idx [N, 4] and weights; ``routing`` shapes topk_idx: "skewed" sends
    every token to the first node's experts (empty columns elsewhere), "empty" has no tokens,
    "all_dropped" only -1 entries."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    num_tokens = 0 if routing == "empty" else num_tokens
    x = torch.randn(num_tokens, HIDDEN, generator=g, dtype=torch.float32, device="cpu").bfloat16()
    topk_idx, weights = random_routing(g, num_tokens, NUM_EXPERTS, 4, 0.25)
    if routing == "skewed":
        topk_idx = torch.where(topk_idx >= 0, topk_idx % 3, -1)   # experts 0..2: rank 0, so node 0
    elif routing == "all_dropped":
        topk_idx = torch.full_like(topk_idx, -1)
    return x, topk_idx, weights


def brute_tokens_per_node(topk_idx: torch.Tensor, num_ranks: int, per_node: int) -> list[int]:
    experts_per_node = NUM_EXPERTS // num_ranks * per_node
    counts = [0] * (num_ranks // per_node)
    for row in topk_idx.tolist():
        for node in {e // experts_per_node for e in row if e >= 0}:
            counts[node] += 1
    return counts


def layout_and_dispatch(buffer: deep_ep.Buffer, x, topk_idx, weights):
    per_rank, per_node, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, NUM_EXPERTS)
    return buffer.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node,
                           is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                           topk_weights=weights)


# ---------------------------------------------------------------------------- rank functions
def case_tokens_per_node(group, seed: int, routing: str) -> None:
    buffer = deep_ep.Buffer(group)
    _, topk_idx, _ = make_inputs(seed, group.rank(), 9, routing)
    per_node = buffer.get_dispatch_layout(topk_idx, NUM_EXPERTS)[1]
    assert per_node.dtype == torch.int32 and per_node.device == buffer.device
    assert per_node.tolist() == brute_tokens_per_node(topk_idx, group.size(), buffer.ranks_per_node)


def case_dispatch_combine(group, seed: int, use_fp8: bool, num_nodes: int) -> dict[str, object]:
    """Fresh dispatch, cached dispatch of other values and combine; returns every output."""
    buffer = deep_ep.Buffer(group)
    assert buffer.num_nodes == num_nodes and buffer.ranks_per_node * num_nodes == group.size()
    x, topk_idx, weights = make_inputs(seed, group.rank(), 3 + 2 * group.rank())
    second_x = (x.float() * -2 + 1).bfloat16()
    as_sent = fp8.cast_to_fp8 if use_fp8 else (lambda values: values)
    recv_x, recv_idx, recv_w, per_expert_list, handle, _ = layout_and_dispatch(buffer, as_sent(x), topk_idx, weights)
    cached_x = buffer.dispatch(as_sent(second_x), handle=handle)[0]
    # Rows back to bf16 (fp8 bytes scaled per 128 channels) so that combine gets real values.
    rows = (recv_x[0].float().view(recv_x[0].shape[0], -1, 128) * recv_x[1].unsqueeze(-1)
            ).view(recv_x[0].shape).bfloat16() if use_fp8 else recv_x
    combined, combined_w, _ = buffer.combine(rows, handle, topk_weights=recv_w)
    return {"recv_x": recv_x, "recv_topk_idx": recv_idx, "recv_topk_weights": recv_w,
            "num_recv_tokens_per_expert_list": per_expert_list, "cached_x": cached_x,
            "combined_x": combined, "combined_topk_weights": combined_w}


def case_internode_handle(group) -> None:
    """The handle reads as DeepEP's internode 10-tuple does in DeepEP's own internode test: rows
    from ranks 0..i end at ``handle[-4][i]`` (each rank sends rows filled with its rank), rows
    from nodes 0..n at ``handle[4][n]``, and ``handle[0]`` is is_token_in_rank. A cached dispatch
    and a combine take it back."""
    buffer = deep_ep.Buffer(group)
    rank, per_node = group.rank(), buffer.ranks_per_node
    _, topk_idx, weights = make_inputs(5, rank, 7)
    x = torch.full((7, HIDDEN), float(rank), dtype=torch.bfloat16)
    recv_x, _, _, _, handle, _ = layout_and_dispatch(buffer, x, topk_idx, weights)
    assert len(handle) == 10 and torch.equal(handle[0], buffer.get_dispatch_layout(topk_idx, NUM_EXPERTS)[3])
    from_ranks, from_nodes = handle[-4], handle[4]
    assert from_ranks.dtype == torch.int32 and from_ranks.shape == (group.size(),)
    assert from_nodes.tolist() == from_ranks[per_node - 1::per_node].tolist()
    start = 0
    for source, end in enumerate(from_ranks.tolist()):
        assert bool((recv_x[start:end].float() == source).all()), f"rows {start}..{end} are not rank {source}'s"
        start = end
    assert start == recv_x.shape[0]
    assert torch.equal(buffer.dispatch(x, handle=handle)[0], recv_x)
    combined = buffer.combine(recv_x, handle)[0]
    assert combined.shape == x.shape


def case_low_latency(group, seed: int) -> dict[str, torch.Tensor]:
    size = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, HIDDEN, group.size(), NUM_EXPERTS)
    buffer = deep_ep.Buffer(group, num_rdma_bytes=size, low_latency_mode=True)
    x, topk_idx, weights = make_inputs(seed, group.rank(), T)
    packed, counts, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, T, NUM_EXPERTS, use_fp8=True)
    outputs = stand_in_expert(packed, True, group.rank())
    combined, _, _ = buffer.low_latency_combine(outputs, topk_idx, weights, handle)
    valid = counts.tolist()
    return {"packed_x": torch.cat([packed[0][e, :n].view(torch.uint8) for e, n in enumerate(valid)]),
            "packed_scales": torch.cat([packed[1][e, :n] for e, n in enumerate(valid)]),
            "packed_recv_count": counts, "combined_x": combined}


def case_errors(group) -> list[str]:
    """Every bad call of a split group raises InputError; returns the messages."""
    buffer = deep_ep.Buffer(group)
    x, topk_idx, weights = make_inputs(5, group.rank(), 4)
    per_rank, per_node, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, NUM_EXPERTS)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                  topk_idx=topk_idx, topk_weights=weights)
    handle = buffer.dispatch(x, num_tokens_per_rdma_rank=per_node, **layout)[4]
    bad_calls = {
        "omitted": lambda: buffer.dispatch(x, **layout),
        "shape": lambda: buffer.dispatch(x, num_tokens_per_rdma_rank=per_rank, **layout),
        "dtype": lambda: buffer.dispatch(x, num_tokens_per_rdma_rank=per_node.long(), **layout),
        "cached": lambda: buffer.dispatch(x, handle=handle, num_tokens_per_rdma_rank=per_node),
    }
    messages = []
    for name, call in bad_calls.items():
        try:
            call()
        except InputError as error:
            messages.append(str(error))
        else:
            raise AssertionError(f"{name}: no InputError")
    return messages


def case_buffer_refused(group, variables: dict[str, str]) -> str:
    """The message of the InputError a Buffer raises under these environment variables."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        deep_ep.Buffer(group)
    except InputError as error:
        return str(error)
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value
    raise AssertionError(f"Buffer accepted {variables}")


def case_one_node_rejects_counts(group) -> str:
    buffer = deep_ep.Buffer(group)
    x, topk_idx, weights = make_inputs(5, group.rank(), 4)
    per_rank, per_node, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, NUM_EXPERTS)
    assert per_node is None and buffer.num_nodes == 1
    try:
        buffer.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=torch.zeros(
            1, dtype=torch.int32), is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    except InputError as error:
        return str(error)
    raise AssertionError("a one-node Buffer accepted num_tokens_per_rdma_rank")


# ---------------------------------------------------------------------------- comparisons
def assert_same(got, expected, where: str) -> None:
    if isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype and got.shape == expected.shape, where
        same = torch.equal(got.view(torch.uint8), expected.view(torch.uint8)) if got.numel() else True
        assert same, f"{where} differs"
    elif isinstance(expected, (tuple, list)) and expected and isinstance(expected[0], torch.Tensor):
        assert len(got) == len(expected), where
        for index, (a, b) in enumerate(zip(got, expected)):
            assert_same(a, b, f"{where}[{index}]")
    else:
        assert got == expected, f"{where}: {got} != {expected}"


def assert_same_as_single_node(split_results: list[dict], single_results: list[dict]) -> None:
    for rank, (got, expected) in enumerate(zip(split_results, single_results)):
        assert got.keys() == expected.keys()
        for name in expected:
            assert_same(got[name], expected[name], f"rank {rank} {name}")


# ---------------------------------------------------------------------------- tests
@pytest.mark.parametrize("routing", ROUTINGS)
def test_tokens_per_node_match_brute_force(split, routing: str) -> None:
    pool, _ = split
    pool.run(case_tokens_per_node, 11, routing)


@pytest.mark.parametrize("use_fp8", [False, True], ids=["bf16", "fp8"])
def test_dispatch_combine_same_as_single_node(split, single_node_pools, use_fp8: bool) -> None:
    pool, nodes = split
    reference = single_node_pool(single_node_pools, pool.num_ranks)
    assert_same_as_single_node(pool.run(case_dispatch_combine, 3, use_fp8, nodes),
                               reference.run(case_dispatch_combine, 3, use_fp8, 1))


def test_handle_placed_like_deep_ep_internode(split) -> None:
    pool, _ = split
    pool.run(case_internode_handle)


def test_low_latency_same_as_single_node(split, single_node_pools) -> None:
    pool, nodes = split
    if nodes != 2 or pool.num_ranks != 4:
        pytest.skip("one split is enough: low-latency mode does not look at nodes")
    reference = single_node_pool(single_node_pools, pool.num_ranks)
    assert_same_as_single_node(pool.run(case_low_latency, 7), reference.run(case_low_latency, 7))


def test_bad_tokens_per_node_raise(split) -> None:
    pool, nodes = split
    for messages in pool.run(case_errors):
        omitted, shape, dtype, cached = messages
        assert "needs num_tokens_per_rdma_rank" in omitted and f"span {nodes} nodes" in omitted
        assert f"shape [{nodes}]" in shape and f"got [{pool.num_ranks}]" in shape
        assert "torch.int32" in dtype and "torch.int64" in dtype
        assert "must be None in cached dispatch" in cached


def test_split_that_does_not_divide_the_group_is_refused(split) -> None:
    pool, _ = split
    for message in pool.run(case_buffer_refused, {topology.GPUS_PER_NODE_VARIABLE: "4" if pool.num_ranks == 6
                                                  else "3"}):
        assert topology.GPUS_PER_NODE_VARIABLE in message and f"{pool.num_ranks} ranks" in message


def test_internode_backend_needs_rdma_bytes(split) -> None:
    """On GPUs (here: the NVLink kind) a split group gets the internode backend, whose heap is
    num_rdma_bytes: a Buffer without it is refused before any communication."""
    pool, nodes = split
    for message in pool.run(case_buffer_refused, {"TRITONEP_BACKEND": "nvlink"}):
        assert f"spans {nodes} nodes of {pool.num_ranks // nodes} ranks" in message
        assert "num_rdma_bytes must be > 0" in message


def test_one_node_rejects_tokens_per_node(single_node_pools) -> None:
    for message in single_node_pool(single_node_pools, 4).run(case_one_node_rejects_counts):
        assert "num_tokens_per_rdma_rank must be None" in message and "one node" in message


@pytest.mark.parametrize("num_ranks, expected", [(1, 1), (4, 4), (8, 8), (16, 8), (24, 8)])
def test_ranks_per_node_default(monkeypatch: pytest.MonkeyPatch, num_ranks: int, expected: int) -> None:
    monkeypatch.delenv(topology.GPUS_PER_NODE_VARIABLE, raising=False)
    monkeypatch.delenv(topology.LAUNCHER_VARIABLE, raising=False)
    assert topology.ranks_per_node(num_ranks) == expected
    assert topology.num_nodes(num_ranks) == num_ranks // expected


@pytest.mark.parametrize("num_ranks", [3, 12, 20])
def test_ranks_per_node_default_other_sizes_are_one_node(monkeypatch: pytest.MonkeyPatch, num_ranks: int) -> None:
    """Sizes that are not whole nodes of 8 (any rank count works on CPU ranks) are one node."""
    monkeypatch.delenv(topology.GPUS_PER_NODE_VARIABLE, raising=False)
    monkeypatch.delenv(topology.LAUNCHER_VARIABLE, raising=False)
    assert topology.ranks_per_node(num_ranks) == num_ranks
    assert topology.num_nodes(num_ranks) == 1


@pytest.mark.parametrize("num_ranks, local_world_size, expected", [(16, 8, 8), (8, 4, 4), (4, 8, 4), (12, 12, 12),
                                                                  (6, 3, 3)])
def test_ranks_per_node_from_the_launcher(monkeypatch: pytest.MonkeyPatch, num_ranks: int, local_world_size: int,
                                          expected: int) -> None:
    """torchrun's LOCAL_WORLD_SIZE gives real nodes: 8 ranks on nodes of 4 GPUs are two nodes
    (DeepEP's rule would say one), a group within a node is one node."""
    monkeypatch.delenv(topology.GPUS_PER_NODE_VARIABLE, raising=False)
    monkeypatch.setenv(topology.LAUNCHER_VARIABLE, str(local_world_size))
    assert topology.ranks_per_node(num_ranks) == expected
    monkeypatch.setenv(topology.GPUS_PER_NODE_VARIABLE, "1")   # the explicit setting comes first
    assert topology.ranks_per_node(num_ranks) == 1


def test_ranks_per_node_launcher_nodes_must_be_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(topology.GPUS_PER_NODE_VARIABLE, raising=False)
    monkeypatch.setenv(topology.LAUNCHER_VARIABLE, "8")
    with pytest.raises(InputError, match=r"12 ranks .*LOCAL_WORLD_SIZE=8.*TRITONEP_GPUS_PER_NODE"):
        topology.ranks_per_node(12)


@pytest.mark.parametrize("setting", ["0", "-2", "5", "two"])
def test_ranks_per_node_setting_must_divide(monkeypatch: pytest.MonkeyPatch, setting: str) -> None:
    monkeypatch.setenv(topology.GPUS_PER_NODE_VARIABLE, setting)
    with pytest.raises(InputError, match=rf"TRITONEP_GPUS_PER_NODE='{setting}'.*12 ranks"):
        topology.ranks_per_node(12)


def test_ranks_per_node_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(topology.GPUS_PER_NODE_VARIABLE, "3")
    assert topology.ranks_per_node(12) == 3 and topology.num_nodes(12) == 4
