"""DeepEP compatibility: tritonep driven only through ``import tritonep as deep_ep``, the way
DeepEP's users (its own tests, Megatron-LM, SGLang) write code.

Every rank function runs as a DeepEP caller's process does: ``torch.set_default_dtype(bf16)``
and, on GPUs, ``torch.set_default_device('cuda')`` first (restored afterwards: the rank
processes serve every test of the module). The library may not depend on either.

References are plain torch on the CPU under float32 defaults, rebuilt on every rank from the
seed for every source rank, and never call tritonep. Each feature has its own test, run on CPU
ranks (gloo, 2 and 3 ranks) and on all GPUs of the machine (marked ``gpu``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
from collective_inputs import random_routing

import tritonep as deep_ep
from tritonep.launch import RankFailure, RankPool

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


@pytest.fixture(scope="module", params=[pytest.param(2, id="cpu2"), pytest.param(3, id="cpu3"),
                                        pytest.param(0, id="gpu", marks=pytest.mark.gpu(min_gpus=1))])
def ranks(request: pytest.FixtureRequest):
    if request.param == 0:
        pool, problem = RankPool(torch.cuda.device_count(), use_gpu=True, timeout=600), GPU_PROBLEM
    else:
        pool, problem = RankPool(request.param, timeout=120), CPU_PROBLEM
    with pool:
        yield Ranks(pool, problem, on_gpu=request.param == 0)


def as_deepep_user(group: dist.ProcessGroup, case: Callable[..., Any], problem: Problem, *args: Any) -> Any:
    """Run ``case`` under a DeepEP caller's torch defaults, then put the defaults back."""
    dtype, device, num_sms = torch.get_default_dtype(), torch.get_default_device(), deep_ep.Buffer.num_sms
    torch.set_default_dtype(torch.bfloat16)
    if dist.get_backend(group) == "nccl":
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


def check_identity(combined_x: torch.Tensor, x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int,
                   num_ranks: int) -> None:
    """``combine(dispatch(x)) == x * is_token_in_rank.sum(1)``: copies of one bf16 value sum exactly."""
    _, _, in_rank = reference_layout(topk_idx.cpu(), num_experts, num_ranks)
    with plain_torch():
        expected = (x.cpu().float() * in_rank.sum(1, keepdim=True)).to(torch.bfloat16)
    assert combined_x.dtype == torch.bfloat16 and combined_x.device.type == x.device.type
    assert torch.equal(combined_x.cpu(), expected)


def round_trip(buffer: deep_ep.Buffer, group: dist.ProcessGroup, problem: Problem) -> None:
    """A fresh dispatch and its combine, checked with the identity."""
    x, topk_idx, weights = my_normal_inputs(group, problem)
    num_experts = num_experts_of(problem, group.size())
    recv_x, _, _, _, handle, _ = dispatch_with_layout(buffer, x, topk_idx, weights, num_experts)
    combined_x, _, _ = buffer.combine(recv_x, handle)
    check_identity(combined_x, x, topk_idx, num_experts, group.size())


# ------------------------------------------------------------------------------------ constructor, statics
def case_constructor_positional(group, problem: Problem) -> None:
    # DeepEP V1 order: group, num_nvl_bytes, num_rdma_bytes, low_latency_mode, num_qps_per_rank,
    # allow_nvlink_for_low_latency_mode, allow_mnnvl, use_fabric, explicitly_destroy, enable_shrink, comm
    buffer = deep_ep.Buffer(group, problem.num_nvl_bytes, 0, False, 1, True, False, False, True, False, None)
    assert buffer.explicitly_destroy and not buffer.enable_shrink and not buffer.low_latency_mode
    assert buffer.group is group and buffer.rank == group.rank() and buffer.group_size == group.size()
    assert buffer.num_nvl_bytes == problem.num_nvl_bytes and buffer.num_rdma_bytes == 0
    round_trip(buffer, group, problem)
    buffer.destroy()


def case_constructor_keywords(group, problem: Problem) -> None:
    # DeepEP's test_intranode.py builds its buffer like this.
    buffer = deep_ep.Buffer(group, problem.num_nvl_bytes, 0, low_latency_mode=False, num_qps_per_rank=1,
                            explicitly_destroy=True, allow_mnnvl=False, use_fabric=False)
    round_trip(buffer, group, problem)
    buffer.destroy()
    R = group.size()
    num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(problem.ll_tokens, problem.ll_hidden, R,
                                                                   num_experts_of(problem, R))
    ll = deep_ep.Buffer(group=group, num_nvl_bytes=0, num_rdma_bytes=num_rdma_bytes, low_latency_mode=True,
                        num_qps_per_rank=problem.experts_per_rank, allow_nvlink_for_low_latency_mode=True,
                        allow_mnnvl=False, use_fabric=False, explicitly_destroy=True, enable_shrink=False, comm=None)
    assert ll.low_latency_mode and ll.num_rdma_bytes == num_rdma_bytes
    ll.destroy()
    with pytest.raises(ValueError):
        deep_ep.Buffer(None)   # neither a group nor an mpi4py communicator


def case_static_helpers(group, problem: Problem) -> None:
    R, num_experts = group.size(), num_experts_of(problem, group.size())
    assert deep_ep.topk_idx_t == torch.int64
    assert isinstance(deep_ep.Buffer.is_sm90_compiled(), bool)
    assert deep_ep.Buffer.num_sms == 20
    deep_ep.Buffer.set_num_sms(24)   # as_deepep_user puts the class attribute back
    assert deep_ep.Buffer.num_sms == 24
    with pytest.raises(Exception):   # noqa: B017 - DeepEP asserts, tritonep raises InputError
        deep_ep.Buffer.set_num_sms(23)
    dispatch_config, combine_config = deep_ep.Buffer.get_dispatch_config(R), deep_ep.Buffer.get_combine_config(R)
    assert isinstance(dispatch_config, deep_ep.Config) and isinstance(combine_config, deep_ep.Config)
    hidden_bytes = problem.hidden * 2
    for config in (dispatch_config, combine_config):
        nvl_hint = config.get_nvl_buffer_size_hint(hidden_bytes, R)
        rdma_hint = config.get_rdma_buffer_size_hint(hidden_bytes, R)
        assert isinstance(nvl_hint, int) and nvl_hint > 0
        assert isinstance(rdma_hint, int) and rdma_hint >= 0
    # Config(...) positionally (DeepEP's tests) and by keyword, passed as config=.
    positional = deep_ep.Config(deep_ep.Buffer.num_sms, 8, 256)
    keywords = deep_ep.Config(num_sms=24, num_max_nvl_chunked_send_tokens=4, num_max_nvl_chunked_recv_tokens=256,
                              num_max_rdma_chunked_send_tokens=6, num_max_rdma_chunked_recv_tokens=128)
    buffer = normal_buffer(group, problem)
    x, topk_idx, weights = my_normal_inputs(group, problem)
    for dispatch_cfg, combine_cfg in ((positional, keywords), (dispatch_config, combine_config)):
        recv_x, _, _, _, handle, _ = dispatch_with_layout(buffer, x, topk_idx, weights, num_experts,
                                                          config=dispatch_cfg)
        combined_x, _, _ = buffer.combine(recv_x, handle, config=combine_cfg)
        check_identity(combined_x, x, topk_idx, num_experts, R)
    buffer.destroy()


