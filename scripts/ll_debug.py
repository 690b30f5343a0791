"""Debug/tuning probe for the low-latency kernels on GPUs (not part of the test suite).

1. the two-batches-reverse-hooks case with details; 2. CUDA-graph time per dispatch/combine
for a few kernel shapes (TRITONEP_LL_ROWS / TRITONEP_LL_WARPS) and bf16 vs fp8.
"""
import os, sys, time
sys.path.insert(0, "tests")
import torch, torch.distributed as dist
import tritonep as deep_ep
from tritonep.launch import RankPool
import low_latency_cases as llc


def reverse(group, order="reverse"):
    case = llc.LowLatencyCase(seed=12, tokens=(6, 6), T=8, hidden=256, num_experts=8, num_topk=3, use_fp8=False)
    nvlink, cpu = llc.buffers(group, deep_ep.Buffer.get_low_latency_rdma_size_hint(8, 256, 2, 8))
    dev = nvlink.device
    batches = [llc.make_inputs(case, group.rank(), i) for i in range(2)]
    launched = []
    for x, t, _ in batches:
        launched.append(nvlink.low_latency_dispatch(x.to(dev), t.to(dev), 8, 8, use_fp8=False, return_recv_hook=True))
    for r in reversed(launched):
        r[4]()
    torch.cuda.synchronize()
    out = []
    for i, ((x, t, w), r) in enumerate(zip(batches, launched)):
        p, c, h, _, _ = cpu.low_latency_dispatch(x, t, 8, 8, use_fp8=False)
        rows_ok = all(torch.equal(r[0][e, :int(c[e])].cpu(), p[e, :int(c[e])]) for e in range(len(c)))
        src_ok = torch.equal(r[2][0].cpu(), h[0])
        out.append(f"batch {i}: dispatch rows equal {rows_ok}, src_info equal {src_ok}")
    hooks, results = [], []
    for (x, t, w), r in zip(batches, launched):
        comb, _, hk = nvlink.low_latency_combine(llc.expert_outputs(r[0], False, nvlink.rank), t.to(dev), w.to(dev), r[2], return_recv_hook=True)
        hooks.append(hk); results.append(comb)
        if order == "sync":
            torch.cuda.synchronize(); dist.barrier()
    for hk in (reversed(hooks) if order == "reverse" else hooks):
        hk()
    torch.cuda.synchronize()
    for i, ((x, t, w), comb) in enumerate(zip(batches, results)):
        p, c, h, _, _ = cpu.low_latency_dispatch(x, t, 8, 8, use_fp8=False)
        exp, _, _ = cpu.low_latency_combine(llc.expert_outputs(p, False, cpu.rank), t, w, h)
        d = (comb.cpu().float() - exp.float()).abs().max(1).values
        out.append(f"{order} batch {i}: combine max err per token {d.tolist()}")
    return out


def timing(group, rows, warps):
    T, H, E, K = 128, 7168, 288, 8
    os.environ["TRITONEP_BACKEND"] = "nvlink"
    buf = deep_ep.Buffer(group, num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, 2, E),
                         low_latency_mode=True, explicitly_destroy=True)
    eng = buf.backend.low_latency
    eng.rows, eng.warps = rows, warps
    x = torch.randn(T, H, device="cuda").bfloat16()
    topk = torch.rand(T, E, device="cuda").topk(K, dim=1).indices
    w = torch.rand(T, K, device="cuda")
    res = {}
    for fp8 in (True, False):
        packed, _, handle, _, _ = buf.low_latency_dispatch(x, topk, T, E, use_fp8=fp8)
        y = torch.randn(E // 2, 2 * T, H, device="cuda").bfloat16()
        for name, fn in (("dispatch", lambda: buf.low_latency_dispatch(x, topk, T, E, use_fp8=fp8)),
                         ("combine", lambda: buf.low_latency_combine(y, topk, w, handle))):
            if name == "combine" and not fp8:
                continue
            fn(); torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(10):
                    fn()
            ts = []
            for _ in range(15):
                dist.barrier(); torch.cuda.synchronize()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record(); g.replay(); e.record(); e.synchronize()
                ts.append(s.elapsed_time(e) * 100)
            ts.sort()
            res[f"{name} {'fp8' if fp8 else 'bf16'}"] = round(ts[len(ts) // 2], 1)
    buf.destroy()
    return res


if __name__ == "__main__":
    with RankPool(2, use_gpu=True, timeout=300) as pool:
        for order in ("reverse", "forward", "sync"):
            print("\n".join(pool.run(reverse, order)[0][2:]), flush=True)
        for rows, warps in ((2, 16),):
            print("rows", rows, "warps", warps, pool.run(timing, rows, warps)[0], flush=True)
