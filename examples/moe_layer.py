"""A toy mixture-of-experts layer over R ranks, run with tritonep and with plain all_to_all_single.

    python examples/moe_layer.py [--ranks R] [--tokens N] [--hidden H] [--experts E] [--topk K]
                                 [--ffn F] [--iters I] [--cpu]

Each rank holds N tokens and E/R experts (an MLP H -> F -> H with SiLU each). A router picks
each token's top-K experts; the token travels to the ranks that hold them (dispatch), each
expert processes the rows it received, and the weighted sum of a token's expert outputs comes
back to its rank (combine). The layer runs two ways on the same inputs, in turn:

* tritonep: ``get_dispatch_layout``, ``dispatch``, ``combine``, as with DeepEP;
* all_to_all_single: the same exchange written with ``torch.distributed`` (count exchange,
  rows grouped by destination, ``all_to_all_single`` there and back), what one writes without
  an expert-parallel library.

On a machine with two or more GPUs: one rank per GPU (NCCL, where tritonep uses its NVLink
backend) at DeepEP's benchmark shape by default: 4096 tokens per rank, hidden 7168, 256
experts, top-8, with DeepSeek-V3's expert size F = 2048 and bf16 experts. Otherwise (or with
``--cpu``): CPU ranks (gloo, where tritonep uses its collective backend, itself built on
all_to_all_single) at a small shape, with float32 experts.

Each phase is timed on the wall clock, the ranks starting together and the device synchronised
at the end of every phase, so a phase's time covers its host and its GPU work. The bytes are
what one rank receives in a dispatch (bf16 rows, its own rows included, as DeepEP's "NVL GB/s"
counts them); the combine sends the same rows back.

Check: every rank recomputes the layer for its own tokens without any communication (every
expert's weights rebuilt from that expert's seed, one expert at a time, on the rank's own
device) and compares both runs' outputs with it, every token, at every size.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

import tritonep as deep_ep

# The only names from inside the package: the NVLink backend's buffer size, and local rank
# processes (gloo on CPUs, NCCL with one GPU each).
from tritonep import nvl_bytes_for
from tritonep.rank_pool import RankPool

PHASES = ("layout", "dispatch", "expert MLP", "combine")
PATHS = ("tritonep", "all_to_all_single")
# Each rank's partial sum is rounded to bf16 before the combine adds the partials up (the
# reference rounds once): a few 1e-3 per token. A missing, doubled or misplaced expert output
# moves a token by about 0.3 (K = 8).
WORST_TOKEN_TOLERANCE = 1e-2


@dataclass(frozen=True)
class Setup:
    ranks: int
    tokens: int  # per rank
    hidden: int
    experts: int
    topk: int
    ffn: int  # each expert's inner size
    iters: int
    seed: int = 0


GPU_DEFAULTS = dict(tokens=4096, hidden=7168, experts=256, topk=8, ffn=2048, iters=10)
CPU_DEFAULTS = dict(ranks=4, tokens=256, hidden=256, experts=16, topk=4, ffn=256, iters=10)


# ------------------------------------------------------------------ the model
def generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def make_router(s: Setup, device: torch.device) -> torch.Tensor:
    g = generator(device, s.seed)
    return torch.randn(s.hidden, s.experts, generator=g, dtype=torch.float32, device=device) * s.hidden ** -0.5


def make_tokens(s: Setup, rank: int, device: torch.device) -> torch.Tensor:
    g = generator(device, s.seed + 1 + rank)
    return torch.randn(s.tokens, s.hidden, generator=g, dtype=torch.float32, device=device).bfloat16()


def expert_weights(s: Setup, expert: int, device: torch.device,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The (w1 [H, F], w2 [F, H]) of one expert, made from that expert's own seed: a rank can
    rebuild any expert (the check needs all of them) without holding all of them. Every rank
    makes them on its own device, and equal devices give equal numbers."""
    g = generator(device, s.seed + 10_000 + expert)
    w1 = torch.randn(s.hidden, s.ffn, generator=g, dtype=torch.float32, device=device) * s.hidden ** -0.5
    w2 = torch.randn(s.ffn, s.hidden, generator=g, dtype=torch.float32, device=device) * s.ffn ** -0.5
    return w1.to(dtype), w2.to(dtype)