def case_buffer_sized_from_config_hints(group, problem: Problem) -> None:
    """Megatron-LM / SGLang size the normal-mode buffer from the configs' hints, then dispatch
    however many tokens a batch has."""
    R, num_experts = group.size(), num_experts_of(problem, group.size())
    x, topk_idx, weights = my_normal_inputs(group, problem)
    hidden_bytes = x.size(1) * max(x.element_size(), 2)
    num_nvl_bytes, num_rdma_bytes = 0, 0
    for config in (deep_ep.Buffer.get_dispatch_config(R), deep_ep.Buffer.get_combine_config(R)):
        num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, R), num_nvl_bytes)
        num_rdma_bytes = max(config.get_rdma_buffer_size_hint(hidden_bytes, R), num_rdma_bytes)
    buffer = deep_ep.Buffer(group, num_nvl_bytes, num_rdma_bytes)
    recv_x, _, _, _, handle, _ = dispatch_with_layout(buffer, x, topk_idx, weights, num_experts)
    combined_x, _, _ = buffer.combine(recv_x, handle)
    check_identity(combined_x, x, topk_idx, num_experts, R)


# ------------------------------------------------------------------------------------ normal mode
def case_get_dispatch_layout(group, problem: Problem) -> None:
    R, num_experts = group.size(), num_experts_of(problem, group.size())
    buffer = normal_buffer(group, problem)
    _, topk_idx, _ = my_normal_inputs(group, problem)
    num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, _ = \
        buffer.get_dispatch_layout(topk_idx, num_experts)
    ref_per_rank, ref_per_expert, ref_in_rank = reference_layout(topk_idx.cpu(), num_experts, R)
    assert num_tokens_per_rdma_rank is None   # one node
    for got, ref in ((num_tokens_per_rank, ref_per_rank), (num_tokens_per_expert, ref_per_expert),
                     (is_token_in_rank, ref_in_rank)):
        assert got.dtype == ref.dtype and got.device.type == topk_idx.device.type
        assert torch.equal(got.cpu(), ref)
    buffer.destroy()


def check_received(got, expected: Expected, me: int) -> None:
    """Everything but the rows: local top-k ids and weights, rank_prefix_matrix = handle[0], the
    per-expert list (expert_alignment=1)."""
    recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle = got
    assert recv_topk_idx.dtype == deep_ep.topk_idx_t and torch.equal(recv_topk_idx.cpu(), expected.topk_idx)
    assert recv_topk_weights.dtype == torch.float32 and torch.equal(recv_topk_weights.cpu(), expected.topk_weights)
    rank_prefix_matrix = handle[0]
    assert rank_prefix_matrix.dtype == torch.int32
    assert torch.equal(rank_prefix_matrix.cpu(), expected.rank_prefix_matrix)
    assert rank_prefix_matrix[-1, me].item() == expected.x.size(0)
    # Placed like DeepEP's intranode handle: [3] recv_src_idx, [4] is_token_in_rank (6 elements).
    assert len(handle) == 6
    recv_src_idx = torch.cat([tokens for _, tokens in expected.parts])
    assert torch.equal(handle[3].cpu().long(), recv_src_idx)
    assert handle[4].dtype == torch.bool and handle[4].shape[1] == rank_prefix_matrix.shape[0]
    assert isinstance(num_recv_tokens_per_expert_list, list)
    assert num_recv_tokens_per_expert_list == expected.per_expert


def case_dispatch_bf16(group, problem: Problem) -> None:
    me, R = group.rank(), group.size()
    buffer = normal_buffer(group, problem)
    x, topk_idx, weights = my_normal_inputs(group, problem)
    recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, _ = \
        dispatch_with_layout(buffer, x, topk_idx, weights, num_experts_of(problem, R))
    expected = expected_receive(problem, SEED, me, R)
    # Blocks by source rank ascending, the source's token order inside.
    assert recv_x.dtype == torch.bfloat16 and torch.equal(recv_x.cpu(), expected.x)
    check_received((recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle), expected, me)
    buffer.destroy()


