"""What the DeepEP compatibility tests share: the problems, the rank pools, running a case as a
DeepEP user's process, inputs and plain-torch references, and the user-side helpers.

Every rank function runs as a DeepEP caller's process does: ``torch.set_default_dtype(bf16)``
and, on GPUs, ``torch.set_default_device('cuda')`` first (restored afterwards: the rank
processes serve every test of a module). The library may not depend on either.

References are plain torch on the CPU under float32 defaults, rebuilt on every rank from the
seed for every source rank, and never call tritonep. Each feature has its own test, run on CPU
ranks (gloo, 2 and 3 ranks) and on all GPUs of the machine (marked ``gpu``): each test module
makes its ``ranks`` fixture with ``RANK_PARAMS`` and :func:`ranks_for`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
from collective_inputs import random_routing

import tritonep as deep_ep
from tritonep.rank_pool import RankPool, group_on_gpu

SEED = 5
INT32_MASK = (1 << 32) - 1


@dataclass(frozen=True)
class Problem:
    num_tokens: int        # normal mode: tokens of rank 0 (fewer on other ranks)
    hidden: int
    num_topk: int
    experts_per_rank: int
    num_nvl_bytes: int
    ll_tokens: int         # low latency: num_max_dispatch_tokens_per_rank (T)
    ll_hidden: int         # a multiple of 512, for use_ue8m0
    ll_topk: int


CPU_PROBLEM = Problem(num_tokens=20, hidden=256, num_topk=4, experts_per_rank=4, num_nvl_bytes=int(1e9),
                      ll_tokens=8, ll_hidden=512, ll_topk=4)
GPU_PROBLEM = Problem(num_tokens=512, hidden=2048, num_topk=8, experts_per_rank=8, num_nvl_bytes=int(1e9),
                      ll_tokens=128, ll_hidden=2048, ll_topk=8)


@dataclass
class Ranks:
    pool: RankPool
    problem: Problem
    on_gpu: bool

    def run(self, case: Callable[..., Any], *args: Any) -> list[Any]:
        return self.pool.run(as_deepep_user, case, self.problem, *args)


# 0 stands for every GPU of the machine.
RANK_PARAMS = [pytest.param(2, id="cpu2"), pytest.param(3, id="cpu3"),
               pytest.param(0, id="gpu", marks=pytest.mark.gpu(min_gpus=1))]


def ranks_for(request: pytest.FixtureRequest) -> Iterator[Ranks]:
    """The body of a module's ``ranks`` fixture (params ``RANK_PARAMS``). The GPU ranks are the
    session's (conftest.py ``gpu_pool``): ``as_deepep_user`` sets the torch defaults each case
    runs under, whatever the pool's."""
    if request.param == 0:
        yield Ranks(request.getfixturevalue("gpu_pool"), GPU_PROBLEM, on_gpu=True)
        return
    with RankPool(request.param, timeout=120) as pool:
        yield Ranks(pool, CPU_PROBLEM, on_gpu=False)


def as_deepep_user(group: dist.ProcessGroup, case: Callable[..., Any], problem: Problem, *args: Any) -> Any:
    """Run ``case`` under a DeepEP caller's torch defaults, then put the defaults back."""
    dtype, device, num_sms = torch.get_default_dtype(), torch.get_default_device(), deep_ep.Buffer.num_sms
    torch.set_default_dtype(torch.bfloat16)
    if group_on_gpu(group):
        torch.set_default_device("cuda")
    try:
        return case(group, problem, *args)
    finally:
        torch.set_default_dtype(dtype)
        torch.set_default_device(None if device.type == "cpu" else device)
        deep_ep.Buffer.num_sms = num_sms


