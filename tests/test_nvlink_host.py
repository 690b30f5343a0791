"""The NVLink backend's host-side arithmetic, checked without kernels: where the copy-engine
combine copies each block, which staging rows the copy-engine dispatch receive copies, how
blocks split into pieces, rows per tile, the count matrix read
back by a fresh dispatch, and the side streams' CPU fallback."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from tritonep.backends.nvlink.normal.combine_copy_engine import (
    MAX_PIECES,
    combine_copies,
    piece_ends,
    piece_ratio,
    pieces_per_peer,
)
from tritonep.backends.nvlink.normal.dispatch_copy_engine import staged_ranges  # noqa: E402
from tritonep.backends.nvlink.tuning import (  # noqa: E402
    Tuning,
    combine_tile,
    copy_engine_receives,
    tile_block,
    tile_rows,
    with_changes,
)
from tritonep.core import routing  # noqa: E402
from tritonep.runtime.side_streams import PeerStreams  # noqa: E402

count_matrices = st.integers(1, 6).flatmap(
    lambda r: st.lists(st.lists(st.integers(0, 50), min_size=r, max_size=r), min_size=r, max_size=r))


@settings(max_examples=60, deadline=None)
@given(count_matrices)
def test_count_rows_from_prefix_inverts_rank_prefix_matrix(counts: list[list[int]]) -> None:
    num_ranks = len(counts)
    prefix = routing.rank_prefix_matrix(torch.tensor(counts, dtype=torch.int64))
    assert routing.count_rows_from_prefix(prefix.flatten().tolist(), num_ranks) == counts


@settings(max_examples=60, deadline=None)
@given(count_matrices)
def test_combine_copies_return_each_block_to_where_its_source_reduces_it(counts: list[list[int]]) -> None:
    """Rebuild both sides row by row: an expert rank's x holds the rows from each source in
    source order; a source's staging holds the rows returned by each expert rank in rank
    order. Every copy must take exactly the rows from one source and put them where that
    source expects the rows of this expert rank, and every non-empty block must be copied once."""
    num_ranks = len(counts)
    for me in range(num_ranks):
        x_rows = [(source, i) for source in range(num_ranks) for i in range(counts[source][me])]
        copied = set()
        for peer, start, rows, offset in combine_copies(counts, me):
            assert peer != me and rows == counts[peer][me] > 0
            assert x_rows[start: start + rows] == [(peer, i) for i in range(rows)]
            staging = [(expert_rank, i) for expert_rank in range(num_ranks) for i in range(counts[peer][expert_rank])]
            assert staging[offset: offset + rows] == [(me, i) for i in range(rows)]
            copied.add(peer)
        assert copied == {p for p in range(num_ranks) if p != me and counts[p][me] > 0}


@settings(max_examples=60, deadline=None)
@given(count_matrices)
def test_staged_ranges_cover_every_received_row_but_our_own(counts: list[list[int]]) -> None:
    """A dispatch's staging holds the rows from each source in source order, our own block
    among them (written by our senders straight into the outputs): the copy-engine receive
    copies every other row exactly once, in at most two copies per field."""
    num_ranks = len(counts)
    for me in range(num_ranks):
        rows_from = [source for source in range(num_ranks) for _ in range(counts[source][me])]
        ranges = staged_ranges(combine_copies(counts, me))
        copied = [row for first, rows in ranges for row in range(first, first + rows)]
        assert sorted(copied) == [row for row, source in enumerate(rows_from) if source != me]
        assert len(copied) == len(set(copied)) and len(ranges) <= 2 and all(rows > 0 for _, rows in ranges)


@pytest.mark.parametrize("count", [0, 1, 7, 8, 9, 1000])
@pytest.mark.parametrize("pieces", [1, 2, 3, 8])
@pytest.mark.parametrize("ratio", [1.0, 0.6, 0.25])
def test_pieces_cover_a_block_once_in_order(count: int, pieces: int, ratio: float) -> None:
    """The pieces' ends rise to the block's end, so the tail word (rows so far) only grows."""
    ends = piece_ends(count, pieces, ratio)
    assert len(ends) == pieces and ends[-1] == count
    assert all(a <= b for a, b in zip([0] + ends, ends))
    smallest = count * ratio ** (pieces - 1) / sum(ratio ** k for k in range(pieces))
    if ratio < 1 and smallest >= 10:   # each piece smaller than the one before (beyond rounding)
        sizes = [b - a for a, b in zip([0] + ends, ends)]
        assert all(a > b for a, b in zip(sizes, sizes[1:]))


def test_pieces_per_peer_keep_the_host_issue_bounded() -> None:
    """By default 3 pieces per peer at EP2, 2 up to EP5, 1 from EP6 on; never more than
    MAX_PIECES in all (each costs the host a copy and a stream write); a set value is kept."""
    assert [pieces_per_peer(r, 0) for r in (1, 2, 3, 4, 5, 6, 8)] == [3, 3, 3, 2, 2, 1, 1]
    assert all(pieces_per_peer(r, 0) * (r - 1) <= MAX_PIECES for r in range(2, 10))
    assert pieces_per_peer(8, 3) == 3 and pieces_per_peer(2, 1) == 1


def test_piece_ratio_by_pieces_per_peer() -> None:
    """By default the last of two pieces holds about 30% of a block's rows, the last of three
    about 18%; a set ratio is kept."""
    last_share = {pieces: piece_ends(1000, pieces, piece_ratio(pieces, 0.0)) for pieces in (2, 3)}
    assert 1000 - last_share[2][-2] in range(280, 300) and 1000 - last_share[3][-2] in range(170, 190)
    assert piece_ratio(2, 0.8) == 0.8 and piece_ratio(1, 0.0) > 0


def test_combine_tile_by_rank_count() -> None:
    """The combine's reduction tile: 8 x 2048 at one rank; past it 16 tokens and about 64K
    elements over all sources' chunks; set values are kept."""
    assert [combine_tile(0, 0, r) for r in (1, 2, 3, 4, 8)] == [(8, 2048), (16, 2048), (16, 1024), (16, 1024),
                                                              (16, 512)]
    assert all(t * b * r <= 1 << 16 for r in range(2, 65) for t, b in [combine_tile(0, 0, r)])
    assert combine_tile(2, 0, 1) == (2, 2048) and combine_tile(1, 4096, 8) == (1, 4096)
    assert combine_tile(32, 0, 4) == (32, 512)