def source_cast(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``per_token_cast_to_fp8`` of a source's CPU rows as that source made it: on the user's
    device, then back on the CPU."""
    data, scales = deep_ep.utils.per_token_cast_to_fp8(*on_user_device(x))
    return data.cpu(), scales.cpu()


def case_dispatch_fp8(group, problem: Problem) -> None:
    me, R = group.rank(), group.size()
    buffer = normal_buffer(group, problem)
    x, topk_idx, weights = my_normal_inputs(group, problem)
    x_e4m3 = deep_ep.utils.per_token_cast_to_fp8(x)
    x_e4m3 = (x_e4m3[0], x_e4m3[1].T.contiguous().T)   # column-major scales, as DeepEP's test passes them
    recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, _ = \
        dispatch_with_layout(buffer, x_e4m3, topk_idx, weights, num_experts_of(problem, R))
    assert isinstance(recv_x, tuple) and len(recv_x) == 2
    recv_data, recv_scales = recv_x
    expected = expected_receive(problem, SEED, me, R)
    assert recv_data.dtype == torch.float8_e4m3fn and recv_data.shape == expected.x.shape
    assert recv_scales.dtype == torch.float32 and recv_scales.shape == (expected.x.shape[0], problem.hidden // 128)
    # The fp8 bytes and scales travel unchanged: compare with every source's own cast, made on the
    # device the sources cast on (a GPU's division and rounding may differ from the CPU's).
    sent = [source_cast(normal_inputs(problem, SEED, s, R)[0]) for s in range(R)]
    expected_data = expected.gather([data.view(torch.uint8) for data, _ in sent])
    expected_scales = expected.gather([scales for _, scales in sent])
    assert torch.equal(recv_data.cpu().view(torch.uint8), expected_data)
    assert torch.equal(recv_scales.cpu(), expected_scales)
    back = deep_ep.utils.per_token_cast_back(*recv_x)
    assert bool(((back.cpu().float() - expected.x.float()).abs() <= fp8_bound(expected.x)).all())
    check_received((recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle), expected, me)
    buffer.destroy()


def case_expert_alignment(group, problem: Problem, alignment: int) -> None:
    me, R = group.rank(), group.size()
    buffer = normal_buffer(group, problem)
    x, topk_idx, weights = my_normal_inputs(group, problem)
    _, _, _, num_recv_tokens_per_expert_list, _, _ = dispatch_with_layout(
        buffer, x, topk_idx, weights, num_experts_of(problem, R), expert_alignment=alignment)
    counts = expected_receive(problem, SEED, me, R).per_expert
    assert num_recv_tokens_per_expert_list == [-(-c // alignment) * alignment for c in counts]
    assert all(type(c) is int for c in num_recv_tokens_per_expert_list)
    buffer.destroy()


def case_cached_dispatch(group, problem: Problem, use_fp8: bool) -> None:
    me, R = group.rank(), group.size()
    buffer = normal_buffer(group, problem)
    x, topk_idx, weights = my_normal_inputs(group, problem)
    _, _, _, _, handle, _ = dispatch_with_layout(buffer, x, topk_idx, weights, num_experts_of(problem, R))
    # A second activation with the same routing (say, the next layer's input) reuses the handle.
    x2 = my_normal_inputs(group, problem, seed=SEED + 1)[0]
    sent = deep_ep.utils.per_token_cast_to_fp8(x2) if use_fp8 else x2
    config = deep_ep.Buffer.get_dispatch_config(R)
    recv_x, recv_topk_idx, recv_topk_weights, num_list, cached_handle, _ = buffer.dispatch(
        sent, handle=handle, config=config)
    assert recv_topk_idx is None and recv_topk_weights is None and num_list is None and cached_handle is None
    expected = expected_receive(problem, SEED, me, R)
    sources = [normal_inputs(problem, SEED + 1, s, R)[0] for s in range(R)]
    if use_fp8:
        sources = [source_cast(s)[0].view(torch.uint8) for s in sources]
    if use_fp8:
        assert isinstance(recv_x, tuple)
        assert torch.equal(recv_x[0].cpu().view(torch.uint8), expected.gather(sources))
    else:
        assert torch.equal(recv_x.cpu(), expected.gather(sources))
    buffer.destroy()


def case_num_worst_tokens(group, problem: Problem) -> None:
    R, num_experts = group.size(), num_experts_of(problem, group.size())
    buffer = normal_buffer(group, problem)
    x, topk_idx, weights = my_normal_inputs(group, problem)
    recv_x, recv_topk_idx, recv_topk_weights, _, _, _ = dispatch_with_layout(buffer, x, topk_idx, weights,
                                                                             num_experts)
    num_worst_tokens = problem.num_tokens * R   # DeepEP's test: tokens per rank * ranks
    worst_x, worst_topk_idx, worst_topk_weights, empty_list, worst_handle, _ = dispatch_with_layout(
        buffer, x, topk_idx, weights, num_experts, num_worst_tokens=num_worst_tokens)
    real = recv_x.size(0)
    assert len(empty_list) == 0
    assert worst_x.size(0) == worst_topk_idx.size(0) == worst_topk_weights.size(0) == num_worst_tokens
    assert torch.equal(worst_x[:real], recv_x) and torch.equal(worst_topk_idx[:real], recv_topk_idx)
    assert torch.equal(worst_topk_weights[:real], recv_topk_weights)
    assert bool((worst_topk_idx[real:] == -1).all())
    combined_x, _, _ = buffer.combine(worst_x, worst_handle)   # padding rows are ignored
    check_identity(combined_x, x, topk_idx, num_experts, R)
    buffer.destroy()


def case_dispatch_without_topk(group, problem: Problem) -> None:
    """DeepEP's tests also dispatch without top-k: the per-expert list still counts the pairs."""
    me, R, num_experts = group.rank(), group.size(), num_experts_of(problem, group.size())
    buffer = normal_buffer(group, problem)
    x, topk_idx, _ = my_normal_inputs(group, problem)
    num_tokens_per_rank, _, num_tokens_per_expert, is_token_in_rank, _ = buffer.get_dispatch_layout(topk_idx,
                                                                                                    num_experts)
    recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=num_tokens_per_rank, is_token_in_rank=is_token_in_rank,
        num_tokens_per_expert=num_tokens_per_expert)
    expected = expected_receive(problem, SEED, me, R)
    assert recv_topk_idx is None and recv_topk_weights is None
    assert torch.equal(recv_x.cpu(), expected.x)
    assert num_recv_tokens_per_expert_list == expected.per_expert
    combined_x, combined_topk_weights, _ = buffer.combine(recv_x, handle)
    assert combined_topk_weights is None
    check_identity(combined_x, x, topk_idx, num_experts, R)
    buffer.destroy()


def case_combine_identity(group, problem: Problem) -> None:
    R, num_experts = group.size(), num_experts_of(problem, group.size())
    buffer = normal_buffer(group, problem)
    x, topk_idx, weights = my_normal_inputs(group, problem)
    recv_x, _, _, _, handle, _ = dispatch_with_layout(buffer, x, topk_idx, weights, num_experts)
    combined_x, combined_topk_weights, _ = buffer.combine(recv_x, handle)
    assert combined_topk_weights is None
    check_identity(combined_x, x, topk_idx, num_experts, R)
    buffer.destroy()


