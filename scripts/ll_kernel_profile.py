"""A few low-latency calls of one rank, for Nsight Compute: the kernels alone, nothing timed.

One process, a one-rank NCCL group, DeepEP's decode shape (128 tokens, hidden 7168, top-8 of
288 experts): ``--calls`` fp8 dispatches in one launch each, then as many with receive hooks
(send and receive as two launches), then as many combines. Run it under ncu, e.g.

    ncu --clock-control none -k regex:low_latency_dispatch --launch-skip 4 --launch-count 1 \\
        --set full -o ll python scripts/ll_kernel_profile.py

so the profiled launch is a warm one.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import tritonep as deep_ep
from tritonep.rank_pool import init_one_rank_gpu_group


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=288)
    parser.add_argument("--topk", type=int, default=8)
    args = parser.parse_args()
    device = init_one_rank_gpu_group()
    T, H, E, K = args.tokens, args.hidden, args.experts, args.topk
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.rand(T, H, generator=gen) * 2 - 1).to(device, torch.bfloat16)
    topk_idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices.to(device)
    weights = torch.rand(T, K, generator=gen).to(device)
    buffer = deep_ep.Buffer(dist.group.WORLD, 0, deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, 1, E),
                            low_latency_mode=True, explicitly_destroy=True)
    for _ in range(args.calls):
        packed, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, T, E)
    for _ in range(args.calls):
        _, _, _, _, hook = buffer.low_latency_dispatch(x, topk_idx, T, E, return_recv_hook=True)
        hook()
    expert_out = (torch.rand(packed[0].shape, generator=gen) * 2 - 1).to(device, torch.bfloat16)
    for _ in range(args.calls):
        buffer.low_latency_combine(expert_out, topk_idx, weights, handle)
    torch.cuda.synchronize()
    buffer.destroy()
    dist.destroy_process_group()
    print("ll_kernel_profile: done")


if __name__ == "__main__":
    main()
