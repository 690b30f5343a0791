"""The expert-layout kernel (tritonep/backends/nvlink/normal/expert_layout_kernel.py) gives every
field of ``core.expert_layout.expert_layout``, the plain-torch definition the collective backend
uses, bit for bit: random, skewed, empty, all-to-one and no-expert routings, an expert twice in a
token's top-k, expert_alignment 1/16/128, expanded and not, exact rows (CPU sync) and worst-case
rows with padding (no CPU sync: the kernel also writes the padding rows' empty values), sources
grouped by scale-up rank, with and without the stats and the copy of topk_idx.

The kernel reads what a fresh dispatch leaves (the count exchange's result words, the send
plan's positions, the received rows), which this test builds for one rank of a world by loops
over (source, token, k); it needs no process group, so one CPU rank of the interpreter pools
runs every case, and on GPUs every rank runs them with the compiled kernel (larger shapes too,
the later calls of a shape through the launch the first one learnt).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from tritonep.core.expert_layout import ExpertLayoutRequest, expert_layout
from tritonep.core.handles import DispatchHandle

ROUTINGS = ("random", "skewed", "empty", "all_to_one", "no_expert", "repeated")
FIELDS = ("counts", "psum_per_expert", "psum_per_scaleup_rank", "recv_src_metadata", "dst_buffer_slot_idx",
          "topk_idx", "slots", "expanded_source", "expanded_weights")


def make_topk(generator: torch.Generator, routing: str, num_tokens: int, num_ranks: int, experts_per_rank: int,
              num_topk: int, target: int) -> torch.Tensor:
    """[N, K] global expert ids of one source under ``routing``, -1 for none."""
    num_experts = num_ranks * experts_per_rank
    cpu = dict(generator=generator, dtype=torch.float32, device="cpu")
    if routing in ("empty", "no_expert") or num_tokens == 0:
        return torch.full((num_tokens, num_topk), -1, dtype=torch.int64, device="cpu")
    if routing == "all_to_one":   # every token to the experts of one rank
        pool = target * experts_per_rank + torch.arange(experts_per_rank, device="cpu")
        picks = torch.rand(num_tokens, experts_per_rank, **cpu).argsort(dim=1)[:, :num_topk]
        ids = torch.full((num_tokens, num_topk), -1, dtype=torch.int64, device="cpu")
        ids[:, :picks.shape[1]] = pool[picks]
    else:
        scores = torch.rand(num_tokens, num_experts, **cpu)
        if routing == "skewed":   # one hot expert most tokens pick
            scores[:, target * experts_per_rank] += 0.9
        ids = scores.topk(min(num_topk, num_experts), dim=1).indices
        missing = torch.full((num_tokens, num_topk - ids.shape[1]), -1, dtype=torch.int64, device="cpu")
        ids = torch.cat([ids, missing], dim=1)
        if routing == "repeated":   # an expert twice in a token's top-k
            ids[:, -1] = ids[:, 0]
    ids[torch.rand(num_tokens, num_topk, **cpu) < 0.2] = -1
    return ids


def one_rank_of_world(seed: int, routing: str, num_ranks: int, experts_per_rank: int, num_topk: int, T: int,
                      rank: int, exact_rows: bool) -> dict:
    """What a fresh dispatch leaves at ``rank``: every rank's tokens routed by ``routing``, the
    rows ``rank`` receives (by source, token order; with ``exact_rows`` False, padded to R * T
    rows of source -1, expert -1, weight 0), rank_prefix_matrix, the exchange's result words
    and ``rank``'s send plan positions."""
    generator = torch.Generator().manual_seed(seed)
    cpu = dict(generator=generator, device="cpu")   # (GPU runs may set another default device)
    target = int(torch.randint(num_ranks, (1,), **cpu))
    tokens = [0 if routing == "empty" else int(n) for n in torch.randint(0, T + 1, (num_ranks,), **cpu)]
    topk = [make_topk(generator, routing, tokens[s], num_ranks, experts_per_rank, num_topk, target)
            for s in range(num_ranks)]
    rank_of = [[{e // experts_per_rank for e in row if e >= 0} for row in ids.tolist()] for ids in topk]
    count_matrix = torch.tensor([[sum(d in ranks for ranks in rank_of[s]) for d in range(num_ranks)]
                                 for s in range(num_ranks)], dtype=torch.int32, device="cpu")
    prefix = torch.cumsum(count_matrix, 0, dtype=torch.int32)
    # Plain Python lists: a tensor op per (token, k) is slow, more so under a default device.
    src, ids, pairs = [], [], [[0] * experts_per_rank for _ in range(num_ranks)]
    for s in range(num_ranks):
        for t, row in enumerate(topk[s].tolist()):
            if rank in rank_of[s][t]:
                local = [e - rank * experts_per_rank if e >= 0 and e // experts_per_rank == rank else -1 for e in row]
                src.append(t)
                ids.append(local)
                for e in local:
                    if e >= 0:
                        pairs[s][e] += 1
    pairs_per_source = torch.tensor(pairs, dtype=torch.int32, device="cpu")
    rows = len(src) if exact_rows else num_ranks * T
    recv_src = torch.full((rows,), -1, dtype=torch.int32, device="cpu")
    recv_idx = torch.full((rows, num_topk), -1, dtype=torch.int64, device="cpu")
    recv_src[:len(src)] = torch.tensor(src, dtype=torch.int32, device="cpu")
    if ids:
        recv_idx[:len(ids)] = torch.tensor(ids, dtype=torch.int64, device="cpu")
    weights = torch.rand(rows, num_topk, dtype=torch.float32, **cpu)
    weights = torch.where(recv_idx >= 0, weights, 0.0)
    # The exchange's result (notify_kernel.py): prefix, per-expert counts, 2 check words, then
    # the per-source, per-expert inclusive prefix.
    checks = torch.zeros(2, dtype=torch.int32, device="cpu")
    exchange = torch.cat([prefix.reshape(-1), pairs_per_source.sum(0, dtype=torch.int32), checks,
                          torch.cumsum(pairs_per_source, 0, dtype=torch.int32).reshape(-1)])
    in_rank = torch.tensor([[d in ranks for d in range(num_ranks)] for ranks in rank_of[rank]],
                           dtype=torch.bool, device="cpu").reshape(tokens[rank], num_ranks)
    send_pos = torch.cat([torch.cumsum(in_rank.to(torch.int32), 0) - in_rank.to(torch.int32),
                          in_rank.sum(0, dtype=torch.int32).view(1, -1)]).to(torch.int32)
    return dict(topk_idx=topk[rank], recv_src=recv_src, recv_idx=recv_idx, weights=weights, prefix=prefix,
                in_rank=in_rank, exchange=exchange, send_pos=send_pos, pairs=int(pairs_per_source.sum()))


@contextlib.contextmanager
def deterministic(enabled: bool) -> Iterator[None]:
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(enabled or previous)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


def aligned(count: int, alignment: int) -> int:
    return (count + alignment - 1) // alignment * alignment


# (ranks, experts per rank, top-k, T, scale-up ranks): one tile of everything; scale-up groups;
# several row tiles, token tiles and groups of experts (slot programs).
SHAPES = [(1, 4, 2, 5, 1), (3, 2, 3, 9, 3), (4, 3, 4, 20, 2), (2, 16, 8, 300, 2)]
# On GPUs also DeepEP's normal problem at one rank and at EP8 (fewer routings and alignments).
LARGE_SHAPES, LARGE_ROUTINGS, LARGE_ALIGNMENTS = [(8, 32, 8, 4096, 8), (1, 256, 8, 4096, 1)], \
    ("random", "skewed", "all_to_one"), (1, 128)


def request_of(world: dict, shape: tuple[int, int, int, int, int], alignment: int, num_expanded: int | None,
               copy_topk_idx: bool, stats: torch.Tensor | None) -> ExpertLayoutRequest:
    num_ranks, experts_per_rank, num_topk, T, num_scaleup = shape
    handle = DispatchHandle(world["prefix"], world["in_rank"], world["recv_src"], world["recv_src"].shape[0], 128, 0)
    return ExpertLayoutRequest(handle, world["topk_idx"], world["recv_idx"], world["weights"], experts_per_rank,
                               alignment, T, num_scaleup, num_expanded, copy_topk_idx, stats)


def case_problems(case: int, shape: tuple[int, int, int, int, int], routing: str, alignment: int, expand: bool,
                  exact_rows: bool, device: torch.device, calls: int) -> list[str]:
    """The kernel's layout against the definition's for one rank of one world, ``calls`` times."""
    from tritonep.backends.nvlink.normal.expert_layout_kernel import ExpertLayouts
    from tritonep.backends.nvlink.normal.shape import Placeholders

    num_ranks, experts_per_rank, num_topk, T, _ = shape
    rank = case % num_ranks
    world = one_rank_of_world(case, routing, num_ranks, experts_per_rank, num_topk, T, rank, exact_rows)
    if exact_rows:
        counts = world["exchange"][num_ranks ** 2: num_ranks ** 2 + experts_per_rank].tolist()
        num_expanded = sum(aligned(count, alignment) for count in counts)
    else:   # V2's worst case (a repeated expert may overflow it: such pairs are dropped)
        num_expanded = aligned(num_ranks * T * min(num_topk, experts_per_rank) + (alignment - 1) * experts_per_rank,
                               alignment)
    copy, stats = case % 2 == 0, torch.arange(experts_per_rank, dtype=torch.int32, device="cpu") if case % 3 else None
    expected_stats = None if stats is None else stats.clone()
    expected = expert_layout(request_of(world, shape, alignment, num_expanded if expand else None, copy,
                                        expected_stats), rank)
    on = {name: value.to(device) for name, value in world.items() if isinstance(value, torch.Tensor)}
    got_stats = None if stats is None else stats.to(device)
    # Worst-case rows: V2's dispatch leaves the padding rows unwritten (DispatchRequest.pad_outputs)
    # and the kernel writes their empty values: it is given garbage there.
    received = int(world["prefix"][-1, rank])
    padded = {} if exact_rows else {name: (world[name], garbage) for name, garbage in (
        ("recv_src", 7), ("recv_idx", 3), ("weights", 0.5))}
    for name, (_, garbage) in padded.items():
        on[name] = on[name].clone()
        on[name][received:] = garbage
    problems = []
    # One engine's layouts: on GPUs the calls after the first repeat the launch it learnt.
    kernel_layout = ExpertLayouts(rank, num_ranks, Placeholders(device))
    for call in range(calls):
        # On CPUs, outputs the kernel leaves unwritten hold garbage, not zeros (torch fills new
        # tensors under deterministic algorithms).
        with deterministic(device.type == "cpu"):
            got = kernel_layout(request_of(on, shape, alignment, num_expanded if expand else None, copy, got_stats),
                                on["exchange"], on["send_pos"], 0)
        where = f"{shape} {routing} align={alignment} expand={expand} exact_rows={exact_rows} call {call}"
        for name in FIELDS:
            a, b = getattr(got, name), getattr(expected, name)
            if (a is None) != (b is None) or (a is not None and not (a.dtype == b.dtype and torch.equal(a.cpu(), b))):
                problems.append(f"{where}: {name} {a} != {b}")
        for name, (empty, _) in padded.items():
            if not torch.equal(on[name].cpu(), empty):
                problems.append(f"{where}: {name} {on[name]} != {empty} (padding rows: empty values)")
        if (got.topk_idx is on["topk_idx"]) == copy:
            problems.append(f"{where}: topk_idx copied {got.topk_idx is not on['topk_idx']}, asked {copy}")
    if stats is not None:   # the kernel added its counts once per call
        expected_stats += (calls - 1) * expected.counts
        if not torch.equal(got_stats.cpu(), expected_stats):
            problems.append(f"{shape} {routing} align={alignment}: stats {got_stats} != {expected_stats}")
    return problems


def layout_problems(group: object, shapes: list[tuple[int, int, int, int, int]], routings: tuple[str, ...] = ROUTINGS,
                    alignments: tuple[int, ...] = (1, 16, 128)) -> list[str]:
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    calls = 2 if on_gpu else 1   # on GPUs, the second through the launch the first one learnt
    problems, case = [], 0
    for shape in shapes:
        for routing in routings:
            for alignment in alignments:
                for expand in (False, True):
                    for exact_rows in (True, False):
                        case += 1
                        problems += case_problems(case, shape, routing, alignment, expand, exact_rows, device, calls)
    return problems


def test_kernel_matches_the_definition(interpreter_pools) -> None:
    problems = interpreter_pools(1).run(layout_problems, SHAPES)
    assert problems == [[]], "\n".join(problems[0][:20])


@pytest.mark.gpu(min_gpus=1)
def test_gpu_kernel_matches_the_definition(gpu_pool) -> None:
    for cases in ((SHAPES,), (LARGE_SHAPES, LARGE_ROUTINGS, LARGE_ALIGNMENTS)):
        for rank, problems in enumerate(gpu_pool.run(layout_problems, *cases)):
            assert problems == [], f"rank {rank}:\n" + "\n".join(problems[:20])


def test_learnt_launch_takes_each_call_s_arguments() -> None:
    """After a setup's first call, ExpertLayouts repeats the launch it learnt (as on GPUs; here
    faked and recorded): each repeat carries the call's own tensors and sizes in the per-call
    places, and the first call's fixed arguments and constants in the others."""
    from recorded_launches import RecordedLaunch, launches_faked

    from tritonep.backends.nvlink.normal import expert_layout_kernel
    from tritonep.backends.nvlink.normal.shape import Placeholders

    shape, rank, alignment = (3, 2, 3, 9, 3), 1, 16
    num_ranks, experts_per_rank, num_topk, T, _ = shape
    placeholders = Placeholders(torch.device("cpu"))
    layouts = expert_layout_kernel.ExpertLayouts(rank, num_ranks, placeholders)
    RecordedLaunch.log = []
    with launches_faked((expert_layout_kernel._EXPERT_LAYOUT,), RecordedLaunch, (expert_layout_kernel,)):
        for case, (copy, stats) in enumerate(((True, None), (False, torch.zeros(experts_per_rank, dtype=torch.int32)),
                                              (True, torch.zeros(experts_per_rank, dtype=torch.int32)))):
            world = one_rank_of_world(case, "random", num_ranks, experts_per_rank, num_topk, T, rank, True)
            request = request_of(world, shape, alignment, None, copy, stats)
            got = layouts(request, world["exchange"], world["send_pos"], 0)
            stats_of_call = stats if stats is not None else placeholders(torch.int32)
            copy_of_call = got.topk_idx if copy else placeholders(torch.int64)
            per_call = [tensor.data_ptr() for tensor in (
                world["exchange"], world["send_pos"], world["recv_src"], world["recv_idx"], world["weights"],
                world["topk_idx"], stats_of_call, got.block, copy_of_call)]
            per_call += [world["recv_idx"].shape[0], world["topk_idx"].shape[0], 0, alignment, int(stats is not None),
                         int(copy)]
            learner, _, args = RecordedLaunch.log[-1]
            assert list(args[:15]) == per_call, case
            assert (learner is None) == (case == 0), "the first call learns, the later ones repeat"
            assert args[15:] == RecordedLaunch.log[0][2][15:], case
            assert (got.topk_idx is world["topk_idx"]) != copy
    assert len(RecordedLaunch.log) == 3
