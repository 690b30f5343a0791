"""The dispatch channels' row orders (``tritonep.device.rows``): across a block's channels every
row is moved exactly once, contiguous or interleaved, and each tile-aligned step of a channel's
positions is ``ROWS`` consecutive rows of one block tile (what the receive loop relies on).

The helpers are Triton functions: a probe kernel runs them in Triton's interpreter, in a child
process (this process may have imported the kernels compiled), and prints every channel's rows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

from tritonep.device.rows import channel_sequence, tile_row

COUNTS = (0, 1, 2, 3, 7, 8, 9, 31, 32, 33, 64, 100, 157)
CHANNELS = (1, 2, 3, 5, 12)
ROWS = (1, 2, 4, 8, 16)
MAX_ROWS = 256   # above any count: a channel's rows fit one probe tile


@triton.jit
def channel_rows_kernel(counts_ptr, out_ptr, NUM_CHANNELS: tl.constexpr, ROWS: tl.constexpr,
                        INTERLEAVE: tl.constexpr, MAX_ROWS: tl.constexpr):
    """Channel program_id(1)'s rows of a block of counts[program_id(0)] rows, in its order (-1 past them)."""
    case, channel = tl.program_id(0), tl.program_id(1)
    lo, hi = channel_sequence(tl.load(counts_ptr + case), channel, NUM_CHANNELS, ROWS, INTERLEAVE)
    positions = lo + tl.arange(0, MAX_ROWS)
    # The block row of each position: its tile's first row plus its place in the tile.
    offset = (positions - lo) % ROWS
    rows = tile_row(positions - offset, channel, NUM_CHANNELS, ROWS, INTERLEAVE) + offset
    tl.store(out_ptr + (case * NUM_CHANNELS + channel) * MAX_ROWS + tl.arange(0, MAX_ROWS),
             tl.where(positions < hi, rows, -1))


def probe() -> dict:
    """{"N,ROWS,interleave": [[rows of channel c, in order] per (count, channel)]}, interpreted."""
    counts = torch.tensor(COUNTS, dtype=torch.int32)
    found = {}
    for channels in CHANNELS:
        for rows in ROWS:
            for interleave in (False, True):
                out = torch.empty(len(COUNTS) * channels * MAX_ROWS, dtype=torch.int32)
                channel_rows_kernel[(len(COUNTS), channels)](counts, out, channels, rows, interleave, MAX_ROWS)
                found[f"{channels},{rows},{int(interleave)}"] = [
                    [row for row in seq if row >= 0] for seq in out.view(-1, MAX_ROWS).tolist()]
    return found


@pytest.fixture(scope="module")
def channel_rows() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import json, test_channel_order as t; " \
           "print(json.dumps(t.probe()))"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("interleave", [False, True])
def test_every_row_moved_once(channel_rows: dict, interleave: bool) -> None:
    for channels in CHANNELS:
        for rows in ROWS:
            found = channel_rows[f"{channels},{rows},{int(interleave)}"]
            for index, count in enumerate(COUNTS):
                moved = sorted(row for seq in found[index * channels:(index + 1) * channels] for row in seq)
                assert moved == list(range(count)), (channels, rows, count)


def test_interleaved_channels_take_tiles_in_turn(channel_rows: dict) -> None:
    for channels in CHANNELS:
        for rows in ROWS:
            found = channel_rows[f"{channels},{rows},1"]
            for index, count in enumerate(COUNTS):
                for channel in range(channels):
                    seq = found[index * channels + channel]
                    tiles = [seq[k:k + rows] for k in range(0, len(seq), rows)]
                    for turn, tile in enumerate(tiles):
                        first = (channel + turn * channels) * rows
                        assert tile == list(range(first, min(first + rows, count))), (channels, rows, count, channel)
