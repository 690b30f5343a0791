"""The NVLink kernels' shapes and the backend's other tunables, in one place.

How num_sms splits into program roles, rows per tile, the combine's path, the low-latency
kernels' launch shapes, and how long a wait on a peer may last. Each field has an environment
variable, read once when a Buffer is made (``Tuning.from_environment``), for the benchmark's
sweeps and A/B runs; scripts and tests may also give a Buffer's backend another ``Tuning``.
Nothing else in the backend reads the environment.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import triton

from tritonep.backends.nvlink.memory import MAX_CHANNELS


@dataclass(frozen=True)
class Tuning:
    """Kernel shapes and tunables; ``from_environment`` reads each field's variable."""

    # Dispatch: senders push to peers; receivers gather our own rows, then copy arrived ones out.
    sender_fraction: float = 0.5
    combine_sender_fraction: float = 0.375
    rows: int = 0              # rows per tile; 0: by row size (tile_rows)
    block: int = 0             # columns per chunk; 0: tile_block
    warps: int = 32
    tokens: int = 0            # combine's reduction tile: tokens, and columns per source;
    combine_block: int = 0     # 0: by rank count (combine_tile)
    stage: int = 32
    # Combine rows cross NVLink on the copy engines when the dispatch read its counts back, in
    # this many pieces per peer (each piece costs a copy and a stream write on the host, and a
    # few microseconds between them on the GPU, so a few large pieces beat many small ones);
    # 0: by rank count (``combine_copy_engine.pieces_per_peer``). Each piece is this fraction of
    # the one before (``combine_copy_engine.piece_ends``); 0: by pieces per peer
    # (``combine_copy_engine.piece_ratio``).
    copy_engine_combine: bool = True
    combine_pieces: int = 0
    combine_piece_ratio: float = 0.0
    # Side streams the copy-engine combine spreads its peers over (peer i of the call's list on
    # stream i % N, each peer's pieces in order); 1: every piece on one stream, round by round
    # over the peers. On several streams a copy engine need not idle while another stream's tail
    # write waits for its copy; the side work of repeated calls is then issued op by op, not as a
    # captured graph (which takes one stream).
    combine_copy_streams: int = 1
    # The copy engines' work (those pieces, and the copy-engine dispatch receive below) through
    # the CUDA driver when cuda-bindings is installed: a copy and a stream write per piece, a copy
    # per range of the receive; False: torch's copies (and the pieces' signal kernel).
    copy_driver: bool = True
    # Fresh dispatch: launch the send half before the host reads the counts back (False: after,
    # as one would without the overlap; for A/B runs).
    send_before_sync: bool = True
    # Fresh dispatch: also launch the receive half before the counts come back, into outputs
    # sized from the previous fresh dispatch of the same shape plus this fraction and 64 rows
    # (the returned tensors are views of the first rows; a larger count relaunches it exactly).
    # False: allocate after the read-back (exact outputs, the host on the GPU's critical path).
    receive_before_sync: bool = True
    fresh_slack: float = 0.0625
    # Cached dispatch (counts known on the host) from this many ranks on (0: never; True: from
    # two): every program sends, and the arrived rows go from staging into the outputs on the
    # copy engines (a local copy moves ~1.9 TB/s against ~25 GB/s per receiver program) instead
    # of on half the SMs (dispatch_copy_engine.py). It carries more at EP4 and less at EP2
    # (docs/benchmarks).
    copy_engine_dispatch: int = 4
    # Low-latency kernels: programs per SM and warps per program of each launch (the dispatch
    # is fastest with two 8-warp programs per SM, the combine with four 4-warp programs moving
    # 4 rows per step), and the rows per step of the combine and of the dispatch's receive.
    low_latency_programs_per_sm: int = 2
    low_latency_warps: int = 8
    low_latency_combine_programs_per_sm: int = 4
    low_latency_combine_warps: int = 4
    low_latency_rows: int = 4
    low_latency_recv_rows: int = 4
    # How long a kernel waits for a peer before it gives up and the host raises naming it.
    timeout_s: float = 60.0

    @property
    def timeout_ns(self) -> int:
        return int(self.timeout_s * 1e9)

    @classmethod
    def from_environment(cls) -> Tuning:
        """The defaults with every ``TRITONEP_*`` variable of ``ENVIRONMENT`` that is set applied."""
        changes = {field: os.environ[variable] for field, variable in ENVIRONMENT.items() if variable in os.environ}
        return parse_changes(cls(), changes)


