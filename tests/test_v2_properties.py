"""Property tests of V2's round trip (ElasticBuffer on the collective backend) against brute force
and against V1's Buffer on the same routing.

Hypothesis draws a whole world (every rank's tokens, top-k ids, weights, fp8 rows) in the pytest
process; one RankPool per world size runs ``v2_world.round_trip`` and hands the outputs back;
every expected value is computed here by loops over (source rank, token, k).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from routed_world import run_world
from torch_defaults import pool_options
from v2_world import (
    FP8,
    STRATEGIES,
    World,
    aligned,
    build_world,
    expanded_layout,
    expert_factor,
    expert_pairs,
    local_ids,
    rank_of,
    received,
    round_trip,
    worst_expanded,
)

from tritonep.rank_pool import RankPool

EXAMPLES = max(4, settings().max_examples // 2)
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
                print_blob=True)


@pytest.fixture(scope="module")
def pools():
    started: dict[int, RankPool] = {}

    def get(num_ranks: int) -> RankPool:
        if num_ranks not in started or not started[num_ranks]._processes:
            started[num_ranks] = RankPool(num_ranks, timeout=60, **pool_options())
        return started[num_ranks]

    yield get
    for pool in started.values():
        pool.close()


@st.composite
def worlds(draw, num_ranks: int) -> World:
    return build_world(
        num_ranks, seed=draw(st.integers(0, 2**32 - 1)),
        strategy=draw(st.sampled_from(["uniform", "uniform", "skewed", "skewed", "empty", "all_to_one",
                                       "all_minus_one"])),
        tokens=[draw(st.integers(0, 9)) for _ in range(num_ranks)], H=draw(st.sampled_from([128, 256])),
        E_local=draw(st.integers(1, 3)), K=draw(st.integers(1, 5)), T_extra=draw(st.integers(0, 2)),
        alignment=draw(st.sampled_from([1, 1, 2, 16, 128])), num_biases=draw(st.integers(0, 2)),
        packed_scales=draw(st.booleans()), expand_no_sync=draw(st.booleans()),
        col_major_scales=draw(st.booleans()))


# ----------------------------------------------------------------------------- checks
def _stack(rows: list[torch.Tensor], width: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.stack(rows) if rows else torch.zeros(0, width, dtype=dtype)


def _close(got: torch.Tensor, expected: torch.Tensor, what: str, world: World, tol: float = 2e-2) -> None:
    assert got.shape == expected.shape, f"{what}: shape {list(got.shape)} != {list(expected.shape)}"
    bad = ~torch.isclose(got.float(), expected.float(), rtol=tol, atol=tol)
    assert not bad.any(), f"{what}: {int(bad.sum())} elements differ\n{world.describe()}"


def _check_fields(world: World, r: int, fields: dict, expanded: bool, synced: bool, what: str) -> None:
    rows = received(world, r)
    pairs = expert_pairs(world, r)
    counts = [len(p) for p in pairs]
    padded = [aligned(c, world.alignment) for c in counts]
    assert fields["unaligned"].tolist() == counts, f"{what}: unaligned counts\n{world.describe()}"
    if expanded:
        starts = [sum(padded[:e]) for e in range(world.E_local)]
        assert fields["psum_expert"].tolist() == [s + c for s, c in zip(starts, counts)], what
    else:
        assert fields["psum_expert"].tolist() == [sum(padded[:e + 1]) for e in range(world.E_local)], what
    per_source = [sum(1 for s, _ in rows if s == source) for source in range(world.R)]
    assert fields["psum_rank"].tolist() == [sum(per_source[:i + 1]) for i in range(world.R)], what
    if synced:
        assert fields["expert_list"] == padded and fields["num_recv"] == len(rows), what
        assert fields["num_expanded"] == sum(padded), what
    else:
        assert fields["expert_list"] == [] and fields["num_recv"] == world.R * world.T, what
        assert fields["num_expanded"] == worst_expanded(world), what
    metadata = fields["metadata"]
    assert metadata.dtype == torch.int32 and metadata.shape == (fields["num_recv"], world.K + 2), what
    slot_of = {pair: i for i, pair in enumerate(expanded_layout(world, r)) if pair is not None}
    for i, (s, t) in enumerate(rows):
        ids = local_ids(world, s, t, r)
        first = next(k for k, e in enumerate(ids) if e >= 0)
        expected = [s * world.T + t, s * world.K + first]
        expected += [slot_of[(s, t, k)] if e >= 0 else -1 for k, e in enumerate(ids)] if expanded else [-1] * world.K
        assert metadata[i].tolist() == expected, f"{what}: recv_src_metadata row {i}\n{world.describe()}"
    assert bool((metadata[len(rows):] == -1).all()), f"{what}: padding rows of recv_src_metadata"
    position = {r_: {pair: i for i, pair in enumerate(received(world, r_))} for r_ in range(world.R)}
    dst = [[position[rank_of(world, e)][(r, t)] if e >= 0 else -1 for e in row]
           for t, row in enumerate(world.topk[r].tolist())]
    assert fields["dst"].tolist() == dst, f"{what}: dst_buffer_slot_idx\n{world.describe()}"


def _expected_expanded_combine(world: World, r: int) -> torch.Tensor:
    n = world.topk[r].shape[0]
    total = torch.zeros(n, world.H, dtype=torch.float32)
    for t in range(n):
        for e in world.topk[r][t].tolist():
            if e >= 0:
                total[t] += (world.x[r][t].float() * expert_factor(e)).to(torch.bfloat16).float()
    for bias in world.biases[r]:
        total += bias.float()
    return total


def _check_rank(world: World, r: int, out: dict) -> None:
    rows = received(world, r)
    M, K, H = len(rows), world.K, world.H
    exp_x = _stack([world.x[s][t] for s, t in rows], H, torch.bfloat16)
    exp_idx = [local_ids(world, s, t, r) for s, t in rows]
    exp_w = [[float(world.weights[s][t, k]) if exp_idx[i][k] >= 0 else 0.0 for k in range(K)]
             for i, (s, t) in enumerate(rows)]
    v1_x, v1_idx, v1_w, v1_list, v1_combined, v1_combined_w, v1_expanded_combined = out["v1"]

    # Not expanded: the brute force, and V1's answer bit for bit.
    recv_x, recv_idx, recv_w, fields, combined, combined_w = out["plain"]
    assert torch.equal(recv_x, exp_x) and recv_idx.tolist() == exp_idx and recv_w.tolist() == exp_w, \
        f"rank {r} dispatch\n{world.describe()}"
    assert torch.equal(recv_x, v1_x) and torch.equal(recv_idx, v1_idx) and torch.equal(recv_w, v1_w)
    assert fields["expert_list"] == v1_list
    _check_fields(world, r, fields, expanded=False, synced=True, what=f"rank {r} plain handle")
    assert torch.equal(combined, v1_combined) and torch.equal(combined_w, v1_combined_w), \
        f"rank {r}: V2 combine differs from V1's\n{world.describe()}"
    copies = torch.tensor([len({rank_of(world, e) for e in row if e >= 0}) for row in world.topk[r].tolist()],
                          dtype=torch.float32).view(-1, 1)
    expected = world.x[r].float() * copies + sum((b.float() for b in world.biases[r]), torch.zeros(1))
    _close(combined, expected, f"rank {r} combine", world)
    assert torch.equal(combined_w, torch.where(world.topk[r] >= 0, world.weights[r], 0.0)), f"rank {r} weights"
    c_x, c_idx, c_w_none, same_handle = out["cached"]
    assert torch.equal(c_x, _stack([world.x2[s][t] for s, t in rows], H, torch.bfloat16)), f"rank {r} cached"
    assert c_idx.tolist() == exp_idx and c_w_none and same_handle

    # Expanded: every pair at its slot, zero padding, and V1's answer through the summed expert.
    e_x, e_idx_none, e_w, e_fields, e_combined, e_combined_w = out["expand"]
    layout = expanded_layout(world, r)
    assert e_idx_none and e_x.shape == (len(layout), H) and e_w.shape == (len(layout),)
    c_x, c_idx_none, c_w = out["cached_expand"]
    for i, pair in enumerate(layout):
        source_x, source_x2 = (world.x[pair[0]][pair[1]], world.x2[pair[0]][pair[1]]) if pair else (0, 0)
        weight = float(world.weights[pair[0]][pair[1], pair[2]]) if pair else 0.0
        assert bool((e_x[i] == source_x).all()) and float(e_w[i]) == weight, \
            f"rank {r} expanded row {i} ({pair})\n{world.describe()}"
        assert bool((c_x[i] == source_x2).all()) and float(c_w[i]) == weight, f"rank {r} cached expanded row {i}"
    assert c_idx_none
    _check_fields(world, r, e_fields, expanded=True, synced=True, what=f"rank {r} expanded handle")
    assert torch.equal(e_combined, v1_expanded_combined), f"rank {r}: expanded combine != V1's\n{world.describe()}"
    _close(e_combined, _expected_expanded_combine(world, r), f"rank {r} expanded combine", world, tol=3e-2)
    assert torch.equal(e_combined_w, torch.where(world.topk[r] >= 0, world.weights[r], 0.0))
    assert out["stats"].tolist() == [2 * len(p) for p in expert_pairs(world, r)], f"rank {r} stats"

    # No CPU sync (fp8): worst-case sizes, the same rows first.
    n_data, n_scales, n_idx, n_w, n_fields, n_combined = out["no_sync"]
    expand = world.expand_no_sync
    _check_fields(world, r, n_fields, expanded=expand, synced=False, what=f"rank {r} no-sync handle")
    exp_data = _stack([world.fp8_data[s][t] for s, t in rows], H, torch.uint8)
    exp_scales = _stack([world.fp8_scales[s][t] for s, t in rows], world.fp8_scales[0].shape[1],
                        world.fp8_scales[0].dtype)
    if not expand:
        assert n_data.shape == (world.R * world.T, H) and n_idx.shape == (world.R * world.T, K)
        assert torch.equal(n_data[:M], exp_data) and torch.equal(n_scales[:M], exp_scales)
        assert n_idx[:M].tolist() == exp_idx and bool((n_idx[M:] == -1).all()) and n_w[:M].tolist() == exp_w
        return
    assert n_data.shape[0] == worst_expanded(world) and n_idx is None and n_w.shape == (worst_expanded(world),)
    for i in range(n_data.shape[0]):
        pair = layout[i] if i < len(layout) else None
        if pair is None:
            assert bool((n_data[i] == 0).all()) and bool((n_scales[i] == 0).all()) and float(n_w[i]) == 0.0
        else:
            assert torch.equal(n_data[i], world.fp8_data[pair[0]][pair[1]]), f"rank {r} no-sync row {i}"
            assert torch.equal(n_scales[i], world.fp8_scales[pair[0]][pair[1]])
    n = world.topk[r].shape[0]
    fp8_rows = world.fp8_data[r].view(FP8).float()
    total = torch.zeros(n, H, dtype=torch.float32)
    for t in range(n):
        for e in world.topk[r][t].tolist():
            if e >= 0:
                total[t] += (fp8_rows[t] * expert_factor(e)).to(torch.bfloat16).float()
    _close(n_combined, total, f"rank {r} no-sync expanded combine", world, tol=3e-2)


def _run(pool: RankPool, world: World) -> None:
    for r, out in enumerate(run_world(pool, round_trip, world)):
        _check_rank(world, r, out)


# ----------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("num_ranks", [2, 3])
@settings(max_examples=EXAMPLES, **SETTINGS)
@given(data=st.data())
def test_round_trip(pools, num_ranks, data):
    _run(pools(num_ranks), data.draw(worlds(num_ranks)))


@pytest.mark.parametrize("alignment", [1, 16, 128])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy(pools, strategy, alignment):
    """One fixed example per routing strategy and alignment, whatever hypothesis draws."""
    seed = 100 * STRATEGIES.index(strategy) + alignment
    world = build_world(3, seed, strategy=strategy, K=3, E_local=2, alignment=alignment, num_biases=seed % 3,
                        packed_scales=bool(seed % 2), expand_no_sync=alignment != 16)
    _run(pools(3), world)