def test_copy_engine_receive_by_rank_count(monkeypatch) -> None:
    """The cached dispatch receives on the copy engines from 4 ranks by default (it lost at EP2,
    won at EP4); N from N ranks, 0 or False never, True from 2; never at one rank."""
    default = Tuning().copy_engine_dispatch
    assert [copy_engine_receives(default, r) for r in (1, 2, 3, 4, 8)] == [False, False, False, True, True]
    assert [copy_engine_receives(True, r) for r in (1, 2, 3)] == [False, True, True]
    assert not any(copy_engine_receives(setting, 8) for setting in (0, False))
    assert [copy_engine_receives(3, r) for r in (2, 3)] == [False, True]
    monkeypatch.setenv("TRITONEP_DISPATCH_COPY_ENGINE", "2")
    assert copy_engine_receives(Tuning.from_environment().copy_engine_dispatch, 2)


def test_tile_rows_keep_about_128_kb_per_tile() -> None:
    assert tile_rows(0, 7168 * 2) == 8          # bf16, hidden 7168
    assert tile_rows(0, 7168 + 56 * 4) == 16    # fp8 rows of hidden 7168
    assert tile_rows(0, 2048 * 2) == 32         # capped
    assert tile_rows(0, 1 << 20) == 8           # at least 8
    assert tile_rows(4, 7168 * 2) == 4          # set by hand (TRITONEP_ROWS)


def test_tile_block_keeps_64_kb_per_chunk() -> None:
    """The measured best of each shape (rows from tile_rows, row width in 4-byte words)."""
    assert tile_block(0, 8, 3584) == 2048      # bf16, hidden 7168
    assert tile_block(0, 16, 1792) == 1024     # fp8 rows of hidden 7168
    assert tile_block(0, 16, 2048) == 1024     # bf16, hidden 4096
    assert tile_block(0, 32, 1024) == 512      # fp8 hidden 4096, bf16 hidden 2048
    assert tile_block(0, 32, 100) == 128       # never wider than the row (rounded up to a power of two)
    assert tile_block(4096, 8, 3584) == 4096 and tile_block(4096, 8, 1000) == 1024   # set by hand


def test_peer_streams_run_jobs_in_order_without_a_gpu() -> None:
    streams, order = PeerStreams(torch.device("cpu")), []
    assert streams.mark() is None
    streams.fork([lambda: order.append(1), lambda: order.append(2)])
    streams.fork([lambda: order.append(3)], after=None)
    streams.join()
    assert order == [1, 2, 3]


def test_tuning_variants_parse_as_the_fields_types() -> None:
    default = Tuning()
    assert with_changes(default, "defaults") == default
    changed = with_changes(default, "combine_pieces=3,send_before_sync=0,sender_fraction=0.75")
    assert (changed.combine_pieces, changed.send_before_sync, changed.sender_fraction) == (3, False, 0.75)
    assert with_changes(default, "copy_engine_combine=true").copy_engine_combine is True


def test_tuning_reads_every_field_from_its_variable(monkeypatch) -> None:
    """Every field has a variable, and the backend reads none elsewhere."""
    from tritonep.backends.nvlink.tuning import ENVIRONMENT

    assert set(ENVIRONMENT) == {field.name for field in dataclasses.fields(Tuning)}
    monkeypatch.setenv("TRITONEP_TIMEOUT_S", "2.5")
    monkeypatch.setenv("TRITONEP_COMBINE_COPY_ENGINE", "0")
    monkeypatch.setenv("TRITONEP_LL_ROWS", "2")
    tuning = Tuning.from_environment()
    assert (tuning.timeout_ns, tuning.copy_engine_combine, tuning.low_latency_rows) == (2_500_000_000, False, 2)