# ------------------------------------------------------------------------------------ plain-torch side
@contextlib.contextmanager
def plain_torch():
    """float32 and CPU defaults for inputs and references, whatever the caller set."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.device("cpu"):
            yield
    finally:
        torch.set_default_dtype(dtype)


def on_user_device(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    device = torch.get_default_device()
    return tuple(t.to(device) for t in tensors)


def num_experts_of(problem: Problem, num_ranks: int) -> int:
    return problem.experts_per_rank * num_ranks


@plain_torch()
def normal_inputs(problem: Problem, seed: int, rank: int, num_ranks: int):
    """(x bf16 [N, H], topk_idx int64 [N, K] with some -1, topk_weights float32 [N, K]) on the CPU."""
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    num_tokens = problem.num_tokens - 3 * (rank % 4)
    x = torch.randn(num_tokens, problem.hidden, generator=g).to(torch.bfloat16)
    topk_idx, weights = random_routing(g, num_tokens, num_experts_of(problem, num_ranks), problem.num_topk, 0.2)
    return x, topk_idx, weights


@plain_torch()
def ll_inputs(problem: Problem, seed: int, rank: int, num_ranks: int):
    """Low-latency inputs: at most T tokens, rows of very different magnitudes (fp8 scales)."""
    g = torch.Generator().manual_seed(seed * 6151 + rank)
    num_tokens = problem.ll_tokens - rank % 3
    x = (torch.randn(num_tokens, problem.ll_hidden, generator=g)
         * torch.exp(torch.randn(num_tokens, 1, generator=g) * 2)).to(torch.bfloat16)
    topk_idx, weights = random_routing(g, num_tokens, num_experts_of(problem, num_ranks), problem.ll_topk, 0.1)
    return x, topk_idx, weights


@plain_torch()
def reference_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    """(num_tokens_per_rank int32 [R], num_tokens_per_expert int32 [E], is_token_in_rank bool [N, R])."""
    owner = torch.where(topk_idx >= 0, topk_idx // (num_experts // num_ranks), -1)
    in_rank = (owner.unsqueeze(2) == torch.arange(num_ranks)).any(1)
    per_expert = (topk_idx.unsqueeze(2) == torch.arange(num_experts)).sum((0, 1))
    return in_rank.sum(0).to(torch.int32), per_expert.to(torch.int32), in_rank


class Expected(NamedTuple):
    parts: list[tuple[int, torch.Tensor]]   # (source rank, its token indices), in receive order
    x: torch.Tensor
    topk_idx: torch.Tensor                  # local ids, -1 for experts on other ranks
    topk_weights: torch.Tensor              # 0 where topk_idx is -1
    rank_prefix_matrix: torch.Tensor
    per_expert: list[int]                   # received (token, local expert) pairs

    def gather(self, per_source: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([per_source[s][tokens] for s, tokens in self.parts])


@plain_torch()
def expected_receive(problem: Problem, seed: int, me: int, num_ranks: int) -> Expected:
    """What rank ``me`` receives: blocks by source rank ascending, source token order inside."""
    num_experts, per_rank = num_experts_of(problem, num_ranks), problem.experts_per_rank
    counts = torch.zeros(num_ranks, num_ranks, dtype=torch.int64)
    per_expert = torch.zeros(per_rank, dtype=torch.int64)
    parts, xs, ids, weights = [], [], [], []
    for source in range(num_ranks):
        x, topk_idx, w = normal_inputs(problem, seed, source, num_ranks)
        _, _, in_rank = reference_layout(topk_idx, num_experts, num_ranks)
        counts[source] = in_rank.sum(0)
        mine = (topk_idx >= 0) & (topk_idx // per_rank == me)
        local = torch.where(mine, topk_idx - me * per_rank, -1)
        per_expert += (local.unsqueeze(2) == torch.arange(per_rank)).sum((0, 1))
        tokens = in_rank[:, me].nonzero().flatten()
        parts.append((source, tokens))
        xs.append(x[tokens])
        ids.append(local[tokens])
        weights.append(torch.where(mine, w, 0.0)[tokens])
    return Expected(parts, torch.cat(xs), torch.cat(ids), torch.cat(weights),
                    counts.cumsum(0).to(torch.int32), per_expert.tolist())


@plain_torch()
def fp8_bound(x: torch.Tensor) -> torch.Tensor:
    """Largest |dequantised - x| an e4m3 cast with per-128-channel scales may give (bf16 output)."""
    grouped = x.float().view(*x.shape[:-1], -1, 128)
    scale = grouped.abs().amax(-1, keepdim=True).clamp(min=1e-4) / 448
    # Rounded scales (round_scale) are up to twice as large.
    return (grouped.abs() * (2 ** -4 + 2 ** -8) + 2 * scale * 2 ** -9).view(x.shape)


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepEP's test measure (0 = identical), written here so the check does not use deep_ep.utils."""
    x, y = x.double().cpu() + 1, y.double().cpu() + 1
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


