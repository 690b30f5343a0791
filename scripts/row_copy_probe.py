"""How many bytes per second one program moves when it gathers whole rows, loop shape by loop shape.

Both normal-mode kernels scale almost linearly with their programs (the num_sms curves in
docs/benchmarks), so per-program throughput sets their speed at a given num_sms, and with it
issue #10's 8-SM stretch. The shipped loop (``rows.copy_rows`` inside ``_send_rows``) loads a
tile of ROWS x BLOCK words, then stores it: a program has one tile's loads in flight at a time,
since nothing lets the next tile's loads start before this tile's stores. This probe gathers
rows of ``x`` (hidden 7168 bf16: 3584 words) through a random permutation into a contiguous
output, as the dispatch's own-row copy does, with:

* ``shipped``: ``copy_rows`` as the kernels call it (ROWS=8, BLOCK=2048 words: 64 KB a load);
* ``stages``: whole-row tiles in a ``tl.range(..., num_stages=S)`` loop, so that Triton's
  pipeliner may keep S-1 tiles' loads in flight (async copies into shared memory);
* ``prefetch``: whole-row tiles, the next tile's loads issued before this tile's stores
  (registers hold two tiles);
* ``tma``: a Gluon kernel that moves each row with one TMA load into shared memory and one TMA
  store out of it, ``STAGES`` rows in flight, no registers on the way (rows viewed as
  [W/256, 256] words; the box [16, 256] reads zeros past row's end and the store skips them).

    PYTHONPATH=. python scripts/row_copy_probe.py [--json PATH]

GB/s = bytes copied (read once, written once) / kernel time: CUDA events, L2 flushed before
each call, median of 20 calls.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton
import triton.language as tl

from tritonep.device.rows import copy_rows

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:   # an older Triton: the TMA variant is left out
    gluon = None
from tritonep.bench_timing import flush_l2


@triton.jit
def shipped_kernel(x_ptr, order_ptr, out_ptr, num_rows, width, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    chunk = tl.cdiv(num_rows, tl.num_programs(0))
    lo = tl.program_id(0) * chunk
    hi = tl.minimum(lo + chunk, num_rows)
    for row0 in range(lo, hi, ROWS):
        rows = row0 + tl.arange(0, ROWS)
        mask = rows < hi
        tokens = tl.load(order_ptr + rows, mask=mask, other=0)
        copy_rows(x_ptr, tokens, width, 1, out_ptr, rows, mask, width, BLOCK, False)


@triton.jit
def stages_kernel(x_ptr, order_ptr, out_ptr, num_rows, width, ROWS: tl.constexpr, WIDTH_PAD: tl.constexpr,
                  STAGES: tl.constexpr):
    chunk = tl.cdiv(num_rows, tl.num_programs(0))
    lo = tl.program_id(0) * chunk
    hi = tl.minimum(lo + chunk, num_rows)
    cols = tl.arange(0, WIDTH_PAD)
    for row0 in tl.range(lo, hi, ROWS, num_stages=STAGES):
        rows = row0 + tl.arange(0, ROWS)
        mask = rows < hi
        tokens = tl.load(order_ptr + rows, mask=mask, other=0)
        full = mask[:, None] & (cols < width)[None, :]
        values = tl.load(x_ptr + tokens.to(tl.int64)[:, None] * width + cols[None, :], mask=full)
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * width + cols[None, :], values, mask=full)


@triton.jit
def prefetch_kernel(x_ptr, order_ptr, out_ptr, num_rows, width, ROWS: tl.constexpr, WIDTH_PAD: tl.constexpr):
    chunk = tl.cdiv(num_rows, tl.num_programs(0))
    lo = tl.program_id(0) * chunk
    hi = tl.minimum(lo + chunk, num_rows)
    cols = tl.arange(0, WIDTH_PAD)
    col_mask = (cols < width)[None, :]
    rows = lo + tl.arange(0, ROWS)
    mask = rows < hi
    tokens = tl.load(order_ptr + rows, mask=mask, other=0)
    values = tl.load(x_ptr + tokens.to(tl.int64)[:, None] * width + cols[None, :], mask=mask[:, None] & col_mask)
    for row0 in range(lo, hi, ROWS):
        # The next tile's loads go out before this tile's stores.
        next_rows = row0 + ROWS + tl.arange(0, ROWS)
        next_mask = next_rows < hi
        next_tokens = tl.load(order_ptr + next_rows, mask=next_mask, other=0)
        next_values = tl.load(x_ptr + next_tokens.to(tl.int64)[:, None] * width + cols[None, :],
                              mask=next_mask[:, None] & col_mask)
        rows = row0 + tl.arange(0, ROWS)
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * width + cols[None, :], values,
                 mask=(rows < hi)[:, None] & col_mask)
        values = next_values


if gluon is not None:
    @gluon.jit
    def tma_kernel(x_desc, out_desc, order_ptr, num_rows, STAGES: gl.constexpr, LAG: gl.constexpr):
        chunk = gl.cdiv(num_rows, gl.num_programs(0))
        lo = gl.program_id(0) * chunk
        count = gl.minimum(lo + chunk, num_rows) - lo
        row_bytes: gl.constexpr = x_desc.block_type.nbytes
        smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
        loaded = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(loaded.index(s), count=1)
        for s in gl.static_range(STAGES):
            go = s < count
            token = gl.load(order_ptr + lo + s, mask=go, other=0)
            mbarrier.expect(loaded.index(s), row_bytes, pred=go)
            tma.async_copy_global_to_shared(x_desc, [token, 0, 0], loaded.index(s), smem.index(s), pred=go)
        for i in range(0, count):
            slot = i % STAGES
            mbarrier.wait(loaded.index(slot), (i // STAGES) & 1)
            tma.async_copy_shared_to_global(out_desc, [lo + i, 0, 0], smem.index(slot))
            # Refill the slot of row ``i - LAG`` once its store has read it (LAG=1: this row's
            # store stays in flight meanwhile).
            tma.store_wait(LAG)
            done = i - LAG
            go = (done >= 0) & (done + STAGES < count)
            token = gl.load(order_ptr + lo + done + STAGES, mask=go, other=0)
            refill = (done + STAGES) % STAGES
            mbarrier.expect(loaded.index(refill), row_bytes, pred=go)
            tma.async_copy_global_to_shared(x_desc, [token, 0, 0], loaded.index(refill), smem.index(refill), pred=go)
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(loaded.index(s))


def _median_us(launch, calls: int = 20) -> float:
    times = []
    for _ in range(calls + 2):
        flush_l2()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--width", type=int, default=3584, help="row width in 4-byte words")
    parser.add_argument("--json")
    args = parser.parse_args()
    N, W = args.rows, args.width
    x = torch.randint(-2**31, 2**31 - 1, (N, W), dtype=torch.int32, device="cuda")
    order = torch.randperm(N, device="cuda").to(torch.int32)
    out = torch.empty_like(x)
    expected = x[order.long()]
    pad = triton.next_power_of_2(W)
    variants = {"shipped r8 b2048": lambda g, w: shipped_kernel[(g,)](x, order, out, N, W, ROWS=8, BLOCK=2048,
                                                                      num_warps=w)}
    for rows in (2, 4):
        for stages in (2, 3, 4):
            variants[f"stages r{rows} s{stages}"] = (
                lambda g, w, rows=rows, stages=stages: stages_kernel[(g,)](x, order, out, N, W, ROWS=rows,
                                                                           WIDTH_PAD=pad, STAGES=stages, num_warps=w))
        variants[f"prefetch r{rows}"] = (
            lambda g, w, rows=rows: prefetch_kernel[(g,)](x, order, out, N, W, ROWS=rows, WIDTH_PAD=pad, num_warps=w))
    if gluon is not None and W % 256 == 0:
        layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)
        box = [1, triton.next_power_of_2(W // 256), 256]
        x_desc = TensorDescriptor(x, [N, W // 256, 256], [W, 256, 1], box, layout)
        out_desc = TensorDescriptor(out, [N, W // 256, 256], [W, 256, 1], box, layout)
        for stages in (2, 4, 8, 12):
            for lag in (0, 1):
                variants[f"tma s{stages} lag{lag}"] = (
                    lambda g, w, stages=stages, lag=lag: tma_kernel[(g,)](x_desc, out_desc, order, N, STAGES=stages,
                                                                          LAG=lag, num_warps=w // 8))
    bytes_moved = 2 * N * W * 4
    report = {"rows": N, "width_words": W, "device": torch.cuda.get_device_name(), "results": {}}
    for name, launch in variants.items():
        for programs in (4, 8, 24, 132):
            for warps in (8, 16, 32):
                key = f"{name} p{programs} w{warps}"
                try:
                    out.zero_()
                    launch(programs, warps)
                    torch.cuda.synchronize()
                    if not torch.equal(out, expected):
                        report["results"][key] = "wrong result"
                        print(key, "WRONG RESULT", flush=True)
                        continue
                    us = _median_us(lambda launch=launch, g=programs, w=warps: launch(g, w))
                except Exception as error:   # a shape that does not compile (shared memory, registers)
                    report["results"][key] = f"failed: {type(error).__name__}: {str(error)[:200]}"
                    print(key, "failed:", type(error).__name__, str(error)[:200], flush=True)
                    continue
                gbps = bytes_moved / 2 / us / 1e3   # rows' bytes per second, as the bench counts
                report["results"][key] = {"us": round(us, 1), "GBps": round(gbps, 1),
                                          "GBps_per_program": round(gbps / programs, 1)}
                print(f"{key:32s} {us:8.1f} us {gbps:7.1f} GB/s {gbps / programs:6.1f} per program", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
