"""NVLink backend == CPU backend, on the same inputs.

Two ways to run the same kernels:
* ``interpreter`` (CI, CPU only): Triton's interpreter on CPU ranks whose "symmetric memory"
  is a shared /dev/shm file per rank. Small sizes; covers the kernels' indexing and the
  signalling protocol (flags written by one process, waited on by another).
* ``gpu`` (marked ``gpu``; run on the device machine by scripts/gpu_check.sh): every GPU of the
  machine, one rank each (one GPU is enough: the kernels then send every row to themselves),
  the sizes and the 100+-case race loop the issue asks for.
"""

from __future__ import annotations

import random

import pytest
from case_batches import check_batch
from nvlink_cases import Case, compare_cases
from nvlink_scenarios import (
    copy_engine_dispatch_batch,
    empty_rows_from_numpy,
    fresh_dispatch_in_graph_error,
    fresh_dispatch_sequence,
    fresh_dispatch_storage_rows,
    invalid_expert_id_error,
    low_latency_only_buffer,
    padding_overflow_error,
    staging_overflow_error,
)
from side_graph_cases import combine_host_calls, graph_cached_dispatches, graph_combines

from tritonep import nvl_bytes_for
from tritonep.rank_pool import RankPool


def _check(pool: RankPool, cases: Case | list[Case], nvl_bytes: int = 1 << 22, tuning: dict | None = None) -> None:
    """Every case on the NVLink and the CPU backend, compared on the ranks: one pool run."""
    check_batch(pool, compare_cases, cases if isinstance(cases, list) else [cases], nvl_bytes, tuning)


INTERPRETER_CASES = [
    Case(seed=1, tokens=(37, 20), hidden=256, num_experts=16, num_topk=3),
    Case(seed=2, tokens=(0, 9), hidden=128, num_experts=8, num_topk=2, routing="skewed"),
    Case(seed=3, tokens=(16, 16), hidden=256, num_experts=8, num_topk=4, fp8=True, bias=True, repeats=2),
    Case(seed=4, tokens=(12, 30), hidden=128, num_experts=16, num_topk=2, num_worst_tokens=64, expert_alignment=4,
         repeats=2),
    Case(seed=5, tokens=(25, 3), hidden=128, num_experts=4, num_topk=1, routing="one_rank", num_sms=2),
    Case(seed=6, tokens=(8, 8), hidden=128, num_experts=8, num_topk=2, routing="none"),
    Case(seed=7, tokens=(21, 13, 0), hidden=128, num_experts=6, num_topk=2, bias=True),
    Case(seed=8, tokens=(10, 31, 7), hidden=256, num_experts=12, num_topk=3, fp8=True, num_sms=6),
    Case(seed=9, tokens=(19, 6), hidden=384, num_experts=8, num_topk=2, fp8=True, column_major_scales=True,
         repeats=2),
    Case(seed=10, tokens=(5, 0, 12, 9), hidden=128, num_experts=8, num_topk=3, bias=True, num_sms=4),
]


@pytest.mark.parametrize("case", INTERPRETER_CASES, ids=lambda c: f"seed{c.seed}-R{len(c.tokens)}")
def test_interpreter_matches_cpu_backend(interpreter_pools, case: Case) -> None:
    _check(interpreter_pools(len(case.tokens)), case)


# The paths and shapes the defaults do not take: the copy-engine combine in 1, 3 or 4 pieces per
# peer (equal, or each a third of the one before), the SM-only combine, the send half launched
# after the host read the counts, tiles of other row counts. Each must give the CPU backend's results.
TUNING_VARIANTS = [dict(combine_pieces=1), dict(combine_pieces=3, combine_piece_ratio=1.0),
                   dict(combine_pieces=4, combine_piece_ratio=0.3), dict(copy_engine_combine=False),
                   dict(send_before_sync=False), dict(rows=4), dict(rows=8, sender_fraction=0.75),
                   dict(copy_engine_dispatch=True), dict(combine_copy_streams=2, combine_pieces=2)]