def route(x: torch.Tensor, router: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax router: (top-k expert ids int64 [N, K], their probabilities float32 [N, K])."""
    probs = torch.softmax(x.float() @ router, dim=-1)
    weights, idx = probs.topk(topk, dim=-1)
    return idx, weights


def moe_experts(x: torch.Tensor, expert_idx: torch.Tensor, expert_probs: torch.Tensor,
                experts: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """float32 [M, H]: sum over k of expert_probs[t, k] * MLP_e(x[t]), e = expert_idx[t, k], which
    indexes ``experts`` ((w1, w2) pairs); ids outside it (-1 included) add nothing."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e, (w1, w2) in enumerate(experts):
        rows, slot = (expert_idx == e).nonzero(as_tuple=True)
        if rows.numel():
            y = torch.nn.functional.silu(x[rows].to(w1.dtype) @ w1) @ w2
            out.index_add_(0, rows, expert_probs[rows, slot, None] * y.float())
    return out


# ------------------------------------------------------------------ the layer, two ways
class PhaseClock:
    """Wall time of each phase on this rank. ``start`` lines the ranks up; every ``lap`` waits
    for the device, so a phase's time covers the GPU work it queued, not just its host part."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group = group
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.seconds: dict[str, list[float]] = {phase: [] for phase in PHASES}
        self.last = 0.0

    def start(self) -> None:
        dist.barrier(group=self.group)
        self.sync()
        self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        self.sync()
        now = time.perf_counter()
        self.seconds[phase].append(now - self.last)
        self.last = now


def tritonep_layer(buffer: deep_ep.Buffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                   experts: list[tuple[torch.Tensor, torch.Tensor]], num_experts: int,
                   clock: PhaseClock) -> tuple[torch.Tensor, int]:
    """The layer with tritonep: (output bf16 [N, H], rows this rank received)."""
    clock.start()
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    clock.lap("layout")
    # Each token arrives once per rank that holds any of its experts; recv_idx holds local
    # expert ids (-1 for experts on other ranks).
    recv_x, recv_idx, recv_weights, _, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=topk_idx, topk_weights=topk_weights)
    clock.lap("dispatch")
    partial = moe_experts(recv_x, recv_idx, recv_weights, experts).to(torch.bfloat16)
    clock.lap("expert MLP")
    out, _, _ = buffer.combine(partial, handle)  # sums the ranks' partials; the weights were applied above
    clock.lap("combine")
    return out, recv_x.shape[0]


def all_to_all_layer(group: dist.ProcessGroup, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                     experts: list[tuple[torch.Tensor, torch.Tensor]], num_experts: int,
                     clock: PhaseClock) -> tuple[torch.Tensor, int]:
    """The same layer with torch.distributed.all_to_all_single: (output bf16 [N, H], rows received)."""
    num_ranks, rank = group.size(), group.rank()
    num_tokens, hidden, topk = x.shape[0], x.shape[1], topk_idx.shape[1]
    experts_per_rank = num_experts // num_ranks
    clock.start()
    # A token goes once to each rank holding any of its experts (the router never returns -1).
    in_rank = torch.zeros(num_tokens, num_ranks, dtype=torch.bool, device=x.device)
    in_rank.scatter_(1, topk_idx // experts_per_rank, True)
    _, send_token = in_rank.t().nonzero(as_tuple=True)  # grouped by destination rank, token order inside
    send_counts = in_rank.sum(0)
    clock.lap("layout")
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
    recv_x = x.new_empty(sum(recv_splits), hidden)
    dist.all_to_all_single(recv_x, x[send_token], recv_splits, send_splits, group=group)
    # Expert ids and weights travel in one message: the ids are small integers, exact in float32.
    routing = torch.cat([topk_idx.float(), topk_weights], dim=1)[send_token]
    recv_routing = routing.new_empty(sum(recv_splits), 2 * topk)
    dist.all_to_all_single(recv_routing, routing, recv_splits, send_splits, group=group)
    local_idx = recv_routing[:, :topk].long() - rank * experts_per_rank
    here = (local_idx >= 0) & (local_idx < experts_per_rank)
    recv_idx = torch.where(here, local_idx, -1)
    recv_weights = torch.where(here, recv_routing[:, topk:], 0.0)
    clock.lap("dispatch")
    partial = moe_experts(recv_x, recv_idx, recv_weights, experts).to(torch.bfloat16)
    clock.lap("expert MLP")
    back = partial.new_empty(send_token.numel(), hidden)
    dist.all_to_all_single(back, partial, send_splits, recv_splits, group=group)
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=x.device)
    out = out.index_add_(0, send_token, back.float()).bfloat16()
    clock.lap("combine")
    return out, recv_x.shape[0]


def compare(got: torch.Tensor, expected: torch.Tensor) -> dict[str, float]:
    """The worst token's relative error (L2 over its hidden values), and DeepEP's calc_diff of the whole."""
    got, expected = got.float(), expected.float()
    errors = (got - expected).norm(dim=1) / expected.norm(dim=1)
    return {"worst_token": errors.max().item() if errors.numel() else 0.0,
            "calc_diff": deep_ep.utils.calc_diff(got, expected)}


# ------------------------------------------------------------------ one rank
def rank_main(group: dist.ProcessGroup, s: Setup) -> dict:
    rank = group.rank()
    on_gpu = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32  # of the expert MLPs
    experts_per_rank = s.experts // s.ranks
    experts = [expert_weights(s, e, device, dtype)
               for e in range(rank * experts_per_rank, (rank + 1) * experts_per_rank)]
    x = make_tokens(s, rank, device)
    topk_idx, topk_weights = route(x, make_router(s, device), s.topk)
    # The NVLink backend stages every received row: room for every rank sending every token here.
    buffer = deep_ep.Buffer(group, num_nvl_bytes=nvl_bytes_for(s.tokens, s.hidden, s.ranks, s.topk))
    clocks = {path: PhaseClock(group, device) for path in PATHS}
    recv_rows = {}
    for _ in range(s.iters):
        # In turn, so that both see the same state of the machine.
        out_tritonep, recv_rows["tritonep"] = tritonep_layer(buffer, x, topk_idx, topk_weights, experts, s.experts,
                                                            clocks["tritonep"])
        out_all_to_all, recv_rows["all_to_all_single"] = all_to_all_layer(group, x, topk_idx, topk_weights, experts,
                                                                           s.experts, clocks["all_to_all_single"])
    all_experts = (expert_weights(s, e, device, dtype) for e in range(s.experts))
    expected = moe_experts(x, topk_idx, topk_weights, all_experts).bfloat16()
    return {"seconds": {path: clock.seconds for path, clock in clocks.items()},
            "recv_rows": recv_rows,
            "check": {"tritonep": compare(out_tritonep, expected),
                      "all_to_all_single": compare(out_all_to_all, expected)}}


# ------------------------------------------------------------------ driver
def tritonep_backend_name(use_gpu: bool) -> str:
    """The backend tritonep picks: TRITONEP_BACKEND if set, else NVLink on NCCL, collective on gloo."""
    choice = os.environ.get("TRITONEP_BACKEND", "auto")
    if choice == "auto":
        choice = "nvlink" if use_gpu else "collective"
    return {"nvlink": "NVLink backend", "collective": "collective backend"}.get(choice, choice)


def phase_medians(results: list[dict], path: str, iters: int) -> dict[str, float]:
    """Seconds per phase and for the whole layer: per iteration the slowest rank's time, then
    the median over the iterations after the first (warm-up)."""
    per_iter = {phase: [max(r["seconds"][path][phase][i] for r in results) for i in range(iters)]
                for phase in PHASES}
    per_iter["layer"] = [sum(per_iter[phase][i] for phase in PHASES) for i in range(iters)]
    return {name: statistics.median(values[1:] or values) for name, values in per_iter.items()}


def report(s: Setup, results: list[dict], use_gpu: bool) -> bool:
    """Print the table and the check; True when both runs match the reference."""
    where = "GPUs (NCCL)" if use_gpu else "CPU (gloo)"
    rows = statistics.mean(r["recv_rows"]["tritonep"] for r in results)
    rows_moved = rows * s.hidden * 2
    print(f"toy MoE layer: {s.ranks} ranks on {where}, {s.tokens} tokens/rank, hidden {s.hidden}, "
          f"{s.experts} experts ({s.experts // s.ranks} per rank), top-{s.topk}, "
          f"expert MLP {s.hidden} -> {s.ffn} -> {s.hidden} in {'bf16' if use_gpu else 'float32'}")
    print(f"each rank receives {rows:.0f} rows on average: {rows_moved / 1e6:.2f} MB of bf16 per dispatch, "
          f"the same back per combine")
    headers = {"tritonep": f"tritonep ({tritonep_backend_name(use_gpu)})",
               "all_to_all_single": "all_to_all_single (torch.distributed)"}
    medians = {path: phase_medians(results, path, s.iters) for path in PATHS}
    print(f"{'':<12}" + "".join(f"{headers[path]:>40}" for path in PATHS))
    print(f"{'phase':<12}" + f"{'ms':>28}{'GB/s':>12}" * len(PATHS))
    for phase in (*PHASES, "layer"):
        cells = ""
        for path in PATHS:
            seconds = medians[path][phase]
            rate = f"{rows_moved / seconds / 1e9:.3g}" if phase in ("dispatch", "combine") else "-"
            cells += f"{seconds * 1e3:>28.3f}{rate:>12}"
        print(f"{phase:<12}{cells}")
    timed = max(s.iters - 1, 1)
    print(f"(median of {timed} iteration{'s' if timed > 1 else ''}{' after a warm-up' if s.iters > 1 else ''}; "
          f"each phase's time is its slowest rank's; GB/s = bytes one rank receives / time)")
    ok = True
    for path in PATHS:
        worst = max(r["check"][path]["worst_token"] for r in results)
        diff = max(r["check"][path]["calc_diff"] for r in results)
        passed = worst < WORST_TOKEN_TOLERANCE  # False for NaN too
        ok = ok and passed
        print(f"check {path}: every token against the layer computed without communication: worst token "
              f"error {worst:.2e} (tolerance {WORST_TOKEN_TOLERANCE:.0e}), calc_diff {diff:.2e} -> "
              f"{'PASS' if passed else 'FAIL'}")
    return ok


def parse_setup(argv: list[str] | None, num_gpus: int) -> tuple[Setup, bool]:
    """The command line -> (Setup, whether the ranks run on GPUs)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, help="ranks (default: one per GPU on GPUs, 4 on CPU)")
    parser.add_argument("--tokens", type=int, help="tokens per rank (default: 4096 on GPUs, 256 on CPU)")
    parser.add_argument("--hidden", type=int, help="hidden size (default: 7168 on GPUs, 256 on CPU)")
    parser.add_argument("--experts", type=int, help="experts in all, a multiple of ranks (default: 256 / 16)")
    parser.add_argument("--topk", type=int, help="experts per token (default: 8 on GPUs, 4 on CPU)")
    parser.add_argument("--ffn", type=int, help="each expert's inner size (default: 2048 on GPUs, 256 on CPU)")
    parser.add_argument("--iters", type=int, help="iterations, the first one a warm-up (default: 10)")
    parser.add_argument("--cpu", action="store_true", help="CPU ranks even when GPUs are present")
    args = parser.parse_args(argv)
    use_gpu = not args.cpu and num_gpus >= 2
    defaults = dict(GPU_DEFAULTS, ranks=num_gpus) if use_gpu else CPU_DEFAULTS
    sizes = {name: getattr(args, name) if getattr(args, name) is not None else default
             for name, default in defaults.items()}
    if use_gpu:
        sizes["ranks"] = min(sizes["ranks"], num_gpus)  # one GPU per rank
    s = Setup(**sizes)
    if s.ranks < 1 or s.experts % s.ranks or not 1 <= s.topk <= s.experts or min(s.tokens, s.hidden, s.ffn) < 1 \
            or s.iters < 1:
        parser.error(f"need ranks >= 1, experts a multiple of ranks, 1 <= topk <= experts, tokens, hidden, ffn "
                     f"and iters >= 1; got {s}")
    return s, use_gpu


def main(argv: list[str] | None = None) -> int:
    s, use_gpu = parse_setup(argv, torch.cuda.device_count())
    with RankPool(s.ranks, use_gpu=use_gpu, timeout=1200) as pool:
        results = pool.run(rank_main, s)
    return 0 if report(s, results, use_gpu) else 1


if __name__ == "__main__":
    sys.exit(main())