def case_combine_topk_weights(group, problem: Problem) -> None:
    R, num_experts = group.size(), num_experts_of(problem, group.size())
    buffer = normal_buffer(group, problem)
    x, topk_idx, weights = my_normal_inputs(group, problem)
    recv_x, _, recv_topk_weights, _, handle, _ = dispatch_with_layout(buffer, x, topk_idx, weights, num_experts)
    combined_x, combined_topk_weights, _ = buffer.combine(recv_x, handle, topk_weights=recv_topk_weights)
    check_identity(combined_x, x, topk_idx, num_experts, R)
    # Each valid (token, k) weight went to exactly one rank; the others sent 0 for it.
    with plain_torch():
        expected = torch.where(topk_idx.cpu() >= 0, weights.cpu(), 0.0)
    assert combined_topk_weights.dtype == torch.float32
    assert torch.equal(combined_topk_weights.cpu(), expected)
    buffer.destroy()


def case_combine_bias(group, problem: Problem) -> None:
    R, num_experts = group.size(), num_experts_of(problem, group.size())
    buffer = normal_buffer(group, problem)
    x, topk_idx, weights = my_normal_inputs(group, problem)
    recv_x, _, _, _, handle, _ = dispatch_with_layout(buffer, x, topk_idx, weights, num_experts)
    with plain_torch():
        g = torch.Generator().manual_seed(SEED + 100 * group.rank())
        bias_0 = torch.randn(x.shape, generator=g).to(torch.bfloat16)
        bias_1 = torch.randn(x.shape, generator=g).to(torch.bfloat16)
        copies = reference_layout(topk_idx.cpu(), num_experts, R)[2].sum(1, keepdim=True)
        base = x.cpu().float() * copies
    for bias, expected in ((bias_0, base + bias_0.float()), ((bias_0, bias_1), base + bias_0.float() + bias_1.float())):
        user_bias = on_user_device(*bias) if isinstance(bias, tuple) else on_user_device(bias)[0]
        combined_x, _, _ = buffer.combine(recv_x, handle, bias=user_bias)
        assert combined_x.dtype == torch.bfloat16
        torch.testing.assert_close(combined_x.cpu().float(), expected, rtol=2 ** -7, atol=1e-5)
    buffer.destroy()


def case_async(group, problem: Problem) -> None:
    """SGLang / Megatron style: previous_event from capture(), async_finish, allocate_on_comm_stream."""
    me, R, num_experts = group.rank(), group.size(), num_experts_of(problem, group.size())
    buffer = normal_buffer(group, problem)
    if dist.get_backend(group) == "nccl":
        assert isinstance(buffer.get_comm_stream(), torch.cuda.Stream)
    x, topk_idx, weights = my_normal_inputs(group, problem)
    previous_event = deep_ep.Buffer.capture()
    assert isinstance(previous_event, deep_ep.EventOverlap)
    num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, event = \
        buffer.get_dispatch_layout(topk_idx, num_experts, previous_event=previous_event, async_finish=True,
                                   allocate_on_comm_stream=True)
    event.current_stream_wait()
    recv_x, recv_topk_idx, recv_topk_weights, num_list, handle, event = buffer.dispatch(
        x, topk_idx=topk_idx, topk_weights=weights, num_tokens_per_rank=num_tokens_per_rank,
        num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
        num_tokens_per_expert=num_tokens_per_expert, previous_event=deep_ep.Buffer.capture(), async_finish=True,
        allocate_on_comm_stream=True)
    event.current_stream_wait()
    expected = expected_receive(problem, SEED, me, R)
    assert torch.equal(recv_x.cpu(), expected.x)
    check_received((recv_topk_idx, recv_topk_weights, num_list, handle), expected, me)
    cached_x, _, _, _, _, event = buffer.dispatch(x, handle=handle, async_finish=True)
    event.current_stream_wait()
    assert torch.equal(cached_x, recv_x)
    combined_x, combined_topk_weights, event = buffer.combine(
        recv_x, handle, topk_weights=recv_topk_weights, previous_event=deep_ep.Buffer.capture(),
        async_finish=True, allocate_on_comm_stream=True)
    with event:   # the current stream waits on leaving the block
        unrelated = x.float().sum()
    assert bool(torch.isfinite(unrelated))
    check_identity(combined_x, x, topk_idx, num_experts, R)
    buffer.destroy()


# ------------------------------------------------------------------------------------ low latency
@plain_torch()
def expected_packed(problem: Problem, seed: int, me: int, num_ranks: int, masked: frozenset = frozenset()):
    """For local expert e and source s: the source's tokens that chose expert me*E_local+e (none
    from masked sources), and every source's inputs."""
    inputs = [ll_inputs(problem, seed, s, num_ranks) for s in range(num_ranks)]
    per_rank = problem.experts_per_rank
    tokens = [[(topk_idx == me * per_rank + e).any(1).nonzero().flatten() if s not in masked
               else torch.zeros(0, dtype=torch.int64)
               for s, (_, topk_idx, _) in enumerate(inputs)] for e in range(per_rank)]
    return tokens, inputs


@plain_torch()
def scales_as_float(scales: torch.Tensor) -> torch.Tensor:
    """float32 [..., H/128] from float32 scales or int32 ones holding 4 UE8M0 bytes (2**(b-127)),
    group 0 in the lowest byte; any strides."""
    if scales.dtype == torch.int32:
        exponents = scales.clone(memory_format=torch.contiguous_format).view(torch.uint8).to(torch.int32)
        return torch.exp2((exponents - 127).float())
    return scales.float()


