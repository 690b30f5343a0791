"""Host cost of one low-latency call on GPUs: wall time per call (200 calls, no sync) and a
cProfile of the same calls. Run on a machine with >= 2 GPUs:

    PYTHONPATH=. python scripts/profile_low_latency_host.py
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import time

import torch
import torch.distributed as dist

import tritonep as deep_ep
from tritonep.rank_pool import RankPool


def run(group: dist.ProcessGroup) -> dict:
    T, H, E, K = 128, 7168, 288, 8
    os.environ["TRITONEP_BACKEND"] = "nvlink"
    buffer = deep_ep.Buffer(group, num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(
        T, H, group.size(), E), low_latency_mode=True)
    x = torch.randn(T, H, device="cuda").bfloat16()
    topk_idx = torch.rand(T, E, device="cuda").topk(K, dim=1).indices
    weights = torch.rand(T, K, device="cuda")
    packed, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, T, E)
    expert_out = torch.randn(packed[0].shape, device="cuda").bfloat16()
    report = {}
    calls = (("dispatch", lambda: buffer.low_latency_dispatch(x, topk_idx, T, E)),
             ("combine", lambda: buffer.low_latency_combine(expert_out, topk_idx, weights, handle)))
    for name, call in calls:
        for _ in range(5):
            call()
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(200):
            call()
        host_us = (time.perf_counter() - start) / 200 * 1e6
        torch.cuda.synchronize()
        dist.barrier()
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(200):
            call()
        profile.disable()
        torch.cuda.synchronize()
        dist.barrier()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(18)
        report[name] = (host_us, text.getvalue())
    return report


if __name__ == "__main__":
    with RankPool(2, use_gpu=True, timeout=300) as pool:
        results = pool.run(run)[0]
    for kind, (host_us, profile_text) in results.items():
        print(f"== {kind}: host {host_us:.1f} us per call (200 calls, no sync)")
        print("\n".join(profile_text.splitlines()[:40]))
