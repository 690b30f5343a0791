"""A toy MoE layer over R ranks with tritonep, checked against a single-process computation.

    python -m tritonep.demo [--ranks R] [--tokens N] [--hidden H] [--experts E] [--topk K] [--cpu]

Each rank routes its N tokens (softmax top-K), dispatches them to the ranks holding their
experts, runs its E/R experts (a 2-layer MLP each) on the rows it received, and combines the
results back. Rank processes on the CPU (gloo, the collective backend) unless two or more
GPUs are present, then one GPU per rank (NCCL, the NVLink backend).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

import tritonep as deep_ep
from tritonep import nvl_bytes_for
from tritonep.rank_pool import RankPool
from tritonep.utils import calc_diff

PHASES = ("layout", "dispatch", "expert MLP", "combine")


@dataclass(frozen=True)
class Setup:
    ranks: int
    tokens: int  # per rank
    hidden: int
    experts: int
    topk: int
    iters: int
    seed: int = 0


# ------------------------------------------------------------------ the model (one screen)
def make_weights(s: Setup) -> dict[str, torch.Tensor]:
    """Router and expert weights, identical on every rank and in the reference (CPU generator)."""
    g = torch.Generator().manual_seed(s.seed)
    scale = s.hidden ** -0.5
    cpu32 = dict(generator=g, dtype=torch.float32, device="cpu")
    return {"router": torch.randn(s.hidden, s.experts, **cpu32) * scale,
            "w1": torch.randn(s.experts, s.hidden, s.hidden, **cpu32) * scale,
            "w2": torch.randn(s.experts, s.hidden, s.hidden, **cpu32) * scale}


def make_tokens(s: Setup, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(s.seed + 1 + rank)
    return torch.randn(s.tokens, s.hidden, generator=g, dtype=torch.float32, device="cpu").bfloat16()


def route(x: torch.Tensor, router: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    # float64 so that ranks and the reference pick the same experts: in float32 a near-tie
    # between the K-th and (K+1)-th expert could flip with a different matmul blocking.
    probs = torch.softmax(x.double() @ router.double(), dim=-1)
    weights, idx = probs.topk(topk, dim=-1)
    return idx, weights.float()


def experts_forward(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                    w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """sum_k topk_weights[t, k] * MLP_{topk_idx[t, k]}(x[t]) over k with an expert in w1/w2, float32."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    xf = x.float()
    for e in range(w1.shape[0]):
        rows, slot = (topk_idx == e).nonzero(as_tuple=True)
        if rows.numel():
            y = torch.nn.functional.silu(xf[rows] @ w1[e]) @ w2[e]
            out.index_add_(0, rows, topk_weights[rows, slot, None] * y)
    return out


# ------------------------------------------------------------------ one rank
def rank_main(group: dist.ProcessGroup, s: Setup) -> dict:
    rank, on_gpu = group.rank(), dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    local = slice(rank * s.experts // s.ranks, (rank + 1) * s.experts // s.ranks)
    weights = make_weights(s)
    router, w1, w2 = (weights["router"].to(device), weights["w1"][local].to(device),
                      weights["w2"][local].to(device))
    x = make_tokens(s, rank).to(device)
    # The NVLink backend stages every received row: size for all ranks sending all tokens.
    buffer = deep_ep.Buffer(group, num_nvl_bytes=nvl_bytes_for(s.tokens, s.hidden, s.ranks, s.topk))
    times: dict[str, list[float]] = {phase: [] for phase in PHASES}
    for _ in range(s.iters):
        topk_idx, topk_weights = route(x, router, s.topk)
        dist.barrier(group)
        sync()
        stamps = [time.perf_counter()]
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, s.experts)
        sync()
        stamps.append(time.perf_counter())
        recv_x, recv_idx, recv_weights, _, handle, _ = buffer.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=topk_idx, topk_weights=topk_weights)
        sync()
        stamps.append(time.perf_counter())
        expert_out = experts_forward(recv_x, recv_idx, recv_weights, w1, w2).bfloat16()
        sync()
        stamps.append(time.perf_counter())
        out, _, _ = buffer.combine(expert_out, handle)  # unweighted sum: weights applied above
        sync()
        stamps.append(time.perf_counter())
        for phase, begin, end in zip(PHASES, stamps, stamps[1:]):
            times[phase].append(end - begin)
    return {"out": out.cpu(), "recv_rows": recv_x.shape[0], "times": times,
            "backend": type(buffer.backend).__name__}


# ------------------------------------------------------------------ driver
def reference(s: Setup) -> torch.Tensor:
    """The same layer in one process: all ranks' tokens, all experts."""
    weights = make_weights(s)
    x = torch.cat([make_tokens(s, rank) for rank in range(s.ranks)])
    topk_idx, topk_weights = route(x, weights["router"], s.topk)
    return experts_forward(x, topk_idx, topk_weights, weights["w1"], weights["w2"]).bfloat16()


def report(s: Setup, results: list[dict], where: str, diff: float, max_err: float, ok: bool) -> None:
    bytes_moved = sum(r["recv_rows"] for r in results) * s.hidden * 2  # bf16 rows received, all ranks
    print(f"tritonep demo: {s.ranks} ranks on {where}, {results[0]['backend']}, {s.tokens} tokens/rank, "
          f"hidden {s.hidden}, {s.experts} experts, top-{s.topk}")
    print(f"{'phase':<12}{'median ms':>11}{'bytes moved':>14}{'GB/s':>9}")
    for phase in PHASES:
        # Per iteration the slowest rank sets the phase time; the first iteration is warm-up.
        per_iter = [max(r["times"][phase][i] for r in results) for i in range(s.iters)]
        seconds = statistics.median(per_iter[1:] or per_iter)
        if phase in ("dispatch", "combine"):
            moved, rate = f"{bytes_moved / 1e6:.2f} MB", f"{bytes_moved / seconds / 1e9:.2f}"
        else:
            moved = rate = "-"
        print(f"{phase:<12}{seconds * 1e3:>11.3f}{moved:>14}{rate:>9}")
    print(f"vs single-process reference: calc_diff {diff:.2e}, max |err| {max_err:.3e} -> "
          f"{'PASS' if ok else 'FAIL'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--iters", type=int, default=5, help="iterations; the first is warm-up")
    parser.add_argument("--cpu", action="store_true", help="CPU ranks even when GPUs are present")
    args = parser.parse_args(argv)
    use_gpu = not args.cpu and torch.cuda.device_count() >= 2
    ranks = min(args.ranks, torch.cuda.device_count()) if use_gpu else args.ranks
    if ranks < 1 or args.experts % ranks or not 1 <= args.topk <= args.experts or args.iters < 1:
        parser.error(f"need experts % ranks == 0, 1 <= topk <= experts and iters >= 1; got {args.experts} "
                     f"experts, {ranks} ranks, top-{args.topk}, {args.iters} iters")
    s = Setup(ranks, args.tokens, args.hidden, args.experts, args.topk, args.iters)
    with RankPool(ranks, use_gpu=use_gpu) as pool:
        results = pool.run(rank_main, s)
    got = torch.cat([r["out"] for r in results])
    expected = reference(s)
    diff, max_err = calc_diff(got, expected), (got.float() - expected.float()).abs().max().item()
    # bf16 rounding of each rank's partial sum before combine gives calc_diff ~1e-6.
    ok = bool(torch.isfinite(got).all()) and diff < 1e-4
    report(s, results, "GPUs (NCCL)" if use_gpu else "CPU (gloo)", diff, max_err, ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