@plain_torch()
def dequantize(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 rows from e4m3 data and their scales."""
    return (data.float().view(*data.shape[:-1], -1, 128) * scales_as_float(scales).unsqueeze(-1)).view(data.shape)


@plain_torch()
def expected_scales(x: torch.Tensor, round_scale: bool) -> torch.Tensor:
    """max(amax, 1e-4) / 448 per token and 128 channels; rounded up to a power of two if asked."""
    scale = x.float().view(x.shape[0], -1, 128).abs().amax(-1).clamp(min=1e-4) / 448
    if not round_scale:
        return scale
    mantissa, exponent = torch.frexp(scale)   # scale = mantissa * 2**exponent, mantissa in [0.5, 1)
    return torch.ldexp(torch.ones_like(scale), torch.where(mantissa == 0.5, exponent - 1, exponent))


def check_packed(problem: Problem, me: int, R: int, packed_recv_x, packed_recv_count: torch.Tensor, handle,
                 masked: frozenset = frozenset(), use_fp8: bool = False, round_scale: bool = False,
                 use_ue8m0: bool = False) -> None:
    """DeepEP's layout: [E_local, R*T, H], the first count[e] rows of expert e valid, source
    blocks where layout_range says, each row the token src_info names (block order free)."""
    per_rank, T, H = problem.experts_per_rank, problem.ll_tokens, problem.ll_hidden
    tokens, inputs = expected_packed(problem, SEED, me, R, masked)
    src_info, layout_range, t_, h_, e_ = handle
    assert (t_, h_, e_) == (T, H, num_experts_of(problem, R))
    assert packed_recv_count.dtype == torch.int32 and packed_recv_count.shape == (per_rank,)
    assert src_info.dtype == torch.int32 and src_info.shape == (per_rank, R * T)
    assert layout_range.dtype == torch.int64 and layout_range.shape == (per_rank, R)
    if use_fp8:
        data, scales = packed_recv_x
        assert data.dtype == torch.float8_e4m3fn and data.shape == (per_rank, R * T, H)
        assert scales.dtype == (torch.int32 if use_ue8m0 else torch.float32)
        assert scales.shape == (per_rank, R * T, H // 512 if use_ue8m0 else H // 128)
        assert scales.stride(1) == 1 and scales.stride(2) == R * T   # column-major in the last two dims
        data, scales = data.cpu(), scales.cpu()
    else:
        assert packed_recv_x.dtype == torch.bfloat16 and packed_recv_x.shape == (per_rank, R * T, H)
        data = packed_recv_x.cpu()
    count, src_info, layout_range = packed_recv_count.cpu(), src_info.cpu(), layout_range.cpu()
    for e in range(per_rank):
        assert int(count[e]) == sum(len(t) for t in tokens[e]), (e, count.tolist())
        covered = []
        for s in range(R):
            begin, num = int(layout_range[e, s]) >> 32, int(layout_range[e, s]) & INT32_MASK
            assert num == len(tokens[e][s]), (e, s, num)
            if num == 0:
                continue
            rows = slice(begin, begin + num)
            src = src_info[e, rows].to(torch.int64)
            assert torch.equal(src.sort().values, tokens[e][s])
            x = inputs[s][0][src]
            if not use_fp8:
                assert torch.equal(data[e, rows], x)
            else:
                # DeepEP multiplies by 1/448 where the SPEC divides by 448: allow that rounding.
                torch.testing.assert_close(scales_as_float(scales[e, rows]), expected_scales(x, round_scale),
                                           rtol=2 ** -22, atol=0)
                got = dequantize(data[e, rows], scales[e, rows])
                assert bool(((got - x.float()).abs() <= fp8_bound(x)).all()), (e, s)
            covered += range(begin, begin + num)
        assert sorted(covered) == list(range(int(count[e])))


def expert_factors(me: int, per_rank: int) -> list[float]:
    """A stand-in expert per global id g: y = x * ((g % 7) + 1) / 4, so mixed-up experts show."""
    return [((me * per_rank + e) % 7 + 1) / 4 for e in range(per_rank)]


def run_experts(packed_recv_x: torch.Tensor, me: int) -> torch.Tensor:
    """User-side expert computation on the packed bf16 rows: bf16 [E_local, R*T, H]."""
    factors = torch.tensor(expert_factors(me, packed_recv_x.size(0)), dtype=torch.float32)
    return (packed_recv_x.float() * factors.view(-1, 1, 1)).to(torch.bfloat16)


@plain_torch()
def expected_combine(problem: Problem, x: torch.Tensor, topk_idx: torch.Tensor, weights: torch.Tensor,
                     num_ranks: int, masked: frozenset = frozenset()) -> torch.Tensor:
    """out[t] = sum over k (valid, expert not on a masked rank) of w[t, k] * y_{topk_idx[t, k]}(t)."""
    per_rank = problem.experts_per_rank
    factors = torch.tensor([f for r in range(num_ranks) for f in expert_factors(r, per_rank)])
    total = torch.zeros(x.shape, dtype=torch.float32)
    for k in range(topk_idx.size(1)):
        g = topk_idx[:, k]
        use = (g >= 0) & torch.tensor([int(e) // per_rank not in masked for e in g.tolist()], dtype=torch.bool)
        y = (x.float() * factors[g.clamp(min=0)].unsqueeze(1)).to(torch.bfloat16).float()
        total += torch.where(use.unsqueeze(1), weights[:, k:k + 1] * y, 0.0)
    return total


def check_combined(problem: Problem, combined_x: torch.Tensor, me: int, R: int,
                   masked: frozenset = frozenset()) -> None:
    x, topk_idx, weights = ll_inputs(problem, SEED, me, R)
    assert combined_x.dtype == torch.bfloat16 and combined_x.shape == x.shape
    torch.testing.assert_close(combined_x.cpu().float(), expected_combine(problem, x, topk_idx, weights, R, masked),
                               rtol=2 ** -7, atol=1e-5)


def my_ll_inputs(group, problem: Problem):
    return on_user_device(*ll_inputs(problem, SEED, group.rank(), group.size()))


def case_ll_size_hint(group, problem: Problem) -> None:
    R, num_experts = group.size(), num_experts_of(problem, group.size())
    T, H = problem.ll_tokens, problem.ll_hidden
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, R, num_experts)
    assert isinstance(hint, int) and hint > 0
    assert deep_ep.Buffer.get_low_latency_rdma_size_hint(2 * T, H, R, num_experts) >= hint
    buffer = ll_buffer(group, problem)
    buffer.clean_low_latency_buffer(T, H, num_experts)
    x, topk_idx, weights = my_ll_inputs(group, problem)
    packed_recv_x, packed_recv_count, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, T, num_experts,
                                                                                 use_fp8=False)
    check_packed(problem, group.rank(), R, packed_recv_x, packed_recv_count, handle)
    buffer.destroy()


def case_ll_dispatch_bf16(group, problem: Problem) -> None:
    me, R = group.rank(), group.size()
    buffer = ll_buffer(group, problem)
    x, topk_idx, _ = my_ll_inputs(group, problem)
    packed_recv_x, packed_recv_count, handle, event, hook = buffer.low_latency_dispatch(
        x, topk_idx, problem.ll_tokens, num_experts_of(problem, R), use_fp8=False)
    check_packed(problem, me, R, packed_recv_x, packed_recv_count, handle)
    buffer.destroy()


def case_ll_dispatch_fp8(group, problem: Problem, round_scale: bool, use_ue8m0: bool) -> None:
    me, R = group.rank(), group.size()
    buffer = ll_buffer(group, problem)
    x, topk_idx, _ = my_ll_inputs(group, problem)
    packed_recv_x, packed_recv_count, handle, _, _ = buffer.low_latency_dispatch(
        x, topk_idx, problem.ll_tokens, num_experts_of(problem, R), use_fp8=True, round_scale=round_scale,
        use_ue8m0=use_ue8m0)
    check_packed(problem, me, R, packed_recv_x, packed_recv_count, handle, use_fp8=True, round_scale=round_scale,
                 use_ue8m0=use_ue8m0)
    # DeepEP's test dequantises each expert's rows with per_token_cast_back.
    data, scales = packed_recv_x
    for e in range(problem.experts_per_rank):
        num = int(packed_recv_count[e])
        back = deep_ep.utils.per_token_cast_back(data[e], scales[e])[:num]
        assert back.dtype == torch.bfloat16
        assert torch.equal(back.cpu(), dequantize(data[e, :num].cpu(), scales[e, :num].cpu()).to(torch.bfloat16))
    buffer.destroy()


def case_ll_cumulative_stats(group, problem: Problem) -> None:
    me, R, per_rank = group.rank(), group.size(), problem.experts_per_rank
    buffer = ll_buffer(group, problem)
    x, topk_idx, _ = my_ll_inputs(group, problem)
    cumulative_local_expert_recv_stats = torch.zeros((per_rank,), dtype=torch.int)
    dispatch_wait_recv_cost_stats = torch.zeros((R,), dtype=torch.int64)
    for _ in range(2):
        _, packed_recv_count, _, _, _ = buffer.low_latency_dispatch(
            x, topk_idx, problem.ll_tokens, num_experts_of(problem, R),
            cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
            dispatch_wait_recv_cost_stats=dispatch_wait_recv_cost_stats, use_fp8=False)
    tokens, _ = expected_packed(problem, SEED, me, R)
    assert cumulative_local_expert_recv_stats.tolist() == [2 * sum(len(t) for t in tokens[e])
                                                           for e in range(per_rank)]
    assert bool((dispatch_wait_recv_cost_stats >= 0).all())
    buffer.destroy()


def case_ll_recv_hook(group, problem: Problem) -> None:
    """return_recv_hook=True: the call only sends; hook() receives, after other work."""
    me, R = group.rank(), group.size()
    buffer = ll_buffer(group, problem)
    x, topk_idx, weights = my_ll_inputs(group, problem)
    packed_recv_x, packed_recv_count, handle, _, hook = buffer.low_latency_dispatch(
        x, topk_idx, problem.ll_tokens, num_experts_of(problem, R), use_fp8=False, return_recv_hook=True)
    assert callable(hook)
    other_work = torch.randn(64, 64) @ torch.randn(64, 64)   # overlaps the transfer
    hook()
    check_packed(problem, me, R, packed_recv_x, packed_recv_count, handle)
    combined_x, _, hook = buffer.low_latency_combine(run_experts(packed_recv_x, me), topk_idx, weights, handle,
                                                     return_recv_hook=True)
    assert callable(hook)
    other_work = other_work @ other_work
    hook()
    check_combined(problem, combined_x, me, R)
    buffer.destroy()


def case_ll_async_finish(group, problem: Problem) -> None:
    """DeepEP's own test: async_finish=True and event.current_stream_wait(), fp8 there and back."""
    R = group.size()
    buffer = ll_buffer(group, problem)
    x, topk_idx, weights = my_ll_inputs(group, problem)
    packed_recv_x, packed_recv_count, handle, event, hook = buffer.low_latency_dispatch(
        x, topk_idx, problem.ll_tokens, num_experts_of(problem, R), use_fp8=True, async_finish=True)
    event.current_stream_wait()
    data, scales = packed_recv_x
    simulated_gemm_x = torch.stack([deep_ep.utils.per_token_cast_back(data[e], scales[e])
                                    for e in range(problem.experts_per_rank)])
    out = torch.empty((x.size(0), x.size(1)), dtype=torch.bfloat16)
    combined_x, event, hook = buffer.low_latency_combine(simulated_gemm_x, topk_idx, weights, handle,
                                                         async_finish=True, out=out)
    event.current_stream_wait()
    with plain_torch():
        expected = x.cpu().float() * torch.where(topk_idx.cpu() >= 0, weights.cpu(), 0.0).sum(1, keepdim=True)
    assert not bool(torch.isnan(combined_x).any())
    assert calc_diff(combined_x.float(), expected) < 9e-4   # DeepEP's threshold for fp8
    buffer.destroy()


def case_ll_combine(group, problem: Problem, variant: str) -> None:
    """Weighted combine of expert outputs: plain, zero-copy, into out=."""
    me, R = group.rank(), group.size()
    buffer = ll_buffer(group, problem)
    x, topk_idx, weights = my_ll_inputs(group, problem)
    packed_recv_x, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, problem.ll_tokens,
                                                                 num_experts_of(problem, R), use_fp8=False)
    y = run_experts(packed_recv_x, me)
    out = None
    if variant == "zero_copy":
        combine_buffer = buffer.get_next_low_latency_combine_buffer(handle)
        assert combine_buffer.dtype == torch.bfloat16 and combine_buffer.shape == y.shape
        combine_buffer[:, :, :] = y
    if variant == "out":
        out = torch.empty((x.size(0), x.size(1)), dtype=torch.bfloat16)
    combined_x, _, hook = buffer.low_latency_combine(y, topk_idx, weights, handle, zero_copy=variant == "zero_copy",
                                                     out=out)
    if out is not None:
        assert combined_x.data_ptr() == out.data_ptr()
    check_combined(problem, combined_x, me, R)
    buffer.destroy()