@pytest.mark.parametrize("tuning", TUNING_VARIANTS, ids=lambda t: ",".join(f"{k}={v}" for k, v in t.items()))
def test_interpreter_tuning_variants(interpreter_pools, tuning: dict) -> None:
    for num_ranks, seed in ((2, 40), (3, 41)):
        case = Case(seed=seed, tokens=(23, 40, 9)[:num_ranks], hidden=256, num_experts=12, num_topk=3,
                    fp8=seed % 2 == 1, bias=True, num_sms=5)
        _check(interpreter_pools(num_ranks), case, tuning=tuning)


# The copy-engine receive of cached dispatches (dispatch_copy_engine.py): each case makes two
# cached dispatches after its fresh one, so calls of both paths and of several num_sms take
# turns on the same staging. bf16 with top-k; no rows anywhere (routing "none": every source
# still releases); fp8 with scales on 3 ranks, one of them with no tokens.
COPY_ENGINE_DISPATCH_CASES = {
    2: [Case(seed=61, tokens=(23, 17), hidden=256, num_experts=8, num_topk=3, num_sms=5, repeats=2),
        Case(seed=62, tokens=(14, 9), hidden=128, num_experts=8, num_topk=2, routing="none", num_sms=3, repeats=2)],
    3: [Case(seed=63, tokens=(19, 0, 11), hidden=256, num_experts=12, num_topk=2, fp8=True, num_sms=4, repeats=2)],
}


@pytest.mark.parametrize("num_ranks", sorted(COPY_ENGINE_DISPATCH_CASES))
def test_interpreter_copy_engine_dispatch(interpreter_pools, num_ranks: int) -> None:
    check_batch(interpreter_pools(num_ranks), copy_engine_dispatch_batch, COPY_ENGINE_DISPATCH_CASES[num_ranks],
                1 << 22)


def test_interpreter_repeated_calls_reuse_staging(interpreter_pools) -> None:
    """Calls back to back with different program counts: the done-counters must still tell a
    sender when the peer's staging is free (a fixed-count assumption hangs here)."""
    _check(interpreter_pools(2), [Case(seed=seed, tokens=(17, 23), hidden=128, num_experts=8, num_topk=2,
                                       num_sms=num_sms) for seed, num_sms in zip(range(20, 24), (4, 2, 7, 4))])


def test_interpreter_too_small_num_worst_tokens_raises_on_next_call(interpreter_pools) -> None:
    pool = interpreter_pools(2)
    messages = pool.run(padding_overflow_error)
    assert all("num_worst_tokens=4" in m and "received 16 rows" in m for m in messages), messages
    _check(pool, Case(seed=31, tokens=(9, 14), hidden=128, num_experts=8, num_topk=2))   # still usable


def _check_row_guesses(pool: RankPool) -> None:
    """Fresh dispatches of one shape: the first allocates after its counts, later ones before
    them from the previous count plus slack; one that receives more stands down and is
    launched again into exact outputs. Each round trip must be exact (checked per rank)."""
    rows = pool.run(fresh_dispatch_storage_rows, (40, 30, 200, 190, 0, 64))
    for per_call in rows:
        received, storage, exact, released = zip(*per_call)
        assert all(exact) and all(released), per_call
        assert storage[0] == received[0], per_call                      # no history: exact
        assert storage[1] > received[1] and storage[3] > received[3], per_call   # guessed, room to spare
        assert storage[2] == received[2], per_call                      # more than the guess: relaunched
        assert storage[4] > received[4] == 0, per_call


def test_interpreter_fresh_dispatch_sized_before_counts(interpreter_pools) -> None:
    _check_row_guesses(interpreter_pools(2))


@pytest.mark.parametrize("num_ranks", [2, 3])
def test_interpreter_fresh_dispatch_sequence(interpreter_pools, num_ranks: int) -> None:
    """Random token counts and routings back to back: guesses that fit and that overflow."""
    failures = interpreter_pools(num_ranks).run(fresh_dispatch_sequence, 70 + num_ranks, 12)
    assert not any(failures), failures


def test_interpreter_staging_overflow_raises_after_a_guessed_receive(interpreter_pools) -> None:
    results = interpreter_pools(2).run(staging_overflow_error)
    assert all("holds 496 rows" in message for message, _ in results), results
    assert all(exact for _, exact in results), results


def test_interpreter_empty_rows_from_numpy(interpreter_pools) -> None:
    """Empty inputs made by torch.from_numpy (zero strides) dispatch and combine like others."""
    assert interpreter_pools(2).run(empty_rows_from_numpy) == [[(0, 64), (0, 64)], [(5, 64), (5, 64)]]


