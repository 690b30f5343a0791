"""Why a cached fp8 dispatch sometimes takes twice as long: the same call timed many times in
one process, with the quantities that could decide it printed beside each time. (It runs at
the Buffer's default num_sms, 20; the bench at 24.)

At one rank the bench's cached fp8 dispatch took 75-76 us in some rounds and 130-162 us in
others, in the same process and on the same inputs, while the bf16 one stayed at 111-112 us
(docs/benchmarks/2026-11-24-h200x1-s6). This probe times (bench timing: L2 flushed, median
of ``--iters`` calls) the cached fp8 dispatch ``--trials`` times. It gives each trial a newly
cast ``x_fp8``, so the input addresses change, and times every trial's input again at the end,
so that a mode tied to the input can be told from one tied to the moment. Each row shows the input and output
addresses modulo 2 MB and the compiled launch's setup count.

    PYTHONPATH=. python scripts/fp8_dispatch_probe.py [--ranks 1] [--trials 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist

import tritonep
from tritonep import utils
from tritonep.bench import _call_times_us
from tritonep.buffer import nvl_bytes_for
from tritonep.launch import RankPool

TWO_MB = 1 << 21


def probe(group: dist.ProcessGroup, trials: int, iters: int) -> list[dict]:
    os.environ["TRITONEP_BACKEND"] = "nvlink"
    rank, device = group.rank(), torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(1234 + rank)
    N, H, E, K = 4096, 7168, 256, 8
    x = torch.randn(N, H, device=device).to(torch.bfloat16)
    topk_idx = (torch.randn(N, E, device=device).abs() + 1).topk(K, dim=-1).indices
    topk_weights = torch.rand(N, K, device=device)
    buffer = tritonep.Buffer(group, nvl_bytes_for(N, H, group.size()))
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
    _, _, _, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                            num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                                            topk_weights=topk_weights)
    from tritonep.backends.nvlink.backend import _DISPATCH

    def fp8_call(x_fp8, last: list):
        def call():
            result = buffer.dispatch(x_fp8, handle=handle)
            last[:] = [result[0][0].data_ptr(), result[0][1].data_ptr()]
            return result
        return call

    rows, calls = [], []
    for trial in range(trials):
        x_fp8, last = utils.per_token_cast_to_fp8(x), []
        calls.append(fp8_call(x_fp8, last))   # keeps x_fp8 alive: the next trial's input lands elsewhere
        fp8_times, bf16_times = _call_times_us(group, [calls[-1], lambda: buffer.dispatch(x, handle=handle)], iters)
        rows.append({
            "trial": trial, "fp8_us": round(statistics.median(fp8_times), 1),
            "bf16_us": round(statistics.median(bf16_times), 1), "x_fp8_mod_2mb": x_fp8[0].data_ptr() % TWO_MB,
            "scales_mod_2mb": x_fp8[1].data_ptr() % TWO_MB, "scales_stride": list(x_fp8[1].stride()),
            "recv_x_mod_2mb": last[0] % TWO_MB, "recv_scales_mod_2mb": last[1] % TWO_MB,
            "launch_setups": len(_DISPATCH.setups)})
    for row, call in zip(rows, calls):   # the same inputs again, later: a mode of the input or of the moment?
        row["fp8_later_us"] = round(statistics.median(_call_times_us(group, [call], iters)[0]), 1)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--json")
    args = parser.parse_args()
    with RankPool(args.ranks, use_gpu=True, timeout=300) as pool:
        rows = pool.run(probe, args.trials, args.iters)[0]
    for row in rows:
        print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