def case_ll_combine_wait_stats(group, problem: Problem) -> None:
    me, R = group.rank(), group.size()
    buffer = ll_buffer(group, problem)
    x, topk_idx, weights = my_ll_inputs(group, problem)
    packed_recv_x, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, problem.ll_tokens,
                                                                 num_experts_of(problem, R), use_fp8=False)
    combine_wait_recv_cost_stats = torch.zeros((R,), dtype=torch.int64)
    combined_x, _, _ = buffer.low_latency_combine(run_experts(packed_recv_x, me), topk_idx, weights, handle,
                                                  combine_wait_recv_cost_stats=combine_wait_recv_cost_stats)
    check_combined(problem, combined_x, me, R)
    assert combine_wait_recv_cost_stats.dtype == torch.int64 and bool((combine_wait_recv_cost_stats >= 0).all())
    buffer.destroy()


def case_ll_two_micro_batches(group, problem: Problem) -> None:
    """Two micro-batches in flight (two-batch overlap): both sends issued before either hook."""
    me, R = group.rank(), group.size()
    buffer = ll_buffer(group, problem)
    x, topk_idx, weights = my_ll_inputs(group, problem)
    batches = [(x, topk_idx, weights), (x.flip(0), topk_idx.flip(0), weights.flip(0))]
    sent = [buffer.low_latency_dispatch(bx, bidx, problem.ll_tokens, num_experts_of(problem, R), use_fp8=False,
                                        return_recv_hook=True) for bx, bidx, _ in batches]
    for *_, hook in sent:
        hook()
    check_packed(problem, me, R, sent[0][0], sent[0][1], sent[0][2])
    combines = [buffer.low_latency_combine(run_experts(packed, me), bidx, bw, handle, return_recv_hook=True)
                for (packed, _, handle, _, _), (_, bidx, bw) in zip(sent, batches)]
    for _, _, hook in combines:
        hook()
    check_combined(problem, combines[0][0], me, R)
    check_combined(problem, combines[1][0].flip(0), me, R)
    buffer.destroy()