def test_interpreter_low_latency_only_buffer(interpreter_pools) -> None:
    results = interpreter_pools(2).run(low_latency_only_buffer)
    assert all(ok for ok, _ in results), results
    assert all("needs num_nvl_bytes > 0" in message for _, message in results), results


# ------------------------------------------------------------------------------- GPU
def _tokens(pool: RankPool, first: int, second: int) -> tuple[int, ...]:
    """Token counts per rank: ``first`` on rank 0, then alternately ``second`` and ``first``."""
    return tuple(first if rank % 2 == 0 else second for rank in range(pool.num_ranks))


def _experts(pool: RankPool, num_experts: int) -> int:
    """``num_experts`` rounded down to a multiple of the rank count (3 or 6 ranks included)."""
    return num_experts - num_experts % pool.num_ranks


RACE_BATCH = 40   # cases per pool run in the race loop
GPU_SIZES = [0, 1, 127, 4096, 8192]
GPU_HIDDEN = [2048, 4096, 7168]
GPU_VARIANTS = ["fp8", "worst", "bias", "skewed", "one_rank", "none", "align"]


@pytest.mark.gpu(min_gpus=1)
@pytest.mark.parametrize("hidden", GPU_HIDDEN)
def test_gpu_matches_cpu_backend(gpu_pool, hidden: int) -> None:
    """Every size of ``GPU_SIZES`` at this hidden size, in one batch."""
    cases = [Case(seed=tokens + hidden, tokens=_tokens(gpu_pool, tokens, max(tokens - 3, 0)), hidden=hidden,
                  num_experts=_experts(gpu_pool, 256), num_topk=8, num_sms=24) for tokens in GPU_SIZES]
    # Sized for the rank count: at 8 ranks, 8192 tokens of 7168 channels need more than 1 GiB
    # (a fixed 1 GiB made the Buffer refuse the call, correctly, 2026-11-24).
    _check(gpu_pool, cases, nvl_bytes=max(1 << 30, nvl_bytes_for(max(GPU_SIZES), hidden, gpu_pool.num_ranks)))


@pytest.mark.gpu(min_gpus=1)
def test_gpu_variants(gpu_pool) -> None:
    """Each of ``GPU_VARIANTS``, in one batch (a failure names the case: its fields say which)."""
    _check(gpu_pool, [Case(seed=GPU_VARIANTS.index(variant), tokens=_tokens(gpu_pool, 1000, 777), hidden=4096,
                           num_experts=_experts(gpu_pool, 64), num_topk=6, num_sms=16,
                           fp8=variant == "fp8", num_worst_tokens=4096 if variant == "worst" else 0,
                           bias=variant == "bias", routing=variant if variant in ("skewed", "one_rank", "none")
                           else "random", expert_alignment=128 if variant == "align" else 1, repeats=2)
                      for variant in GPU_VARIANTS], nvl_bytes=1 << 30)


@pytest.mark.gpu(min_gpus=1)
@pytest.mark.parametrize("tuning", [dict(copy_driver=False), dict(combine_pieces=3),
                                    dict(combine_pieces=1, copy_driver=False), dict(copy_engine_combine=False),
                                    dict(combine_copy_streams=3)],
                         ids=lambda t: ",".join(f"{k}={v}" for k, v in t.items()))
def test_gpu_combine_piece_paths(gpu_pool, tuning: dict) -> None:
    """Both ways the combine's pieces cross to the peers (driver copies and stream writes when
    cuda-bindings is installed, else torch copies and a signal kernel each), with top-k weights
    and several piece counts, the peers spread over side streams, and the combine whose SM
    programs push the rows; each call made
    twice, so that the second repeats the first's launches. (At one rank there are no pieces:
    run with 2+ ranks.)"""
    case = Case(seed=77, tokens=_tokens(gpu_pool, 1500, 900), hidden=7168, num_experts=_experts(gpu_pool, 64),
                num_topk=8, num_sms=24, repeats=2)
    _check(gpu_pool, case, nvl_bytes=1 << 30, tuning=tuning)


