"""Host cost of one low-latency call on GPUs: wall time per call (no sync) and a cProfile."""
import cProfile, io, os, pstats, sys, time
import torch, torch.distributed as dist
import tritonep as deep_ep
from tritonep.launch import RankPool

def run(group):
    T, H, E, K = 128, 7168, 288, 8
    os.environ["TRITONEP_BACKEND"] = "nvlink"
    buf = deep_ep.Buffer(group, num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, group.size(), E), low_latency_mode=True)
    x = torch.randn(T, H, device="cuda").bfloat16()
    topk = torch.rand(T, E, device="cuda").topk(K, dim=1).indices
    w = torch.rand(T, K, device="cuda")
    packed, _, handle, _, _ = buf.low_latency_dispatch(x, topk, T, E)
    y = torch.randn(packed[0].shape, device="cuda").bfloat16()
    out = {}
    for name, fn in (("dispatch", lambda: buf.low_latency_dispatch(x, topk, T, E)),
                     ("combine", lambda: buf.low_latency_combine(y, topk, w, handle))):
        for _ in range(5): fn()
        torch.cuda.synchronize(); dist.barrier()
        t = time.perf_counter()
        for _ in range(200): fn()
        host = (time.perf_counter() - t) / 200 * 1e6
        torch.cuda.synchronize(); dist.barrier()
        pr = cProfile.Profile(); pr.enable()
        for _ in range(200): fn()
        pr.disable(); torch.cuda.synchronize(); dist.barrier()
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
        out[name] = (host, s.getvalue())
    return out

if __name__ == "__main__":
    with RankPool(2, use_gpu=True, timeout=300) as pool:
        res = pool.run(run)[0]
    for name, (host, prof) in res.items():
        print(f"== {name}: host {host:.1f} us per call (200 calls, no sync)")
        print("\n".join(prof.splitlines()[:40]))