def case_normal_then_low_latency(group, problem: Problem) -> None:
    """One buffer for both modes (DeepEP's test_intranode with low-latency compatibility)."""
    me, R = group.rank(), group.size()
    num_experts = num_experts_of(problem, R)
    num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(problem.ll_tokens, problem.ll_hidden, R,
                                                                   num_experts)
    buffer = deep_ep.Buffer(group, problem.num_nvl_bytes, num_rdma_bytes, low_latency_mode=True,
                            num_qps_per_rank=problem.experts_per_rank, explicitly_destroy=True)
    round_trip(buffer, group, problem)
    buffer.clean_low_latency_buffer(problem.ll_tokens, problem.ll_hidden, num_experts)
    x, topk_idx, weights = my_ll_inputs(group, problem)
    packed_recv_x, packed_recv_count, handle, _, _ = buffer.low_latency_dispatch(
        x, topk_idx, problem.ll_tokens, num_experts, use_fp8=False)
    check_packed(problem, me, R, packed_recv_x, packed_recv_count, handle)
    combined_x, _, _ = buffer.low_latency_combine(run_experts(packed_recv_x, me), topk_idx, weights, handle)
    check_combined(problem, combined_x, me, R)
    buffer.destroy()


# ------------------------------------------------------------------------------------ shrink mode
def query_mask(buffer: deep_ep.Buffer, num_ranks: int) -> list[int]:
    mask_status = torch.zeros((num_ranks,), dtype=torch.int)
    buffer.low_latency_query_mask_buffer(mask_status)
    return mask_status.tolist()


def case_shrink_mask_buffer(group, problem: Problem) -> None:
    """update / query / clean are local to the rank."""
    R, last = group.size(), group.size() - 1
    buffer = ll_buffer(group, problem, enable_shrink=True)
    assert query_mask(buffer, R) == [0] * R
    buffer.low_latency_update_mask_buffer(last, True)
    assert query_mask(buffer, R) == [0] * last + [1]
    buffer.low_latency_update_mask_buffer(last)   # mask=False unmasks
    assert query_mask(buffer, R) == [0] * R
    buffer.low_latency_update_mask_buffer(0, True)
    buffer.low_latency_update_mask_buffer(last, mask=True)
    assert query_mask(buffer, R) == [1 if rank in (0, last) else 0 for rank in range(R)]
    buffer.low_latency_clean_mask_buffer()
    assert query_mask(buffer, R) == [0] * R
    buffer.destroy()


def partition_masks(me: int, num_ranks: int) -> frozenset:
    """The last rank is cut off: it masks every other rank, and they mask it."""
    last = num_ranks - 1
    return frozenset(range(last)) if me == last else frozenset({last})


def masked_round(buffer: deep_ep.Buffer, group, problem: Problem, masked: frozenset, check: bool) -> None:
    me, R = group.rank(), group.size()
    x, topk_idx, weights = my_ll_inputs(group, problem)
    packed_recv_x, packed_recv_count, handle, _, _ = buffer.low_latency_dispatch(
        x, topk_idx, problem.ll_tokens, num_experts_of(problem, R), use_fp8=False)
    if check:
        check_packed(problem, me, R, packed_recv_x, packed_recv_count, handle, masked=masked)
    combined_x, _, _ = buffer.low_latency_combine(run_experts(packed_recv_x, me), topk_idx, weights, handle)
    if check:
        check_combined(problem, combined_x, me, R, masked=masked)


def case_shrink_masked_ranks(group, problem: Problem) -> None:
    """Masked ranks are neither sent to nor waited for: counts hold nothing from them, combined
    rows lack their experts' contributions."""
    me, R = group.rank(), group.size()
    buffer = ll_buffer(group, problem, enable_shrink=True)
    masked = partition_masks(me, R)
    for rank in masked:
        buffer.low_latency_update_mask_buffer(rank, True)
    assert query_mask(buffer, R) == [int(r in masked) for r in range(R)]
    masked_round(buffer, group, problem, masked, check=True)
    buffer.destroy()