@pytest.mark.gpu(min_gpus=1)
@pytest.mark.parametrize("form", ["bf16", "fp8", "fp8 torch copies"])
def test_gpu_copy_engine_dispatch(gpu_pool, form: str) -> None:
    """The cached dispatch received on the copy engines (``Tuning.copy_engine_dispatch``) at full
    size, three times with one handle, then a case where rank 0 has no tokens; the counters
    must match what the hosts counted. Through the driver, or torch's copies and the signal
    kernel (``copy_driver=False``). (At one rank the mode does not apply: run with 2+.)"""
    fp8 = form.startswith("fp8")
    cases = [Case(seed=78, tokens=_tokens(gpu_pool, 1500, 900), hidden=7168, num_experts=_experts(gpu_pool, 64),
                  num_topk=8, num_sms=24, fp8=fp8, repeats=3),
             Case(seed=79, tokens=(0,) + _tokens(gpu_pool, 700, 300)[1:], hidden=4096,
                  num_experts=_experts(gpu_pool, 64), num_topk=4, num_sms=64, fp8=fp8, repeats=2)]
    check_batch(gpu_pool, copy_engine_dispatch_batch, cases, 1 << 30,
                dict(copy_driver=False) if "torch" in form else None)


@pytest.mark.gpu(min_gpus=1)
@pytest.mark.parametrize("form", ["bf16", "fp8", "fp8 column-major scales"])
def test_gpu_repeated_calls_with_a_handle(gpu_pool, form: str) -> None:
    """The cached dispatch and the combine four times with one handle, each on other inputs:
    the second call on takes the repeat path (normal_repeat.py), and every result must match
    the CPU backend's."""
    case = Case(seed=55, tokens=_tokens(gpu_pool, 1500, 900), hidden=7168, num_experts=_experts(gpu_pool, 64),
                num_topk=8, num_sms=24, fp8=form != "bf16", column_major_scales="column" in form, repeats=4)
    _check(gpu_pool, case, nvl_bytes=1 << 30)


@pytest.mark.gpu(min_gpus=1)
def test_gpu_race_loop(gpu_pool) -> None:
    """120 random cases back to back (random sizes, hidden, routing, SM counts) to shake out races."""
    rng = random.Random(0)
    cases = [Case(seed=10_000 + i, tokens=tuple(rng.choice([0, 1, 5, 64, 300, 1500, 2000])
                                                for _ in range(gpu_pool.num_ranks)),
                  hidden=rng.choice([2048, 4096, 7168]), num_experts=_experts(gpu_pool, rng.choice([16, 64, 256])),
                  num_topk=rng.choice([1, 4, 8]), fp8=rng.random() < 0.3, bias=rng.random() < 0.3,
                  routing=rng.choice(["random", "random", "skewed", "one_rank"]),
                  num_sms=rng.choice([2, 8, 24, 64]), repeats=rng.choice([1, 2, 3])) for i in range(120)]
    for first in range(0, len(cases), RACE_BATCH):   # a pool run of minutes at most, each
        _check(gpu_pool, cases[first:first + RACE_BATCH], nvl_bytes=1 << 30)


@pytest.mark.gpu(min_gpus=1)
def test_gpu_fresh_then_cached_dispatch_repeated(gpu_pool) -> None:
    """The shape of the one race-loop failure of 2026-11-24 (fp8 hidden 2048, one rank with a
    single token, 8 SMs), many times: a receiver that released the peer's staging before all
    its threads had copied it let the next (cached) dispatch overwrite rows still being read."""
    _check(gpu_pool, [Case(seed=10098 + round_, tokens=_tokens(gpu_pool, 1, 1500), hidden=2048,
                           num_experts=_experts(gpu_pool, 16), num_topk=4, fp8=round_ % 4 != 3, num_sms=8)
                      for round_ in range(40)], nvl_bytes=1 << 30)


@pytest.mark.gpu(min_gpus=1)
def test_gpu_invalid_expert_id_raises_on_every_rank(gpu_pool) -> None:
    results = gpu_pool.run(invalid_expert_id_error)
    assert all("outside [-1, num_experts)" in message for message, _ in results), results
    assert all(exact for _, exact in results), results
    # The buffer stays usable after the refused call.
    _check(gpu_pool, Case(seed=99, tokens=_tokens(gpu_pool, 100, 50), hidden=2048,
                          num_experts=_experts(gpu_pool, 16), num_topk=4), nvl_bytes=1 << 30)