# Each field's environment variable.
ENVIRONMENT = {
    "sender_fraction": "TRITONEP_SENDER_FRACTION",
    "combine_sender_fraction": "TRITONEP_COMBINE_SENDER_FRACTION",
    "rows": "TRITONEP_ROWS",
    "block": "TRITONEP_BLOCK",
    "warps": "TRITONEP_WARPS",
    "tokens": "TRITONEP_REDUCE_TOKENS",
    "combine_block": "TRITONEP_COMBINE_BLOCK",
    "stage": "TRITONEP_STAGE",
    "copy_engine_combine": "TRITONEP_COMBINE_COPY_ENGINE",
    "combine_pieces": "TRITONEP_COMBINE_PIECES",
    "combine_piece_ratio": "TRITONEP_COMBINE_PIECE_RATIO",
    "combine_copy_streams": "TRITONEP_COMBINE_COPY_STREAMS",
    "copy_driver": "TRITONEP_COPY_DRIVER",
    "send_before_sync": "TRITONEP_SEND_BEFORE_SYNC",
    "receive_before_sync": "TRITONEP_RECEIVE_BEFORE_SYNC",
    "fresh_slack": "TRITONEP_FRESH_SLACK",
    "copy_engine_dispatch": "TRITONEP_DISPATCH_COPY_ENGINE",
    "low_latency_programs_per_sm": "TRITONEP_LL_PROGRAMS_PER_SM",
    "low_latency_warps": "TRITONEP_LL_WARPS",
    "low_latency_combine_programs_per_sm": "TRITONEP_LL_COMBINE_PROGRAMS_PER_SM",
    "low_latency_combine_warps": "TRITONEP_LL_COMBINE_WARPS",
    "low_latency_rows": "TRITONEP_LL_ROWS",
    "low_latency_recv_rows": "TRITONEP_LL_RECV_ROWS",
    "timeout_s": "TRITONEP_TIMEOUT_S",
}


def copy_engine_receives(setting: int, num_ranks: int) -> bool:
    """Whether a cached dispatch of ``num_ranks`` ranks receives on the copy engines
    (``Tuning.copy_engine_dispatch``): 0 (or False) never, N from N ranks on, one rank never."""
    return bool(setting) and num_ranks >= max(int(setting), 2)


def split_programs(num_sms: int, fraction: float) -> tuple[int, int]:
    """(senders, receivers) out of ``num_sms`` programs (at least one of each)."""
    total = max(2, min(num_sms, MAX_CHANNELS))
    senders = min(max(1, round(total * fraction)), total - 1)
    return senders, total - senders


def combine_tile(tokens: int, block: int, num_ranks: int) -> tuple[int, int]:
    """(tokens, columns) of the combine's reduction tile: ``tokens`` and ``block`` where set.
    A tile loads one [tokens, columns] chunk of bf16 per source rank before it sums them, so
    the bytes in flight per program grow with the rank count: past one rank the tile keeps 16
    tokens and about 64K elements in all (EP2 2048 columns, EP4 1024, EP8 512), the size that
    beat smaller and larger tiles at EP2 and EP4 alike; one rank keeps 8 x 2048
    (docs/findings.md gives the figures)."""
    if num_ranks == 1:
        return tokens or 8, block or 2048
    tokens = tokens or 16
    if not block:
        fit = max(64, (1 << 16) // (tokens * num_ranks))
        block = 1 << (fit.bit_length() - 1)
    return tokens, block


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
    chunk (rows x columns x 4 bytes); at most the row's width rounded up to a power of two. Of
    512 to 4096 columns, 64 KB per chunk was the fastest for bf16 and fp8 rows of every hidden
    size and num_sms tried (docs/findings.md)."""
    return min(triton.next_power_of_2(row_words), block if block else max(16384 // rows, 64))


def tile_shape(rows: int, row_bytes: int) -> dict[str, int]:
    """The row-moving kernels' ROWS and SIGNAL_EVERY: senders publish their progress about
    every 32 rows (receivers wait for exactly those values)."""
    tile = tile_rows(rows, row_bytes)
    return dict(ROWS=tile, SIGNAL_EVERY=max(1, 32 // tile))


def parse_changes(tuning: Tuning, changes: dict[str, str]) -> Tuning:
    """``tuning`` with the fields in ``changes`` set from strings, read as the field's type
    (booleans as 1/0 or true/false)."""
    fields = {}
    for name, value in changes.items():
        current = getattr(tuning, name)
        fields[name] = value in ("1", "true", "True") if isinstance(current, bool) else type(current)(value)
    return dataclasses.replace(tuning, **fields)


def with_changes(tuning: Tuning, changes: str) -> Tuning:
    """``tuning`` with ``"field=value[,field=value]"`` applied (``"defaults"``: none): the
    benchmark's variant syntax."""
    items = [] if changes == "defaults" else changes.split(",")
    return parse_changes(tuning, dict(item.split("=") for item in items))
