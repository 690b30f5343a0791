"""Property tests of the whole round trip on the CPU (collective) backend.

Hypothesis draws the routing of a whole world (every rank's tokens, top-k ids and weights) in
the pytest process; one long-lived ``RankPool`` per world size runs the calls, each rank
picking its own inputs, and hands back its raw outputs. Every expected value is computed here
by brute-force loops over (source rank, token, k) that share no code with ``tritonep.core.routing``.

fp8 tensors cannot be pickled by torch, so they travel between processes as uint8 views.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from deep_ep_user import check_wait_stats
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from routed_world import RoutedWorld, run_world
from torch_defaults import pool_options

from tritonep.core.topology import GPUS_PER_NODE_VARIABLE
from tritonep.rank_pool import RankPool

FP8 = torch.float8_e4m3fn
POOL_TIMEOUT_S = 60.0
MAX_TOKENS = 12
STRATEGIES = ("uniform", "skewed", "empty", "one_rank", "all_minus_one", "mixed")

# The loaded hypothesis profile (tests/conftest.py: "ci" 25 examples, "dev" 200) sets the budget
# of the main round-trip search; the costlier searches get a fraction of it.
PROFILE_EXAMPLES = settings().max_examples
SETTINGS = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)


# ----------------------------------------------------------------------------- pools
@pytest.fixture(scope="module")
def pools():
    """One RankPool per world size (and node split: ``ranks_per_node``, None for one node),
    started on first use and kept for the whole module."""
    started: dict[tuple[int, int | None], RankPool] = {}

    def get(num_ranks: int, ranks_per_node: int | None = None) -> RankPool:
        key = (num_ranks, ranks_per_node)
        pool = started.get(key)
        if pool is None or not pool._processes:  # a pool closed by a hang is restarted
            env = {GPUS_PER_NODE_VARIABLE: str(ranks_per_node)} if ranks_per_node else None
            pool = started[key] = RankPool(num_ranks, timeout=POOL_TIMEOUT_S, env=env, **pool_options())
        return pool

    yield get
    for pool in started.values():
        pool.close()


# ----------------------------------------------------------------------------- the world
@dataclass
class World(RoutedWorld):
    fp8: bool                          # also dispatch an (fp8, scales) tuple
    fp8_data: list[torch.Tensor] = field(default_factory=list)   # uint8 view of e4m3 [N_r, H]
    fp8_scales: list[torch.Tensor] = field(default_factory=list)  # float32 [N_r, H/128] or int32 [N_r, 1]
    scales_col_major: bool = False
    packed_scales: bool = False        # int32 (UE8M0-packed) scales instead of float32
    alignment: int = 1
    worst_extra: int = 0
    num_biases: int = 0
    biases: list[tuple[torch.Tensor, ...]] = field(default_factory=list)
    use_hook: bool = False
    zero_copy: bool = False
    round_scale: bool = False
    ranks_per_node: int | None = None  # the pool splits the group into nodes of this many ranks

    def options(self) -> str:
        return (f"fp8={self.fp8} align={self.alignment} hook={self.use_hook} zero_copy={self.zero_copy} "
                f"round_scale={self.round_scale}")


def _make_topk(rng: np.random.Generator, n: int, K: int, E: int, R: int, strategy: str, p_drop: float,
               hot_expert: int, target_rank: int) -> np.ndarray:
    """[n, K] rows of distinct expert ids, -1 allowed anywhere."""
    E_local = E // R
    out = np.full((n, K), -1, dtype=np.int64)
    for t in range(n):
        if strategy == "all_minus_one":
            continue
        if strategy == "one_rank":
            pool = np.arange(target_rank * E_local, (target_rank + 1) * E_local)
        else:
            pool = np.arange(E)
        count = min(K, len(pool))
        if strategy == "skewed":
            prob = np.where(pool // E_local == hot_expert // E_local, 20.0, 1.0)
            prob[pool == hot_expert] = 1000.0
            chosen = rng.choice(pool, size=count, replace=False, p=prob / prob.sum())
        else:
            chosen = rng.choice(pool, size=count, replace=False)
        chosen = chosen[rng.random(count) >= p_drop]
        out[t, rng.permutation(K)[: len(chosen)]] = chosen
    return out


@dataclass
class Knobs:
    """Everything about an example except the random data, which ``seed`` determines."""

    H: int = 256
    E_local: int = 2
    K: int = 4
    strategy: str = "uniform"
    seed: int = 0
    tokens: list[int] | None = None    # N_r per rank; None: drawn from the seed
    T_extra: int = 1
    fp8: bool = True
    scales_col_major: bool = True
    packed_scales: bool = False
    alignment: int = 1
    worst_extra: int = 1
    num_biases: int = 1
    use_hook: bool = False
    zero_copy: bool = False
    round_scale: bool = False


def build_world(R: int, knobs: Knobs) -> World:
    rng = np.random.default_rng(knobs.seed)
    H, E, K, strategy = knobs.H, R * knobs.E_local, knobs.K, knobs.strategy
    if strategy == "empty":
        tokens = [0] * R
    elif knobs.tokens is not None:
        tokens = knobs.tokens
    else:
        tokens = [int(n) for n in rng.integers(1, MAX_TOKENS + 1, size=R)]
    T = max(max(tokens), 1) + knobs.T_extra
    topk, weights, x, x2 = [], [], [], []
    for r in range(R):
        rank_strategy = strategy
        if strategy == "mixed":
            rank_strategy = str(rng.choice(["uniform", "skewed", "one_rank", "all_minus_one"]))
        p_drop = float(rng.choice([0.0, 0.0, 0.2, 0.6]))
        idx = _make_topk(rng, tokens[r], K, E, R, rank_strategy, p_drop, hot_expert=int(rng.integers(E)),
                         target_rank=int(rng.integers(R)))
        topk.append(torch.from_numpy(idx))
        # Weights in [0.1, 1); where topk == -1 they hold garbage the library must ignore.
        w = torch.from_numpy(rng.uniform(0.1, 1.0, size=(tokens[r], K)).astype(np.float32))
        w = torch.where(topk[-1] >= 0, w, torch.full_like(w, 7.0))
        weights.append(w)
        x.append(torch.from_numpy(rng.standard_normal((tokens[r], H)).astype(np.float32)).to(torch.bfloat16))
        x2.append(torch.from_numpy(3 * rng.standard_normal((tokens[r], H)).astype(np.float32))
                  .to(torch.bfloat16))
    world = World(R=R, H=H, E=E, K=K, T=T, strategy=strategy, x=x, x2=x2, topk=topk, weights=weights,
                  fp8=knobs.fp8, scales_col_major=knobs.scales_col_major, packed_scales=knobs.packed_scales,
                  alignment=knobs.alignment,
                  worst_extra=knobs.worst_extra, num_biases=knobs.num_biases, use_hook=knobs.use_hook,
                  zero_copy=knobs.zero_copy, round_scale=knobs.round_scale)
    for r in range(R):
        if world.fp8:
            data = torch.from_numpy(rng.uniform(-400, 400, size=(tokens[r], H)).astype(np.float32)).to(FP8)
            world.fp8_data.append(data.view(torch.uint8))
            if world.packed_scales:  # any int32 bit patterns: they are carried, never read
                world.fp8_scales.append(torch.from_numpy(rng.integers(-2**31, 2**31, size=(tokens[r], 1))
                                                         .astype(np.int32)))
            else:
                world.fp8_scales.append(torch.from_numpy(rng.uniform(0.01, 2.0, size=(tokens[r], H // 128))
                                                         .astype(np.float32)))
        world.biases.append(tuple(
            torch.from_numpy(rng.standard_normal((tokens[r], H)).astype(np.float32)).to(torch.bfloat16)
            for _ in range(world.num_biases)))
    return world


@st.composite
def worlds(draw, num_ranks: int) -> World:
    # Common routings are weighted up; the degenerate ones also get a fixed example each in
    # test_every_strategy, so the search spends most of its budget on busy worlds.
    strategy = draw(st.sampled_from(["uniform", "uniform", "skewed", "skewed", "mixed", "mixed", "one_rank",
                                     "empty", "all_minus_one"]))
    knobs = Knobs(
        H=draw(st.sampled_from([128, 256])),
        E_local=draw(st.integers(1, 4)),
        K=draw(st.integers(1, 8)),
        strategy=strategy,
        seed=draw(st.integers(0, 2**32 - 1)),
        tokens=[draw(st.integers(0, MAX_TOKENS)) for _ in range(num_ranks)],
        T_extra=draw(st.integers(0, 3)),
        fp8=draw(st.booleans()),
        scales_col_major=draw(st.booleans()),
        packed_scales=draw(st.booleans()),
        alignment=draw(st.sampled_from([1, 1, 2, 4, 128])),
        worst_extra=draw(st.integers(0, 3)),
        num_biases=draw(st.integers(0, 2)),
        use_hook=draw(st.booleans()),
        zero_copy=draw(st.booleans()),
        round_scale=draw(st.booleans()),
    )
    return build_world(num_ranks, knobs)


# ----------------------------------------------------------------------------- on the ranks
def _expert_factor(num_experts: int) -> torch.Tensor:
    """The 'expert' of the low-latency round trip multiplies its rows by (global id + 1)."""
    return torch.arange(1, num_experts + 1, dtype=torch.float32)


def _round_trip(group, world: World) -> dict:
    """Every call of one example on this rank; returns copies of all outputs."""
    try:
        return _round_trip_calls(group, world)
    except BaseException:
        # If only this rank fails, its peers may wait in a collective until the pool times out
        # and this rank's traceback never reaches the caller: print it (pytest captures it).
        import sys
        import traceback

        print(f"rank {group.rank()} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        raise


def _round_trip_calls(group, world: World) -> dict:
    import tritonep as deep_ep

    rank, R = group.rank(), group.size()
    E, H, T, E_local = world.E, world.H, world.T, world.E_local
    x, topk, weights = world.x[rank], world.topk[rank], world.weights[rank]
    buffer = deep_ep.Buffer(group, num_nvl_bytes=1 << 20,
                            num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, R, E),
                            low_latency_mode=True)
    out: dict = {}

    # ---- normal mode
    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, E)
    out["layout"] = (per_rank.clone(), per_rdma, per_expert.clone(), in_rank.clone())
    recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=weights, expert_alignment=world.alignment)
    out["dispatch"] = (recv_x.clone(), recv_idx.clone(), recv_w.clone(), list(counts),
                       handle.rank_prefix_matrix.clone())
    out["list_types"] = (type(counts).__name__, sorted({type(c).__name__ for c in counts}))

    biases = world.biases[rank]
    bias = None if not biases else (biases[0] if len(biases) == 1 else tuple(biases))
    combined, combined_w, _ = buffer.combine(recv_x, handle, topk_weights=recv_w, bias=bias)
    out["combine"] = (combined.clone(), combined_w.clone())

    cached_x = world.x2[rank]
    if world.fp8:
        scales = world.fp8_scales[rank]
        if world.scales_col_major:
            scales = scales.t().contiguous().t()
        cached_x = (world.fp8_data[rank].view(FP8), scales)
    # DeepEP's overlap pattern: wait on a captured event, finish asynchronously, then wait.
    cached = buffer.dispatch(cached_x, handle=handle, previous_event=deep_ep.Buffer.capture(), async_finish=True,
                             allocate_on_comm_stream=True)
    cached[5].current_stream_wait()
    cached_recv = cached[0]
    if world.fp8:
        cached_recv = (cached_recv[0].view(torch.uint8).clone(), cached_recv[1].clone())
    else:
        cached_recv = cached_recv.clone()
    out["cached"] = (cached_recv, [value is None for value in cached[1:5]])
    if world.fp8:  # a fresh dispatch of the fp8 tuple: data and scales ride with the top-k
        (f_data, f_scales), f_idx, f_w, f_counts, _, _ = buffer.dispatch(
            cached_x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=weights, expert_alignment=world.alignment)
        out["fresh_fp8"] = ((f_data.view(torch.uint8).clone(), f_scales.clone()), f_idx.clone(), f_w.clone(),
                            list(f_counts))

    # The caller's bound is the same on all ranks: rows this rank could receive at most, plus slack.
    num_worst = max(1, world.worst_extra + _max_received(world))
    w_recv_x, w_recv_idx, w_recv_w, w_counts, w_handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=weights, num_worst_tokens=num_worst)
    w_combined, _, event = buffer.combine(w_recv_x, w_handle, async_finish=True)
    event.current_stream_wait()
    w_cached = buffer.dispatch(world.x2[rank], handle=w_handle)[0]
    out["worst"] = (num_worst, w_recv_x.clone(), w_recv_idx.clone(), w_recv_w.clone(), list(w_counts),
                    w_combined.clone(), w_cached.clone())

    # ---- low-latency mode, bf16, an expert that scales rows by (global id + 1)
    stats = torch.zeros(E_local, dtype=torch.int32)
    packed, count, ll_handle, _, hook = buffer.low_latency_dispatch(
        x, topk, T, E, cumulative_local_expert_recv_stats=stats, use_fp8=False,
        return_recv_hook=world.use_hook)
    if world.use_hook:
        hook()
    src_info, layout_range, *rest = ll_handle
    out["ll"] = (packed.clone(), count.clone(), src_info.clone(), layout_range.clone(), tuple(rest))
    first_result = (packed, packed.clone(), count, count.clone())
    factor = _expert_factor(E)[rank * E_local:(rank + 1) * E_local].view(E_local, 1, 1)
    y = (packed.float() * factor).to(torch.bfloat16)
    for e in range(E_local):
        y[e, int(count[e]):] = float("nan")  # rows past the count must never be read
    if world.zero_copy:
        # zero_copy sends from the combine buffer: what x holds must not matter.
        buffer.get_next_low_latency_combine_buffer(ll_handle).copy_(y)
        y = torch.zeros_like(y)
    combined_ll, _, hook = buffer.low_latency_combine(y, topk, weights, ll_handle, zero_copy=world.zero_copy,
                                                      return_recv_hook=world.use_hook)
    if world.use_hook:
        hook()
    out["ll_combine"] = combined_ll.clone()

    # ---- low-latency mode, fp8, identity expert on the dequantised rows
    (data, scales), count8, ll_handle8, _, hook = buffer.low_latency_dispatch(
        x, topk, T, E, cumulative_local_expert_recv_stats=stats, use_fp8=True, round_scale=world.round_scale,
        return_recv_hook=world.use_hook)
    if world.use_hook:
        hook()
    # Two low-latency results may be alive at once: the second dispatch must not touch the first.
    out["ll_first_intact"] = (torch.equal(first_result[0].view(torch.int16), first_result[1].view(torch.int16))
                              and torch.equal(first_result[2], first_result[3]))
    out["ll_fp8"] = (data.view(torch.uint8).clone(), scales.clone(), tuple(scales.stride()), count8.clone(),
                     ll_handle8[0].clone(), ll_handle8[1].clone())
    deq = data.float() * scales.float().repeat_interleave(128, dim=-1)
    y8 = deq.to(torch.bfloat16)
    for e in range(E_local):
        y8[e, int(count8[e]):] = float("nan")
    given_out = torch.empty(x.shape[0], H, dtype=torch.bfloat16) if world.zero_copy else None
    combined8, _, _ = buffer.low_latency_combine(y8, topk, weights, ll_handle8, out=given_out)
    out["ll_fp8_combine"] = combined8.clone()
    out["ll_out_respected"] = given_out is None or combined8.data_ptr() == given_out.data_ptr() or x.shape[0] == 0
    out["stats"] = stats.clone()
    return out


def _max_received(world: World) -> int:
    return max(len(_expected_rows(world, r)) for r in range(world.R))


# ----------------------------------------------------------------------------- brute force
def _on_rank(world: World, expert: int) -> int:
    return expert // world.E_local


def _in_rank(world: World, s: int, t: int, r: int) -> bool:
    return any(e >= 0 and _on_rank(world, e) == r for e in world.topk[s][t].tolist())


def _expected_rows(world: World, r: int) -> list[tuple[int, int]]:
    """(source rank, source token) of every row rank r receives, in the contract's order."""
    return [(s, t) for s in range(world.R) for t in range(world.topk[s].shape[0]) if _in_rank(world, s, t, r)]