@pytest.mark.gpu(min_gpus=1)
def test_gpu_fresh_dispatch_sized_before_counts(gpu_pool) -> None:
    _check_row_guesses(gpu_pool)
    results = gpu_pool.run(staging_overflow_error)
    assert all("holds 496 rows" in message for message, _ in results), results
    assert all(exact for _, exact in results), results


@pytest.mark.gpu(min_gpus=1)
def test_gpu_fresh_dispatch_sequence(gpu_pool) -> None:
    failures = gpu_pool.run(fresh_dispatch_sequence, 80, 40)
    assert not any(failures), failures


@pytest.mark.gpu(min_gpus=1)
def test_gpu_fresh_dispatch_in_graph_capture_raises(gpu_pool) -> None:
    results = gpu_pool.run(fresh_dispatch_in_graph_error)
    assert all("CUDA-graph capture" in message for message, _ in results), results
    assert all(usable for _, usable in results), results


@pytest.mark.gpu(min_gpus=1)
def test_gpu_low_latency_only_buffer(gpu_pool) -> None:
    results = gpu_pool.run(low_latency_only_buffer)
    assert all(ok for ok, _ in results), results
    assert all("needs num_nvl_bytes > 0" in message for _, message in results), results


@pytest.mark.gpu(min_gpus=1)
def test_gpu_combine_graphs_match_cpu_backend(gpu_pool) -> None:
    """Replayed combines whose copy-engine side work is a captured graph: an input changed in
    place between calls, inputs at changing addresses (more than a replay keeps graphs for) and
    back, with and without top-k weights, each against the CPU backend."""
    failures = gpu_pool.run(graph_combines)
    assert not any(failures), failures


@pytest.mark.gpu(min_gpus=1)
def test_gpu_cached_dispatch_graphs(gpu_pool) -> None:
    """Cached dispatches received on the copy engines whose side work is a captured graph once
    their outputs' address repeats, bf16 and fp8, against the CPU backend: with outputs dropped
    between calls the graph is launched (no copy of the driver's own after the second call),
    with outputs kept alive the calls copy op by op."""
    if gpu_pool.num_ranks < 2:
        pytest.skip("one rank receives no rows over the copy engines")
    for result in gpu_pool.run(graph_cached_dispatches):
        assert not result["problems"] and result["capture error"] is None, result
        for fp8 in (False, True):
            same, kept = result["calls"][f"same address, fp8 {fp8}"], result["calls"][f"kept alive, fp8 {fp8}"]
            # Six calls: by the third the address repeats (the first, on the general path, may
            # allocate elsewhere), so at most the first three copy (the third while it captures),
            # and from the fourth on each launches the graph and copies nothing itself.
            assert all(c.count("cuGraphLaunch") == 1 and not any("Memcpy" in n for n in c) for c in same[3:]), result
            assert any("Memcpy" in n for n in same[0]), result
            # New addresses from the second call on: copies, no graph.
            assert all(any("Memcpy" in n for n in c) and "cuGraphLaunch" not in c for c in kept[1:]), result


@pytest.mark.gpu(min_gpus=1)
def test_gpu_replayed_combine_host_calls(gpu_pool) -> None:
    """A combine repeated with the same input issues its side work as one graph launch: seven
    CUDA calls in all (the query whether the caller is capturing a graph, the fork's event
    record and wait, the graph, its done event, the reduction kernel, the join's wait), no copy
    or stream write of its own; the same replay on
    an input at a new address issues the weights kernel, the fork and a copy and a tail write
    per piece (two or more per peer), which shows that the profiler sees driver calls."""
    if gpu_pool.num_ranks < 2:
        pytest.skip("one rank sends no rows over the copy engines")
    for calls in gpu_pool.run(combine_host_calls):
        graph, ops = calls["graph"], calls["ops"]
        assert calls["capture error"] is None, calls
        assert sum(name.startswith("cuGraphLaunch") for name in graph) == 1 and len(graph) <= 7, calls
        assert not any("Memcpy" in name or "WriteValue" in name for name in graph), calls
        assert sum("Memcpy" in name for name in ops) >= gpu_pool.num_ranks - 1, calls
        assert len(ops) >= len(graph) + 2 * (gpu_pool.num_ranks - 1), calls
