"""The NVLink kernels' shapes: how num_sms splits into program roles, rows per tile, the
combine's path. Every field has an environment override, for the benchmark's sweeps and A/B
runs (``scripts/normal_profile.py``, ``scripts/dispatch_stress.py`` replace it per Buffer)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import triton

from tritonep.backends.nvlink.memory import MAX_CHANNELS


@dataclass(frozen=True)
class Tuning:
    """Kernel shape; environment overrides exist for the benchmark's sweeps."""

    # Dispatch: senders push to peers; receivers gather our own rows, then copy arrived ones out.
    sender_fraction: float = float(os.environ.get("TRITONEP_SENDER_FRACTION", "0.5"))
    combine_sender_fraction: float = float(os.environ.get("TRITONEP_COMBINE_SENDER_FRACTION", "0.375"))
    rows: int = int(os.environ.get("TRITONEP_ROWS", "0"))          # rows per tile; 0: by row size (tile_rows)
    block: int = int(os.environ.get("TRITONEP_BLOCK", "0"))        # columns per chunk; 0: tile_block
    warps: int = int(os.environ.get("TRITONEP_WARPS", "32"))
    tokens: int = int(os.environ.get("TRITONEP_REDUCE_TOKENS", "0"))   # combine's tokens per tile; 0: reduce_tokens
    combine_block: int = int(os.environ.get("TRITONEP_COMBINE_BLOCK", "2048"))   # columns per reduced tile
    stage: int = int(os.environ.get("TRITONEP_STAGE", "32"))
    # Combine rows cross NVLink on the copy engines when the dispatch read its counts back, in
    # this many pieces per peer (each piece costs a copy and a stream write on the host, and a
    # few microseconds between them on the GPU: 8 pieces measured slower than 2 or 4 at EP2);
    # 0: by rank count (``combine_copy_engine.pieces_per_peer``).
    copy_engine_combine: bool = os.environ.get("TRITONEP_COMBINE_COPY_ENGINE", "1") == "1"
    combine_pieces: int = int(os.environ.get("TRITONEP_COMBINE_PIECES", "0"))
    # Those pieces through the CUDA driver (cuda-bindings: a copy and a stream write per piece)
    # when it is installed; False: torch's copies and a signal kernel per piece.
    combine_driver: bool = os.environ.get("TRITONEP_COMBINE_DRIVER", "1") == "1"
    # Fresh dispatch: launch the send half before the host reads the counts back (False: after,
    # as one would without the overlap; for A/B runs).
    send_before_sync: bool = os.environ.get("TRITONEP_SEND_BEFORE_SYNC", "1") == "1"
    # Fresh dispatch: also launch the receive half before the counts come back, into outputs
    # sized from the previous fresh dispatch of the same shape plus this fraction and 64 rows
    # (the returned tensors are views of the first rows; a larger count relaunches it exactly).
    # False: allocate after the read-back (exact outputs, the host on the GPU's critical path).
    receive_before_sync: bool = os.environ.get("TRITONEP_RECEIVE_BEFORE_SYNC", "1") == "1"
    fresh_slack: float = float(os.environ.get("TRITONEP_FRESH_SLACK", "0.0625"))


def split_programs(num_sms: int, fraction: float) -> tuple[int, int]:
    """(senders, receivers) out of ``num_sms`` programs (at least one of each)."""
    total = max(2, min(num_sms, MAX_CHANNELS))
    senders = min(max(1, round(total * fraction)), total - 1)
    return senders, total - senders


def reduce_tokens(tokens: int, num_ranks: int) -> int:
    """Tokens per tile of the combine's reduction: ``tokens`` if set, else 8 at one rank and 4
    otherwise. A tile loads one [tokens, block] chunk per rank a token went to, so at one rank
    4 tokens keep only 16 KB in flight per program: with 8 the combine took 97.5 us against
    140.2 at 24 SMs, hidden 7168 (H100, docs/benchmarks/2026-11-25-h100x1-s13, run 5), while at
    EP2 (32 KB with 4) neither 2 nor 8 was faster (2026-11-24-h200x2). EP4 and EP8 keep 4 until
    measured."""
    if tokens:
        return tokens
    return 8 if num_ranks == 1 else 4


def tile_rows(rows: int, row_bytes: int) -> int:
    """Rows per tile of the row-moving loops: ``rows`` if set, else enough rows for about 128 KB
    in flight per tile (8 rows of bf16 hidden 7168, 16 of fp8), between 8 and 32. A tile's
    time is mostly its load latency, so an fp8 tile of 8 rows moved half the bytes of a bf16
    tile in about the same time."""
    if rows:
        return rows
    fit = max(1, 131072 // max(row_bytes, 1))
    return min(32, max(8, 1 << (fit.bit_length() - 1)))


def tile_block(block: int, rows: int, row_words: int) -> int:
    """Columns (4-byte words) per chunk of a ``rows``-row tile: ``block`` if set, else 64 KB per
    chunk (rows x columns x 4 bytes); at most the row's width rounded up to a power of two.
    Measured at one rank (the receive half's copies), bf16 and fp8 rows of hidden 2048, 4096
    and 7168, at 8 and 24 SMs: 64 KB per chunk was the fastest of 512 to 4096 columns in every
    case, e.g. fp8 hidden 7168 61 us against 73 with 2048 columns, bf16 hidden 4096 64 us
    against 86 (docs/benchmarks/2026-11-24-h200x1-s6, run 16)."""
    return min(triton.next_power_of_2(row_words), block if block else max(16384 // rows, 64))


def tile_shape(rows: int, row_bytes: int) -> dict[str, int]:
    """The row-moving kernels' ROWS and SIGNAL_EVERY: senders publish their progress about
    every 32 rows (receivers wait for exactly those values)."""
    tile = tile_rows(rows, row_bytes)
    return dict(ROWS=tile, SIGNAL_EVERY=max(1, 32 // tile))


def with_changes(tuning: Tuning, changes: str) -> Tuning:
    """``tuning`` with ``"field=value[,field=value]"`` applied (``"defaults"``: none), values
    read as the field's type (booleans as 1/0 or true/false): the scripts' variant syntax."""
    fields = {}
    for item in ([] if changes == "defaults" else changes.split(",")):
        name, value = item.split("=")
        current = getattr(tuning, name)
        fields[name] = value in ("1", "true", "True") if isinstance(current, bool) else type(current)(value)
    return dataclasses.replace(tuning, **fields)