def case_shrink_clean_restores(group, problem: Problem) -> None:
    """After low_latency_clean_mask_buffer every rank takes part again."""
    R = group.size()
    buffer = ll_buffer(group, problem, enable_shrink=True)
    for rank in partition_masks(group.rank(), R):
        buffer.low_latency_update_mask_buffer(rank, True)
    masked_round(buffer, group, problem, partition_masks(group.rank(), R), check=False)
    buffer.low_latency_clean_mask_buffer()
    assert query_mask(buffer, R) == [0] * R
    masked_round(buffer, group, problem, frozenset(), check=True)
    buffer.destroy()


def case_shrink_dead_rank(group, problem: Problem) -> None:
    """DeepEP's failure drill: the last rank stops calling; the others mask it and carry on."""
    me, R = group.rank(), group.size()
    last = R - 1
    buffer = ll_buffer(group, problem, explicitly_destroy=False, enable_shrink=True)
    if me == last:
        return   # "dead": no dispatch, no combine, no destroy
    buffer.low_latency_update_mask_buffer(last, True)
    masked_round(buffer, group, problem, frozenset({last}), check=True)


# ------------------------------------------------------------------------------------ tests
def test_constructor_positional_v1_order(ranks: Ranks) -> None:
    ranks.run(case_constructor_positional)


def test_constructor_keywords_v1(ranks: Ranks) -> None:
    ranks.run(case_constructor_keywords)


def test_static_helpers_and_config(ranks: Ranks) -> None:
    ranks.run(case_static_helpers)


def test_buffer_sized_from_config_hints(ranks: Ranks) -> None:
    if ranks.on_gpu:
        # The NVLink backend stages every received row (no ring buffer yet, issue 10), so a buffer
        # sized by DeepEP's hints holds fewer rows than a large batch brings: the call must say
        # so before moving anything. When staging goes, this fails: drop the branch.
        with pytest.raises(RankFailure, match="make the Buffer with more num_nvl_bytes"):
            ranks.run(case_buffer_sized_from_config_hints)
        return
    ranks.run(case_buffer_sized_from_config_hints)


def test_get_dispatch_layout(ranks: Ranks) -> None:
    ranks.run(case_get_dispatch_layout)


def test_dispatch_bf16_rows_prefix_matrix_and_counts(ranks: Ranks) -> None:
    ranks.run(case_dispatch_bf16)


def test_dispatch_fp8_tuple(ranks: Ranks) -> None:
    ranks.run(case_dispatch_fp8)


@pytest.mark.parametrize("alignment", [4, 128])
def test_dispatch_expert_alignment(ranks: Ranks, alignment: int) -> None:
    ranks.run(case_expert_alignment, alignment)


@pytest.mark.parametrize("use_fp8", [False, True], ids=["bf16", "fp8"])
def test_cached_dispatch(ranks: Ranks, use_fp8: bool) -> None:
    ranks.run(case_cached_dispatch, use_fp8)


def test_num_worst_tokens(ranks: Ranks) -> None:
    ranks.run(case_num_worst_tokens)


def test_dispatch_without_topk(ranks: Ranks) -> None:
    ranks.run(case_dispatch_without_topk)


def test_combine_identity(ranks: Ranks) -> None:
    ranks.run(case_combine_identity)


def test_combine_topk_weights(ranks: Ranks) -> None:
    ranks.run(case_combine_topk_weights)


def test_combine_bias(ranks: Ranks) -> None:
    ranks.run(case_combine_bias)


def test_async_events(ranks: Ranks) -> None:
    ranks.run(case_async)


def test_low_latency_rdma_size_hint(ranks: Ranks) -> None:
    ranks.run(case_ll_size_hint)


def test_low_latency_dispatch_bf16(ranks: Ranks) -> None:
    ranks.run(case_ll_dispatch_bf16)


@pytest.mark.parametrize("round_scale,use_ue8m0", [(False, False), (True, False), (True, True)],
                         ids=["fp8", "round_scale", "ue8m0"])
def test_low_latency_dispatch_fp8(ranks: Ranks, round_scale: bool, use_ue8m0: bool) -> None:
    ranks.run(case_ll_dispatch_fp8, round_scale, use_ue8m0)


def test_low_latency_cumulative_stats(ranks: Ranks) -> None:
    ranks.run(case_ll_cumulative_stats)


def test_low_latency_recv_hook(ranks: Ranks) -> None:
    ranks.run(case_ll_recv_hook)


def test_low_latency_async_finish(ranks: Ranks) -> None:
    ranks.run(case_ll_async_finish)


@pytest.mark.parametrize("variant", ["plain", "zero_copy", "out"])
def test_low_latency_combine(ranks: Ranks, variant: str) -> None:
    ranks.run(case_ll_combine, variant)


def test_low_latency_combine_wait_recv_cost_stats(ranks: Ranks) -> None:
    ranks.run(case_ll_combine_wait_stats)


def test_low_latency_two_micro_batches(ranks: Ranks) -> None:
    if ranks.on_gpu:
        # The NVLink low-latency path allows one pending receive hook per kind for now (issue 11):
        # the second send must say so clearly. When the limit is lifted this fails: drop the branch.
        with pytest.raises(RankFailure, match="one pending receive hook per kind"):
            ranks.run(case_ll_two_micro_batches)
        return
    ranks.run(case_ll_two_micro_batches)


def test_normal_then_low_latency_on_one_buffer(ranks: Ranks) -> None:
    ranks.run(case_normal_then_low_latency)


def test_shrink_mask_buffer_update_query_clean(ranks: Ranks) -> None:
    ranks.run(case_shrink_mask_buffer)


def test_shrink_masked_ranks_skipped(ranks: Ranks) -> None:
    ranks.run(case_shrink_masked_ranks)


def test_shrink_clean_restores_all_ranks(ranks: Ranks) -> None:
    ranks.run(case_shrink_clean_restores)


def test_shrink_dead_rank_not_waited_for(ranks: Ranks) -> None:
    if not ranks.on_gpu:
        pytest.skip("the CPU backend's collectives still need every rank, masked or not; leaving out a rank "
                    "that really stopped is the shrink work of issue 11")
    # Last on purpose: if a masked rank is waited for after all, this hangs until the pool's
    # time-out, which closes the pool.
    ranks.run(case_shrink_dead_rank)
