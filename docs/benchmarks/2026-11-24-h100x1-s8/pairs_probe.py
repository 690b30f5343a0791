"""Per-call samples of the bench's fresh/cached pairs at one rank, with the host's time from
the counts' arrival to the call's return, to see why the pairs' median jumps between rounds."""
import os, statistics, sys, time, json
import torch
import torch.distributed as dist
import tritonep as deep_ep
from tritonep.bench import _call_times_us
from tritonep.buffer import nvl_bytes_for
from tritonep.launch import RankPool


def run(group, iters):
    os.environ["TRITONEP_BACKEND"] = "nvlink"
    N, H, K, E = 4096, 7168, 8, 256
    torch.manual_seed(0)
    x = torch.randn(N, H, device="cuda").to(torch.bfloat16)
    topk_idx = (torch.randn(N, E, device="cuda").abs() + 1).topk(K, dim=1).indices
    w = torch.rand(N, K, device="cuda")
    buffer = deep_ep.Buffer(group, nvl_bytes_for(N, H, 1), explicitly_destroy=True)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
    backend = buffer.backend
    post = []
    original = backend._wait_counts

    def stamped(*a, **k):
        r = original(*a, **k)
        post.append(time.perf_counter())
        return r
    backend._wait_counts = stamped
    returned = []

    def fresh():
        r = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                            topk_idx=topk_idx, topk_weights=w)
        returned.append(time.perf_counter())
        return r
    handle = fresh()[4]

    def cached():
        return buffer.dispatch(x, handle=handle)
    out = {}
    for phase in range(3):
        post.clear(); returned.clear()
        f, c = _call_times_us(group, [fresh, cached], iters, warmup=0)
        host_after = [(b - a) * 1e6 for a, b in zip(post, returned)]
        diffs = [a - b for a, b in zip(f, c)]
        out[phase] = dict(fresh=f, cached=c, host_after_counts=host_after)
        q = lambda v: [round(statistics.quantiles(v, n=10)[i], 1) for i in (0, 4, 8)]
        print(f"phase {phase}: fresh p10/50/90 {q(f)}, cached {q(c)}, diff {q(diffs)}, host after counts {q(host_after)}")
        slow = [i for i, d in enumerate(diffs) if d > 40]
        if slow:
            print(f"   {len(slow)} slow pairs; their host-after-counts: {[round(host_after[i]) for i in slow[:12]]}; "
                  f"fast pairs' median {statistics.median([h for i, h in enumerate(host_after) if i not in slow] or [0]):.1f}")
    buffer.destroy()
    return out


if __name__ == "__main__":
    with RankPool(1, use_gpu=True, timeout=300) as pool:
        out = pool.run(run, int(sys.argv[1]) if len(sys.argv) > 1 else 60)
    if len(sys.argv) > 2:
        json.dump(out, open(sys.argv[2], "w"))