def _local_ids(world: World, s: int, t: int, r: int) -> list[int]:
    return [e - r * world.E_local if e >= 0 and _on_rank(world, e) == r else -1
            for e in world.topk[s][t].tolist()]


def _pairs_for_expert(world: World, expert: int) -> list[tuple[int, int]]:
    return sorted((s, t) for s in range(world.R) for t in range(world.topk[s].shape[0])
                  if expert in world.topk[s][t].tolist())


def _close(got: torch.Tensor, expected: torch.Tensor, what: str, world: World, rtol=1e-2, atol=1e-2) -> None:
    got, expected = got.float(), expected.float()
    assert got.shape == expected.shape, \
        f"{what}: shape {list(got.shape)} != {list(expected.shape)}\n{world.describe()}"
    bad = ~torch.isclose(got, expected, rtol=rtol, atol=atol)
    assert not bad.any(), (f"{what}: {int(bad.sum())} elements differ, first at {bad.nonzero()[0].tolist()}: "
                           f"got {got[bad][:4].tolist()} expected {expected[bad][:4].tolist()}\n"
                           f"{world.describe()}")


def _check_layout(world: World, r: int, layout) -> None:
    per_rank, per_rdma, per_expert, in_rank = layout
    n = world.topk[r].shape[0]
    if world.ranks_per_node is None:
        assert per_rdma is None
    else:   # tokens with at least one expert on each node
        experts_per_node = world.E // world.R * world.ranks_per_node
        rows = world.topk[r].tolist()
        exp_per_node = [sum(any(e >= 0 and e // experts_per_node == node for e in row) for row in rows)
                        for node in range(world.R // world.ranks_per_node)]
        assert per_rdma.dtype == torch.int32 and per_rdma.tolist() == exp_per_node, world.describe()
    exp_in_rank = torch.tensor([[_in_rank(world, r, t, d) for d in range(world.R)] for t in range(n)],
                               dtype=torch.bool).reshape(n, world.R)
    assert in_rank.dtype == torch.bool and torch.equal(in_rank, exp_in_rank), world.describe()
    exp_per_rank = [sum(_in_rank(world, r, t, d) for t in range(n)) for d in range(world.R)]
    assert per_rank.dtype == torch.int32 and per_rank.tolist() == exp_per_rank, world.describe()
    exp_per_expert = [sum(row.count(e) for row in world.topk[r].tolist()) for e in range(world.E)]
    assert per_expert.dtype == torch.int32 and per_expert.tolist() == exp_per_expert, world.describe()


def _check_dispatch(world: World, r: int, result) -> None:
    recv_x, recv_idx, recv_w, counts, prefix = result
    rows = _expected_rows(world, r)
    M = len(rows)
    assert recv_x.shape == (M, world.H) and recv_x.dtype == torch.bfloat16, world.describe()
    # Block from source s is exactly x_s[is_token_in_rank_s[:, r]], in order; blocks by s ascending.
    expected_x = torch.stack([world.x[s][t] for s, t in rows]) if rows else torch.empty(0, world.H, dtype=torch.float32)
    assert torch.equal(recv_x.float(), expected_x.float()), f"rank {r} recv_x\n{world.describe()}"
    exp_idx = [_local_ids(world, s, t, r) for s, t in rows]
    assert recv_idx.dtype == torch.int64 and recv_idx.shape == (M, world.K)
    assert recv_idx.tolist() == exp_idx, \
        f"rank {r} recv_topk_idx {recv_idx.tolist()} != {exp_idx}\n{world.describe()}"
    exp_w = [[float(world.weights[s][t, k]) if exp_idx[i][k] >= 0 else 0.0 for k in range(world.K)]
             for i, (s, t) in enumerate(rows)]
    assert recv_w.dtype == torch.float32 and recv_w.shape == (M, world.K)
    assert recv_w.tolist() == exp_w, f"rank {r} recv_topk_weights\n{world.describe()}"
    exp_counts = []
    for e in range(world.E_local):
        pairs = len(_pairs_for_expert(world, r * world.E_local + e))
        exp_counts.append(math.ceil(pairs / world.alignment) * world.alignment)
    assert counts == exp_counts, f"rank {r} num_recv_tokens_per_expert_list {counts} != {exp_counts}"
    exp_prefix = [[sum(_in_rank(world, s, t, j) for s in range(i + 1) for t in range(world.topk[s].shape[0]))
                   for j in range(world.R)] for i in range(world.R)]
    assert prefix.dtype == torch.int32 and prefix.tolist() == exp_prefix, \
        f"rank {r} rank_prefix_matrix {prefix.tolist()} != {exp_prefix}\n{world.describe()}"


def _check_combine(world: World, r: int, result) -> None:
    combined, combined_w = result
    n = world.topk[r].shape[0]
    copies = torch.tensor([sum(_in_rank(world, r, t, d) for d in range(world.R)) for t in range(n)],
                          dtype=torch.float32)
    expected = world.x[r].float() * copies.view(n, 1)
    for bias in world.biases[r]:
        expected = expected + bias.float()
    assert combined.dtype == torch.bfloat16
    _close(combined, expected, f"rank {r} combine(dispatch(x))", world)
    # Each valid k lives on exactly one rank, so the summed weights are the valid weights.
    exp_w = torch.where(world.topk[r] >= 0, world.weights[r], torch.zeros_like(world.weights[r]))
    _close(combined_w, exp_w, f"rank {r} combined_topk_weights", world, rtol=1e-6, atol=1e-6)


def _check_fp8_rows(world: World, r: int, recv, what: str) -> None:
    """(fp8 data as uint8, scales) received by rank r: the source rows, bits unchanged."""
    rows = _expected_rows(world, r)
    data, scales = recv
    exp_data = (torch.stack([world.fp8_data[s][t] for s, t in rows]) if rows
                else torch.empty(0, world.H, dtype=torch.uint8))
    exp_scales = (torch.stack([world.fp8_scales[s][t] for s, t in rows]) if rows
                  else world.fp8_scales[0].new_empty((0, world.fp8_scales[0].shape[1])))
    assert torch.equal(data, exp_data), f"rank {r} {what} fp8 recv data\n{world.describe()}"
    assert scales.dtype == exp_scales.dtype and torch.equal(scales, exp_scales), \
        f"rank {r} {what} recv scales ({scales.dtype})\n{world.describe()}"


def _check_cached(world: World, r: int, result) -> None:
    recv, none_flags = result
    assert none_flags == [True, True, True, True], f"cached dispatch returned non-None extras {none_flags}"
    rows = _expected_rows(world, r)
    if world.fp8:
        _check_fp8_rows(world, r, recv, "cached dispatch")
    else:
        exp = torch.stack([world.x2[s][t] for s, t in rows]) if rows else torch.empty(0, world.H, dtype=torch.float32)
        assert recv.shape == (len(rows), world.H)
        assert torch.equal(recv.float(), exp.float()), f"rank {r} cached recv_x\n{world.describe()}"


def _check_worst(world: World, r: int, result, fresh) -> None:
    num_worst, recv_x, recv_idx, recv_w, counts, combined, cached = result
    rows = _expected_rows(world, r)
    M = len(rows)
    assert recv_x.shape == (num_worst, world.H), f"rank {r} padded recv_x {list(recv_x.shape)}"
    assert recv_idx.shape == (num_worst, world.K) and recv_w.shape == (num_worst, world.K)
    assert counts == [], f"rank {r}: per-expert list must be empty with num_worst_tokens, got {counts}"
    assert torch.equal(recv_x[:M], fresh[0]), f"rank {r} padded recv_x rows\n{world.describe()}"
    assert torch.equal(recv_idx[:M], fresh[1]) and torch.equal(recv_w[:M], fresh[2])
    assert bool((recv_idx[M:] == -1).all()), f"rank {r} padding rows of recv_topk_idx {recv_idx[M:].tolist()}"
    n = world.topk[r].shape[0]
    copies = torch.tensor([sum(_in_rank(world, r, t, d) for d in range(world.R)) for t in range(n)],
                          dtype=torch.float32)
    _close(combined, world.x[r].float() * copies.view(n, 1), f"rank {r} combine of a padded dispatch", world)
    assert cached.shape == (num_worst, world.H), f"rank {r} cached dispatch on a padded handle {list(cached.shape)}"
    exp = torch.stack([world.x2[s][t] for s, t in rows]) if rows else torch.empty(0, world.H, dtype=torch.float32)
    assert torch.equal(cached[:M].float(), exp.float()), f"rank {r} cached dispatch on a padded handle\n" \
        + world.describe()


def _check_ll_layout(world: World, r: int, count, src_info, layout_range, what: str) -> None:
    R, T, E_local = world.R, world.T, world.E_local
    assert src_info.shape == (E_local, R * T) and src_info.dtype == torch.int32, what
    assert layout_range.shape == (E_local, R) and layout_range.dtype == torch.int64, what
    for e in range(E_local):
        expert = r * E_local + e
        expected = _pairs_for_expert(world, expert)
        assert int(count[e]) == len(expected), \
            f"{what}: rank {r} expert {e} count {int(count[e])} != {len(expected)}\n{world.describe()}"
        got = []
        covered = []
        for s in range(R):
            packed = int(layout_range[e, s])
            begin, num = packed >> 32, packed & 0xFFFFFFFF
            covered.extend(range(begin, begin + num))
            got.extend((s, int(src_info[e, i])) for i in range(begin, begin + num))
        assert sorted(covered) == list(range(len(expected))), \
            f"{what}: rank {r} expert {e} layout_range {layout_range[e].tolist()} does not tile the count"
        assert sorted(got) == expected, (f"{what}: rank {r} expert {e} (src rank, src token) pairs "
                                         f"{sorted(got)} != {expected}\n{world.describe()}")


def _ll_rows(world: World, r: int, e: int, src_info, layout_range):
    """(row, source rank, source token) of every valid row of local expert e."""
    for s in range(world.R):
        packed = int(layout_range[e, s])
        for i in range(packed >> 32, (packed >> 32) + (packed & 0xFFFFFFFF)):
            yield i, s, int(src_info[e, i])


def _check_low_latency(world: World, r: int, result, combined) -> None:
    packed, count, src_info, layout_range, rest = result
    R, T, H, E_local = world.R, world.T, world.H, world.E_local
    assert rest == (T, H, world.E), f"low-latency handle tail {rest} != {(T, H, world.E)}"
    assert packed.shape == (E_local, R * T, H) and packed.dtype == torch.bfloat16
    assert count.dtype == torch.int32 and count.shape == (E_local,)
    _check_ll_layout(world, r, count, src_info, layout_range, "low_latency_dispatch(bf16)")
    for e in range(E_local):
        for i, s, t in _ll_rows(world, r, e, src_info, layout_range):
            assert torch.equal(packed[e, i], world.x[s][t]), f"rank {r} expert {e} row {i} != x[{s}][{t}]"
    # Reference: sum_k w * bf16(x * (expert + 1)) over valid k, in float32.
    factor = _expert_factor(world.E)
    n = world.topk[r].shape[0]
    expected = torch.zeros(n, H, dtype=torch.float32)
    for t in range(n):
        for k in range(world.K):
            expert = int(world.topk[r][t, k])
            if expert >= 0:
                y = (world.x[r][t].float() * factor[expert]).to(torch.bfloat16).float()
                expected[t] += world.weights[r][t, k] * y
    assert combined.shape == (n, H) and combined.dtype == torch.bfloat16
    _close(combined, expected, f"rank {r} low_latency_combine(bf16)", world, atol=3e-2)


def _check_low_latency_fp8(world: World, r: int, result, combined, stats, ll_count) -> None:
    data, scales, strides, count, src_info, layout_range = result
    R, T, H, E_local = world.R, world.T, world.H, world.E_local
    assert data.shape == (E_local, R * T, H)
    assert scales.shape == (E_local, R * T, H // 128) and scales.dtype == torch.float32
    assert strides[1] == 1, f"fp8 scales must be column-major in the last two dims, strides {strides}"
    _check_ll_layout(world, r, count, src_info, layout_range, "low_latency_dispatch(fp8)")
    fp8 = data.view(FP8).float()
    for e in range(E_local):
        for i, s, t in _ll_rows(world, r, e, src_info, layout_range):
            x = world.x[s][t].float().view(H // 128, 128)
            amax = x.abs().amax(dim=1).clamp(min=1e-4)
            exp_scale = amax / 448.0
            if world.round_scale:
                exp_scale = torch.pow(2.0, torch.ceil(torch.log2(exp_scale)))
            got_scale = scales[e, i]
            assert torch.allclose(got_scale, exp_scale, rtol=1e-5, atol=0), \
                f"rank {r} expert {e} row {i} scales {got_scale.tolist()} != {exp_scale.tolist()}"
            deq = fp8[e, i].view(H // 128, 128) * got_scale.view(-1, 1)
            err = (deq - x).abs()
            bound = 0.0625 * x.abs() + 2e-3 * amax.view(-1, 1) + 1e-6
            assert bool((err <= bound).all()), f"rank {r} expert {e} row {i} fp8 error {float(err.max())}"
    n = world.topk[r].shape[0]
    valid = world.topk[r] >= 0
    wsum = torch.where(valid, world.weights[r], torch.zeros_like(world.weights[r])).sum(1, keepdim=True)
    x = world.x[r].float()
    expected = x * wsum
    err = (combined.float() - expected).abs()
    amax = x.abs().amax(dim=1, keepdim=True) if n else torch.zeros(0, 1, dtype=torch.float32)
    bound = wsum * (0.0625 * x.abs() + 2e-3 * amax) + 1e-2 * expected.abs() + 1e-3
    assert combined.shape == (n, H)
    assert bool((err <= bound).all()), \
        f"rank {r} low_latency_combine(fp8) error {float((err - bound).max())} over bound\n{world.describe()}"
    assert torch.equal(stats, ll_count * 2), \
        f"rank {r} cumulative_local_expert_recv_stats {stats.tolist()} != 2 * {ll_count.tolist()}"


def _run_and_check(pool: RankPool, world: World) -> None:
    for r, out in enumerate(run_world(pool, _round_trip, world)):
        _check_layout(world, r, out["layout"])
        _check_dispatch(world, r, out["dispatch"])
        _check_combine(world, r, out["combine"])
        _check_cached(world, r, out["cached"])
        if world.fp8:
            recv, f_idx, f_w, f_counts = out["fresh_fp8"]
            _check_fp8_rows(world, r, recv, "fresh dispatch")
            bf16_dispatch = out["dispatch"]
            assert torch.equal(f_idx, bf16_dispatch[1]) and torch.equal(f_w, bf16_dispatch[2]), \
                f"rank {r}: fp8 dispatch top-k differs from the bf16 dispatch of the same routing"
            assert f_counts == bf16_dispatch[3]
        _check_worst(world, r, out["worst"], out["dispatch"])
        _check_low_latency(world, r, out["ll"], out["ll_combine"])
        _check_low_latency_fp8(world, r, out["ll_fp8"], out["ll_fp8_combine"], out["stats"], out["ll"][1])
        assert out["ll_out_respected"], f"rank {r}: low_latency_combine(out=...) did not return out"
        assert out["ll_first_intact"], f"rank {r}: a second low_latency_dispatch overwrote the first's result"
        assert out["list_types"][0] == "list" and set(out["list_types"][1]) <= {"int"}, \
            f"rank {r}: num_recv_tokens_per_expert_list must be a list of ints, got {out['list_types']}"


# ----------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4])
@settings(max_examples=PROFILE_EXAMPLES, **SETTINGS)
@given(data=st.data())
def test_round_trip(pools, num_ranks, data):
    world = data.draw(worlds(num_ranks))
    _run_and_check(pools(num_ranks), world)


@settings(max_examples=max(3, PROFILE_EXAMPLES // 8), **SETTINGS)
@given(world=worlds(5))
def test_round_trip_five_ranks(pools, world):
    _run_and_check(pools(5), world)


@pytest.mark.parametrize("split", [(2, 2), (2, 3), (3, 2)], ids=lambda split: f"{split[0]}x{split[1]}")
@settings(max_examples=max(3, PROFILE_EXAMPLES // 8), **SETTINGS)
@given(data=st.data())
def test_round_trip_node_split(pools, split, data):
    """The same round trip on groups split into nodes (issue 12): every property still holds,
    and get_dispatch_layout counts each token once per node it reaches."""
    nodes, per_node = split
    world = data.draw(worlds(nodes * per_node))
    world.ranks_per_node = per_node
    _run_and_check(pools(nodes * per_node, per_node), world)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4])
def test_every_strategy(pools, num_ranks, strategy):
    """One fixed, busy example per (world size, routing strategy), whatever hypothesis draws."""
    seed = 1000 * num_ranks + STRATEGIES.index(strategy)
    knobs = Knobs(strategy=strategy, seed=seed, K=3 + num_ranks % 3, E_local=1 + seed % 3,
                  H=128 if num_ranks % 2 else 256, use_hook=bool(seed % 2), zero_copy=bool(seed % 3 == 0),
                  round_scale=strategy in ("skewed", "mixed"), alignment=(1, 4)[num_ranks % 2],
                  packed_scales=strategy in ("uniform", "one_rank"))
    _run_and_check(pools(num_ranks), build_world(num_ranks, knobs))


# ----------------------------------------------------------------------------- UE8M0 scales
def _ue8m0_dispatch(group, x_all, topk_all, T, E):
    import tritonep as deep_ep

    rank, R = group.rank(), group.size()
    H = x_all[rank].shape[1]
    buffer = deep_ep.Buffer(group, num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, R, E),
                            low_latency_mode=True)
    wait = torch.zeros(R, dtype=torch.int64)
    (data, scales), count, handle, _, _ = buffer.low_latency_dispatch(
        x_all[rank], topk_all[rank], T, E, dispatch_wait_recv_cost_stats=wait, use_fp8=True, round_scale=True,
        use_ue8m0=True)
    return (data.view(torch.uint8).clone(), scales.clone(), tuple(scales.stride()), count.clone(),
            handle[0].clone(), handle[1].clone(), wait.clone())


def _pow2_ceil(value: float) -> float:
    mantissa, exponent = math.frexp(value)  # value = mantissa * 2**exponent, mantissa in [0.5, 1)
    return 2.0 ** (exponent - 1) if mantissa == 0.5 else 2.0 ** exponent


@settings(max_examples=max(4, PROFILE_EXAMPLES // 6), **SETTINGS)
@given(seed=st.integers(0, 2**32 - 1), E_local=st.integers(1, 3), K=st.integers(1, 4))
def test_low_latency_ue8m0_scales(pools, seed, E_local, K):
    """use_ue8m0: power-of-two scales, one exponent byte (k + 127 for 2**k) per 128 channels,
    four per int32 with group 4i+j in byte j; [E_local, R*T, H/512], column-major."""
    R, H, E = 2, 1024, 2 * E_local
    world = build_world(R, Knobs(H=H, E_local=E_local, K=K, seed=seed, fp8=False, num_biases=0))
    # Channel groups of very different magnitudes, so every byte of a packed int32 differs.
    for r in range(R):
        spread = torch.pow(2.0, torch.arange(H // 128, dtype=torch.float32) - 4).repeat_interleave(128)
        world.x[r] = (world.x[r].float() * spread).to(torch.bfloat16)
    results = pools(R).run(_ue8m0_dispatch, world.x, world.topk, world.T, E)
    for r, (data, scales, strides, count, src_info, layout_range, wait) in enumerate(results):
        assert scales.dtype == torch.int32 and scales.shape == (E_local, R * world.T, H // 512)
        assert strides[1] == 1, f"ue8m0 scales must be column-major in the last two dims, strides {strides}"
        check_wait_stats(wait)
        _check_ll_layout(world, r, count, src_info, layout_range, "low_latency_dispatch(ue8m0)")
        fp8 = data.view(FP8).float()
        for e in range(E_local):
            for i, s, t in _ll_rows(world, r, e, src_info, layout_range):
                x = world.x[s][t].float().view(H // 128, 128)
                expected_scales = [_pow2_ceil(max(float(a), 1e-4) / 448.0) for a in x.abs().amax(dim=1)]
                packed = [int(v) & 0xFFFFFFFF for v in scales[e, i].tolist()]
                got_bytes = [(packed[g // 4] >> (8 * (g % 4))) & 0xFF for g in range(H // 128)]
                expected_bytes = [int(math.log2(v)) + 127 for v in expected_scales]
                assert got_bytes == expected_bytes, \
                    f"rank {r} expert {e} row {i}: exponent bytes {got_bytes} != {expected_bytes}"
                deq = fp8[e, i].view(H // 128, 128) * torch.tensor(expected_scales, dtype=torch.float32).view(-1, 1)
                amax = x.abs().amax(dim=1, keepdim=True)
                assert bool(((deq - x).abs() <= 0.0625 * x.abs() + 2e-3 * amax + 1e-6).all()), \
                    f"rank {r} expert {e} row {i}: fp8 data does not decode with its ue8m0 scales"