# ------------------------------------------------------------------------------------ user-side helpers
def normal_buffer(group: dist.ProcessGroup, problem: Problem) -> deep_ep.Buffer:
    return deep_ep.Buffer(group, problem.num_nvl_bytes, 0, low_latency_mode=False, num_qps_per_rank=1,
                          explicitly_destroy=True)


def ll_buffer(group: dist.ProcessGroup, problem: Problem, explicitly_destroy: bool = True,
              **kwargs: Any) -> deep_ep.Buffer:
    R = group.size()
    num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(problem.ll_tokens, problem.ll_hidden, R,
                                                                   num_experts_of(problem, R))
    return deep_ep.Buffer(group, num_rdma_bytes=num_rdma_bytes, low_latency_mode=True,
                          num_qps_per_rank=problem.experts_per_rank, allow_nvlink_for_low_latency_mode=True,
                          explicitly_destroy=explicitly_destroy, **kwargs)


def my_normal_inputs(group: dist.ProcessGroup, problem: Problem, seed: int = SEED):
    return on_user_device(*normal_inputs(problem, seed, group.rank(), group.size()))


def dispatch_with_layout(buffer: deep_ep.Buffer, x, topk_idx, topk_weights, num_experts: int, **kwargs):
    num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, _ = \
        buffer.get_dispatch_layout(topk_idx, num_experts)
    return buffer.dispatch(x, num_tokens_per_rank=num_tokens_per_rank,
                           num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
                           num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx,
                           topk_weights=topk_weights, **kwargs)


@plain_torch()
def identity_combine(x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> torch.Tensor:
    """bf16 on the CPU: what ``combine(dispatch(x))`` gives when every rank returns the rows it
    received, from ``topk_idx`` alone: each token times the number of ranks its experts are on
    (copies of one bf16 value sum exactly in float32, and round once)."""
    _, _, in_rank = reference_layout(topk_idx.cpu(), num_experts, num_ranks)
    return (x.cpu().float() * in_rank.sum(1, keepdim=True)).to(torch.bfloat16)


def check_identity(combined_x: torch.Tensor, x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int,
                   num_ranks: int) -> None:
    """``combine(dispatch(x)) == x * is_token_in_rank.sum(1)``, exactly."""
    assert combined_x.dtype == torch.bfloat16 and combined_x.device.type == x.device.type
    assert torch.equal(combined_x.cpu(), identity_combine(x, topk_idx, num_experts, num_ranks))


def check_wait_stats(stats: torch.Tensor) -> None:
    """A ``*_wait_recv_cost_stats`` tensor after calls that received rows from every rank.

    The CPU backend times the host's wait for the one all_to_all that brings every rank's rows
    (nanoseconds: never 0) and adds it to every rank's entry, so the entries are equal and
    positive. The NVLink kernels add each receive item's wait, timed on the GPU clock, to its
    source's entry: a source whose rows were already there may add nothing the clock can see,
    but a rank that received waited for some.
    """
    values = stats.cpu()
    assert stats.dtype == torch.int64 and bool((values >= 0).all()), values.tolist()
    if stats.is_cuda:
        assert int(values.sum()) > 0, values.tolist()
    else:
        assert bool((values > 0).all()) and bool((values == values[0]).all()), values.tolist()


def round_trip(buffer: deep_ep.Buffer, group: dist.ProcessGroup, problem: Problem) -> None:
    """A fresh dispatch and its combine, checked with the identity."""
    x, topk_idx, weights = my_normal_inputs(group, problem)
    num_experts = num_experts_of(problem, group.size())
    recv_x, _, _, _, handle, _ = dispatch_with_layout(buffer, x, topk_idx, weights, num_experts)
    combined_x, _, _ = buffer.combine(recv_x, handle)
    check_identity(combined_x, x, topk_idx, num_experts, group.size())
