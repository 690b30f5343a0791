"""Bad inputs raise a clear ``tritonep.InputError`` before any communication starts.

Most cases run in-process on a 1-rank gloo group. While a bad call is made, the Buffer's
backend is swapped for a guard that fails the test if any transport method is reached, so
"raised before communicating" is checked, not assumed. Every message must name what was
expected and what was given; the tests assert on both fragments.

Cases that need several ranks (E not divisible by R; ranks that disagree on sizes) run on a
2-rank ``RankPool``: every rank must raise, none may hang or return corrupted data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from single_rank import NoCommunication, one_rank_group, raises_naming
from torch_defaults import default_dtype, pool_options

import tritonep as deep_ep
from tritonep import InputError
from tritonep.rank_pool import RankFailure, RankPool

FP8 = torch.float8_e4m3fn
N, H, E, K, T = 6, 256, 4, 2, 8
M = 5  # rows the 1-rank dispatch of ctx receives: the tokens with at least one expert


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def group():
    yield from one_rank_group("tritonep_errors_")


@dataclass
class Ctx:
    buf: deep_ep.Buffer           # normal mode only
    ll: deep_ep.Buffer            # low_latency_mode=True, sized for (T, H, E)
    other: deep_ep.Buffer         # another normal Buffer on the same group
    other_ll: deep_ep.Buffer      # another low-latency Buffer
    ll_zero: deep_ep.Buffer       # low_latency_mode=True with num_rdma_bytes=0
    x: torch.Tensor
    topk: torch.Tensor
    weights: torch.Tensor
    layout: dict
    handle: Any                   # normal handle made by buf
    recv_x: torch.Tensor
    ll_handle_own: Any            # low-latency handle made by ll
    ll_normal_handle: Any         # normal handle made by ll
    other_handle: Any             # normal handle made by other
    other_ll_handle: Any          # low-latency handle made by other_ll

    def dispatch_kwargs(self, **overrides: Any) -> dict:
        kwargs = dict(self.layout, topk_idx=self.topk, topk_weights=self.weights)
        kwargs.update(overrides)
        return kwargs

    def ll_combine_x(self) -> torch.Tensor:
        return torch.zeros(E, T, H, dtype=torch.bfloat16)


def _layout(buffer: deep_ep.Buffer, topk: torch.Tensor) -> dict:
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, E)
    return dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)


def _normal_dispatch(buffer: deep_ep.Buffer, x, topk, weights):
    layout = _layout(buffer, topk)
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, topk_idx=topk, topk_weights=weights, **layout)
    return recv_x, handle


@pytest.fixture(scope="module")
def ctx(group) -> Ctx:
    torch.manual_seed(0)
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, 1, E)
    buf = deep_ep.Buffer(group, num_nvl_bytes=1 << 20)
    ll = deep_ep.Buffer(group, num_nvl_bytes=1 << 20, num_rdma_bytes=rdma, low_latency_mode=True)
    other = deep_ep.Buffer(group, num_nvl_bytes=1 << 20)
    other_ll = deep_ep.Buffer(group, num_nvl_bytes=1 << 20, num_rdma_bytes=rdma, low_latency_mode=True)
    x = torch.randn(N, H, dtype=torch.float32).to(torch.bfloat16)
    topk = torch.tensor([[0, 1], [2, -1], [-1, -1], [3, 0], [1, 2], [-1, 3]], dtype=torch.int64)
    weights = torch.rand(N, K, dtype=torch.float32)
    recv_x, handle = _normal_dispatch(buf, x, topk, weights)
    _, ll_normal_handle = _normal_dispatch(ll, x, topk, weights)
    _, other_handle = _normal_dispatch(other, x, topk, weights)
    ll_handle_own = ll.low_latency_dispatch(x, topk, T, E, use_fp8=False)[2]
    other_ll_handle = other_ll.low_latency_dispatch(x, topk, T, E, use_fp8=False)[2]
    ll_zero = deep_ep.Buffer(group, num_nvl_bytes=1 << 20, num_rdma_bytes=0, low_latency_mode=True)
    assert recv_x.shape == (M, H)
    return Ctx(buf=buf, ll=ll, other=other, other_ll=other_ll, ll_zero=ll_zero, x=x, topk=topk,
               weights=weights, layout=_layout(buf, topk), handle=handle, recv_x=recv_x,
               ll_handle_own=ll_handle_own, ll_normal_handle=ll_normal_handle, other_handle=other_handle,
               other_ll_handle=other_ll_handle)


@pytest.fixture
def guarded(ctx: Ctx):
    """ctx with every Buffer's backend replaced by the NoCommunication guard."""
    buffers = (ctx.buf, ctx.ll, ctx.other, ctx.other_ll, ctx.ll_zero)
    real = [b.backend for b in buffers]
    for b in buffers:
        b.backend = NoCommunication(b.backend)
    yield ctx
    for b, backend in zip(buffers, real):
        b.backend = backend


# ----------------------------------------------------------------------------- the cases
def _fp8(rows: int, hidden: int) -> torch.Tensor:
    return torch.randn(rows, hidden, dtype=torch.float32).to(FP8)


def _noncontiguous_x() -> torch.Tensor:
    x = torch.randn(N, 2 * H, dtype=torch.float32).to(torch.bfloat16)[:, ::2]
    assert x.shape == (N, H) and not x.is_contiguous()
    return x


def _ll_bytes() -> int:
    return deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, 1, E)


Case = tuple[Callable[[Ctx], Any], tuple[str, ...]]

CASES: dict[str, Case] = {
    # ---- get_dispatch_layout
    "layout: topk_idx int32": (
        lambda c: c.buf.get_dispatch_layout(c.topk.int(), E),
        ("topk_idx must have dtype torch.int64", "got torch.int32")),
    "layout: topk_idx 1-D": (
        lambda c: c.buf.get_dispatch_layout(c.topk[:, 0].contiguous(), E),
        ("topk_idx must have shape [*, *]", f"got [{N}]")),
    "layout: topk_idx non-contiguous": (
        lambda c: c.buf.get_dispatch_layout(c.topk.t().contiguous().t(), E),
        ("topk_idx must be contiguous", "strides")),
    "layout: expert id == E": (
        lambda c: c.buf.get_dispatch_layout(torch.tensor([[0, E]]), E),
        (f"topk_idx entries must be in [-1, {E})", f"got values in [0, {E}]")),
    "layout: expert id -2": (
        lambda c: c.buf.get_dispatch_layout(torch.tensor([[-2, 1]]), E),
        (f"[-1, {E})", "got values in [-2, 1]")),
    "layout: num_experts 0": (
        lambda c: c.buf.get_dispatch_layout(c.topk, 0),
        ("num_experts must be a positive int", "got 0")),
    "layout: allocate_on_comm_stream without previous_event": (
        lambda c: c.buf.get_dispatch_layout(c.topk, E, async_finish=True, allocate_on_comm_stream=True),
        ("allocate_on_comm_stream=True requires previous_event",)),
    # ---- dispatch: x
    "dispatch: x float32": (
        lambda c: c.buf.dispatch(c.x.float(), **c.dispatch_kwargs()),
        ("x must have dtype torch.bfloat16", "got torch.float32")),
    "dispatch: x 3-D": (
        lambda c: c.buf.dispatch(c.x.view(N, 16, 16), **c.dispatch_kwargs()),
        ("x must have shape [*, *]", f"got [{N}, 16, 16]")),
    "dispatch: x non-contiguous": (
        lambda c: c.buf.dispatch(_noncontiguous_x(), **c.dispatch_kwargs()),
        ("x must be contiguous", "strides")),
    "dispatch: x on another device": (
        lambda c: c.buf.dispatch(torch.empty(N, H, dtype=torch.bfloat16, device="meta"), **c.dispatch_kwargs()),
        ("x must be on cpu", "got meta")),
    "layout: topk_idx on another device": (
        lambda c: c.buf.get_dispatch_layout(torch.empty(N, K, dtype=torch.int64, device="meta"), E),
        ("topk_idx must be on cpu", "got meta")),
    "dispatch: x a list": (
        lambda c: c.buf.dispatch([c.x], **c.dispatch_kwargs()),
        ("x must be a torch.Tensor", "got list")),
    # ---- dispatch: fp8 tuple
    "dispatch: fp8 hidden not a multiple of 128": (
        lambda c: c.buf.dispatch((_fp8(N, 200), torch.ones(N, 2, dtype=torch.float32)), **c.dispatch_kwargs()),
        ("hidden to be a multiple of 128", "got 200")),
    "dispatch: fp8 scales too many columns": (
        lambda c: c.buf.dispatch((_fp8(N, H), torch.ones(N, H // 128 + 1, dtype=torch.float32)), **c.dispatch_kwargs()),
        (f"x[1] (scales) must have shape [{N}, {H // 128}]", f"got [{N}, {H // 128 + 1}]")),
    "dispatch: fp8 scales wrong rows": (
        lambda c: c.buf.dispatch((_fp8(N, H), torch.ones(N - 1, H // 128, dtype=torch.float32)), **c.dispatch_kwargs()),
        (f"x[1] (scales) must have shape [{N}, {H // 128}]", f"got [{N - 1}, {H // 128}]")),
    "dispatch: fp8 scales 1-D": (
        lambda c: c.buf.dispatch((_fp8(N, H), torch.ones(N, dtype=torch.float32)), **c.dispatch_kwargs()),
        ("x[1] (scales) must be a 2-D tensor", f"shape=({N},)")),
    "dispatch: fp8 scales bf16": (
        lambda c: c.buf.dispatch((_fp8(N, H), torch.ones(N, H // 128, dtype=torch.bfloat16)),
                                 **c.dispatch_kwargs()),
        ("float32 or packed int32", "got torch.bfloat16")),
    "dispatch: packed int32 scales wrong columns": (
        lambda c: c.buf.dispatch((_fp8(N, H), torch.ones(N, 2, dtype=torch.int32)), **c.dispatch_kwargs()),
        (f"x[1] (scales) must have shape [{N}, 1]", f"got [{N}, 2]")),
    "dispatch: fp8 data bf16": (
        lambda c: c.buf.dispatch((c.x, torch.ones(N, H // 128, dtype=torch.float32)), **c.dispatch_kwargs()),
        ("x[0] (fp8 data) must have dtype torch.float8_e4m3fn", "got torch.bfloat16")),
    "dispatch: x 3-tuple": (
        lambda c: c.buf.dispatch((_fp8(N, H), torch.ones(N, 2, dtype=torch.float32),
                                  torch.ones(N, 2, dtype=torch.float32)), **c.dispatch_kwargs()),
        ("2-tuple", "got 3 elements")),
    # ---- dispatch: top-k
    "dispatch: topk_idx int32": (
        lambda c: c.buf.dispatch(c.x, **c.dispatch_kwargs(topk_idx=c.topk.int())),
        ("topk_idx must have dtype torch.int64", "got torch.int32")),
    "dispatch: topk_idx wrong rows": (
        lambda c: c.buf.dispatch(c.x, **c.dispatch_kwargs(topk_idx=c.topk[:-1], topk_weights=c.weights[:-1])),
        (f"topk_idx must have shape [{N}, *]", f"got [{N - 1}, {K}]")),
    "dispatch: expert id == E": (
        lambda c: c.buf.dispatch(c.x, **c.dispatch_kwargs(topk_idx=torch.full((N, K), E))),
        (f"[-1, {E})", f"got values in [{E}, {E}]")),
    "dispatch: expert id -5": (
        lambda c: c.buf.dispatch(c.x, **c.dispatch_kwargs(topk_idx=torch.full((N, K), -5))),
        (f"[-1, {E})", "got values in [-5, -5]")),
    "dispatch: topk_weights bf16": (
        lambda c: c.buf.dispatch(c.x, **c.dispatch_kwargs(topk_weights=c.weights.bfloat16())),
        ("topk_weights must have dtype torch.float32", "got torch.bfloat16")),
    "dispatch: topk_weights K mismatch": (
        lambda c: c.buf.dispatch(c.x, **c.dispatch_kwargs(topk_weights=torch.rand(N, K + 1, dtype=torch.float32))),
        (f"topk_weights must have shape [{N}, {K}]", f"got [{N}, {K + 1}]")),
    "dispatch: topk_weights rows mismatch": (
        lambda c: c.buf.dispatch(c.x, **c.dispatch_kwargs(topk_weights=torch.rand(N + 1, K, dtype=torch.float32))),
        (f"topk_weights must have shape [{N}, {K}]", f"got [{N + 1}, {K}]")),
    "dispatch: topk_idx without topk_weights": (
        lambda c: c.buf.dispatch(c.x, **c.dispatch_kwargs(topk_weights=None)),
        ("topk_idx was given without topk_weights",)),
    "dispatch: topk_weights without topk_idx": (
        lambda c: c.buf.dispatch(c.x, **c.dispatch_kwargs(topk_idx=None)),
        ("topk_weights was given without topk_idx",)),
    # ---- dispatch: layout tensors
    "dispatch: is_token_in_rank int32": (
        lambda c: c.buf.dispatch(c.x, **c.dispatch_kwargs(
            is_token_in_rank=c.layout["is_token_in_rank"].int())),
        ("is_token_in_rank must have dtype torch.bool", "got torch.int32")),
    "dispatch: is_token_in_rank wrong shape": (
        lambda c: c.buf.dispatch(c.x, **c.dispatch_kwargs(
            is_token_in_rank=torch.ones(N, 2, dtype=torch.bool))),
        (f"is_token_in_rank must have shape [{N}, 1]", f"got [{N}, 2]")),
    "dispatch: num_tokens_per_rank int64": (
        lambda c: c.buf.dispatch(c.x, **c.dispatch_kwargs(
            num_tokens_per_rank=c.layout["num_tokens_per_rank"].long())),
        ("num_tokens_per_rank must have dtype torch.int32", "got torch.int64")),
    "dispatch: num_tokens_per_rank wrong shape": (
        lambda c: c.buf.dispatch(c.x, **c.dispatch_kwargs(
            num_tokens_per_rank=torch.zeros(2, dtype=torch.int32))),
        ("num_tokens_per_rank must have shape [1]", "got [2]")),
    "dispatch: num_tokens_per_expert int64": (
        lambda c: c.buf.dispatch(c.x, **c.dispatch_kwargs(
            num_tokens_per_expert=c.layout["num_tokens_per_expert"].long())),
        ("num_tokens_per_expert must have dtype torch.int32", "got torch.int64")),
    "dispatch: num_tokens_per_expert 2-D": (
        lambda c: c.buf.dispatch(c.x, **c.dispatch_kwargs(
            num_tokens_per_expert=torch.zeros(2, 2, dtype=torch.int32))),
        ("num_tokens_per_expert must have shape [*]", "got [2, 2]")),
    "dispatch: num_tokens_per_rdma_rank given": (
        lambda c: c.buf.dispatch(c.x, num_tokens_per_rdma_rank=torch.zeros(1, dtype=torch.int32),
                                 **c.dispatch_kwargs()),
        ("num_tokens_per_rdma_rank must be None",)),
    "dispatch: no layout and no handle": (
        lambda c: c.buf.dispatch(c.x, topk_idx=c.topk, topk_weights=c.weights),
        ("needs num_tokens_per_rank and is_token_in_rank",)),
    "dispatch: num_worst_tokens negative": (
        lambda c: c.buf.dispatch(c.x, num_worst_tokens=-1, **c.dispatch_kwargs()),
        ("num_worst_tokens must be an int >= 0", "got -1")),
    "dispatch: expert_alignment 0": (
        lambda c: c.buf.dispatch(c.x, expert_alignment=0, **c.dispatch_kwargs()),
        ("expert_alignment must be an int >= 1", "got 0")),
    "dispatch: allocate_on_comm_stream without previous_event": (
        lambda c: c.buf.dispatch(c.x, async_finish=True, allocate_on_comm_stream=True, **c.dispatch_kwargs()),
        ("allocate_on_comm_stream=True requires previous_event",)),
    "dispatch: allocate_on_comm_stream without async_finish": (
        lambda c: c.buf.dispatch(c.x, previous_event=deep_ep.Buffer.capture(), allocate_on_comm_stream=True,
                                 **c.dispatch_kwargs()),
        ("allocate_on_comm_stream=True requires previous_event and async_finish=True",)),
    # ---- cached dispatch
    "cached dispatch: given topk_idx": (
        lambda c: c.buf.dispatch(c.x, handle=c.handle, topk_idx=c.topk),
        ("cached dispatch (handle given) takes no layout, topk_idx or topk_weights",)),
    "cached dispatch: given topk_weights": (
        lambda c: c.buf.dispatch(c.x, handle=c.handle, topk_weights=c.weights),
        ("cached dispatch (handle given) takes no layout, topk_idx or topk_weights",)),
    "cached dispatch: given is_token_in_rank": (
        lambda c: c.buf.dispatch(c.x, handle=c.handle, is_token_in_rank=c.layout["is_token_in_rank"]),
        ("cached dispatch (handle given) takes no layout",)),
    "cached dispatch: wrong token count": (
        lambda c: c.buf.dispatch(c.x[:-1].contiguous(), handle=c.handle),
        (f"x has {N - 1} tokens", f"made for {N}")),
    "cached dispatch: handle from another Buffer": (
        lambda c: c.buf.dispatch(c.x, handle=c.other_handle),
        ("handle was made by another Buffer",)),
    "cached dispatch: low-latency handle": (
        lambda c: c.ll.dispatch(c.x, handle=c.ll_handle_own),
        ("handle must come from", "got LowLatencyHandle")),
    "cached dispatch: not a handle": (
        lambda c: c.buf.dispatch(c.x, handle=tuple(c.handle)),
        ("handle must come from", "got tuple")),
    # ---- combine
    "combine: x wrong row count": (
        lambda c: c.buf.combine(torch.zeros(c.recv_x.shape[0] + 1, H, dtype=torch.bfloat16), c.handle),
        (f"x must have shape [{M}, *]", f"got [{M + 1}, {H}]")),
    "combine: x float32": (
        lambda c: c.buf.combine(c.recv_x.float(), c.handle),
        ("x must have dtype torch.bfloat16", "got torch.float32")),
    "combine: x non-contiguous": (
        lambda c: c.buf.combine(torch.zeros(M, 2 * H, dtype=torch.bfloat16)[:, ::2], c.handle),
        ("x must be contiguous",)),
    "combine: topk_weights wrong rows": (
        lambda c: c.buf.combine(c.recv_x, c.handle, topk_weights=torch.rand(M + 2, K, dtype=torch.float32)),
        (f"topk_weights must have shape [{M}, *]", f"got [{M + 2}, {K}]")),
    "combine: topk_weights bf16": (
        lambda c: c.buf.combine(c.recv_x, c.handle, topk_weights=torch.rand(M, K, dtype=torch.float32).bfloat16()),
        ("topk_weights must have dtype torch.float32", "got torch.bfloat16")),
    "combine: bias wrong hidden": (
        lambda c: c.buf.combine(c.recv_x, c.handle, bias=torch.zeros(N, H // 2, dtype=torch.bfloat16)),
        (f"bias[0] must have shape [{N}, {H}]", f"got [{N}, {H // 2}]")),
    "combine: bias wrong rows": (
        lambda c: c.buf.combine(c.recv_x, c.handle, bias=torch.zeros(N + 1, H, dtype=torch.bfloat16)),
        (f"bias[0] must have shape [{N}, {H}]", f"got [{N + 1}, {H}]")),
    "combine: second bias wrong shape": (
        lambda c: c.buf.combine(c.recv_x, c.handle, bias=(torch.zeros(N, H, dtype=torch.bfloat16),
                                                           torch.zeros(1, H, dtype=torch.bfloat16))),
        (f"bias[1] must have shape [{N}, {H}]", f"got [1, {H}]")),
    "combine: bias float32": (
        lambda c: c.buf.combine(c.recv_x, c.handle, bias=torch.zeros(N, H, dtype=torch.float32)),
        ("bias[0] must have dtype torch.bfloat16", "got torch.float32")),
    "combine: bias 3-tuple": (
        lambda c: c.buf.combine(c.recv_x, c.handle, bias=(None, None, None)),
        ("bias must be a tensor or a 2-tuple", "got 3 elements")),
    "combine: handle from another Buffer": (
        lambda c: c.buf.combine(c.recv_x, c.other_handle),
        ("handle was made by another Buffer",)),
    "combine: low-latency handle": (
        lambda c: c.ll.combine(c.recv_x, c.ll_handle_own),
        ("handle must come from", "got LowLatencyHandle")),
    "combine: not a handle": (
        lambda c: c.buf.combine(c.recv_x, None),
        ("handle must come from", "got NoneType")),
    "combine: allocate_on_comm_stream without previous_event": (
        lambda c: c.buf.combine(c.recv_x, c.handle, async_finish=True, allocate_on_comm_stream=True),
        ("allocate_on_comm_stream=True requires previous_event",)),
    # ---- low_latency_dispatch
    "ll dispatch: buffer without low_latency_mode": (
        lambda c: c.buf.low_latency_dispatch(c.x, c.topk, T, E),
        ("low_latency_dispatch needs a Buffer made with low_latency_mode=True",)),
    "ll dispatch: N > T": (
        lambda c: c.ll.low_latency_dispatch(c.x, c.topk, N - 1, E),
        (f"x has {N} tokens", f"more than num_max_dispatch_tokens_per_rank={N - 1}")),
    "ll dispatch: K > 11": (
        lambda c: c.ll.low_latency_dispatch(c.x, torch.full((N, 12), -1), T, E),
        ("top-k <= 11", "got 12")),
    "ll dispatch: use_ue8m0 without round_scale": (
        lambda c: c.ll.low_latency_dispatch(c.x, c.topk, T, E, use_fp8=True, use_ue8m0=True),
        ("use_ue8m0 needs", "round_scale=True")),
    "ll dispatch: use_ue8m0 without use_fp8": (
        lambda c: c.ll.low_latency_dispatch(c.x, c.topk, T, E, use_fp8=False, round_scale=True,
                                            use_ue8m0=True),
        ("use_ue8m0 needs use_fp8=True",)),
    "ll dispatch: use_ue8m0 with hidden not a multiple of 512": (
        lambda c: c.ll.low_latency_dispatch(c.x, c.topk, T, E, round_scale=True, use_ue8m0=True),
        ("multiple of 512", f"got {H}")),
    "ll dispatch: fp8 hidden not a multiple of 128": (
        lambda c: c.ll.low_latency_dispatch(torch.zeros(N, 200, dtype=torch.bfloat16), c.topk, T, E),
        ("multiple of 128", "got 200")),
    "ll dispatch: num_rdma_bytes too small": (
        lambda c: c.ll.low_latency_dispatch(c.x, c.topk, 64 * T, E, use_fp8=False),
        ("needs num_rdma_bytes >=", f"this Buffer has {_ll_bytes()}")),
    "ll dispatch: num_rdma_bytes 0": (
        lambda c: c.ll_zero.low_latency_dispatch(c.x, c.topk, T, E, use_fp8=False),
        ("needs num_rdma_bytes >=", "this Buffer has 0")),
    "ll dispatch: T zero": (
        lambda c: c.ll.low_latency_dispatch(c.x[:0], c.topk[:0], 0, E),
        ("num_max_dispatch_tokens_per_rank must be a positive int", "got 0")),
    "ll dispatch: x float32": (
        lambda c: c.ll.low_latency_dispatch(c.x.float(), c.topk, T, E),
        ("x must have dtype torch.bfloat16", "got torch.float32")),
    "ll dispatch: x non-contiguous": (
        lambda c: c.ll.low_latency_dispatch(_noncontiguous_x(), c.topk, T, E),
        ("x must be contiguous",)),
    "ll dispatch: topk_idx int32": (
        lambda c: c.ll.low_latency_dispatch(c.x, c.topk.int(), T, E),
        ("topk_idx must have dtype torch.int64", "got torch.int32")),
    "ll dispatch: topk_idx wrong rows": (
        lambda c: c.ll.low_latency_dispatch(c.x, c.topk[:-1], T, E),
        (f"topk_idx must have shape [{N}, *]", f"got [{N - 1}, {K}]")),
    "ll dispatch: expert id == E": (
        lambda c: c.ll.low_latency_dispatch(c.x, torch.full((N, K), E), T, E),
        (f"[-1, {E})", f"got values in [{E}, {E}]")),
    "ll dispatch: num_experts 0": (
        lambda c: c.ll.low_latency_dispatch(c.x, c.topk, T, 0),
        ("num_experts must be a positive int", "got 0")),
    "ll dispatch: async_finish with return_recv_hook": (
        lambda c: c.ll.low_latency_dispatch(c.x, c.topk, T, E, async_finish=True, return_recv_hook=True),
        ("async_finish and return_recv_hook cannot both be set",)),
    "ll dispatch: recv stats int64": (
        lambda c: c.ll.low_latency_dispatch(c.x, c.topk, T, E,
                                            cumulative_local_expert_recv_stats=torch.zeros(
                                                E, dtype=torch.int64)),
        ("cumulative_local_expert_recv_stats must have dtype torch.int32", "got torch.int64")),
    "ll dispatch: recv stats wrong length": (
        lambda c: c.ll.low_latency_dispatch(c.x, c.topk, T, E,
                                            cumulative_local_expert_recv_stats=torch.zeros(
                                                E + 1, dtype=torch.int32)),
        (f"cumulative_local_expert_recv_stats must have shape [{E}]", f"got [{E + 1}]")),
    "ll dispatch: wait stats int32": (
        lambda c: c.ll.low_latency_dispatch(c.x, c.topk, T, E,
                                            dispatch_wait_recv_cost_stats=torch.zeros(1, dtype=torch.int32)),
        ("dispatch_wait_recv_cost_stats must have dtype torch.int64", "got torch.int32")),
    # ---- low_latency_combine
    "ll combine: buffer without low_latency_mode": (
        lambda c: c.buf.low_latency_combine(c.ll_combine_x(), c.topk, c.weights, c.ll_handle_own),
        ("low_latency_combine needs a Buffer made with low_latency_mode=True",)),
    "ll combine: handle from another Buffer": (
        lambda c: c.ll.low_latency_combine(c.ll_combine_x(), c.topk, c.weights, c.other_ll_handle),
        ("handle was made by another Buffer",)),
    "ll combine: normal-mode handle": (
        lambda c: c.ll.low_latency_combine(c.ll_combine_x(), c.topk, c.weights, c.ll_normal_handle),
        ("handle must come from", "low_latency_dispatch, got DispatchHandle")),
    "ll combine: x wrong shape": (
        lambda c: c.ll.low_latency_combine(torch.zeros(E, T + 1, H, dtype=torch.bfloat16), c.topk, c.weights,
                                           c.ll_handle_own),
        (f"x must have shape [{E}, {T}, {H}]", f"got [{E}, {T + 1}, {H}]")),
    "ll combine: x float32": (
        lambda c: c.ll.low_latency_combine(torch.zeros(E, T, H, dtype=torch.float32), c.topk, c.weights,
                                           c.ll_handle_own),
        ("x must have dtype torch.bfloat16", "got torch.float32")),
    "ll combine: topk_weights shape mismatch": (
        lambda c: c.ll.low_latency_combine(c.ll_combine_x(), c.topk, torch.rand(N, K + 1, dtype=torch.float32),
                                           c.ll_handle_own),
        (f"topk_weights must have shape [{N}, {K}]", f"got [{N}, {K + 1}]")),
    "ll combine: topk_weights bf16": (
        lambda c: c.ll.low_latency_combine(c.ll_combine_x(), c.topk, c.weights.bfloat16(), c.ll_handle_own),
        ("topk_weights must have dtype torch.float32", "got torch.bfloat16")),
    "ll combine: more tokens than T": (
        lambda c: c.ll.low_latency_combine(c.ll_combine_x(), torch.full((T + 1, K), -1),
                                           torch.rand(T + 1, K, dtype=torch.float32), c.ll_handle_own),
        (f"topk_idx has {T + 1} tokens", f"more than T={T}")),
    "ll combine: expert id == E": (
        lambda c: c.ll.low_latency_combine(c.ll_combine_x(), torch.full((N, K), E), c.weights,
                                           c.ll_handle_own),
        (f"[-1, {E})", f"got values in [{E}, {E}]")),
    "ll combine: out wrong shape": (
        lambda c: c.ll.low_latency_combine(c.ll_combine_x(), c.topk, c.weights, c.ll_handle_own,
                                           out=torch.zeros(N + 1, H, dtype=torch.bfloat16)),
        (f"out must have shape [{N}, {H}]", f"got [{N + 1}, {H}]")),
    "ll combine: async_finish with return_recv_hook": (
        lambda c: c.ll.low_latency_combine(c.ll_combine_x(), c.topk, c.weights, c.ll_handle_own,
                                           async_finish=True, return_recv_hook=True),
        ("async_finish and return_recv_hook cannot both be set",)),
    # ---- other low-latency entry points
    "next combine buffer: normal-mode handle": (
        lambda c: c.ll.get_next_low_latency_combine_buffer(c.ll_normal_handle),
        ("handle must come from", "low_latency_dispatch, got DispatchHandle")),
    "next combine buffer: handle from another Buffer": (
        lambda c: c.ll.get_next_low_latency_combine_buffer(c.other_ll_handle),
        ("handle was made by another Buffer",)),
    "next combine buffer: buffer without low_latency_mode": (
        lambda c: c.buf.get_next_low_latency_combine_buffer(c.ll_handle_own),
        ("low_latency_mode=True",)),
    "clean_low_latency_buffer: buffer without low_latency_mode": (
        lambda c: c.buf.clean_low_latency_buffer(T, H, E),
        ("clean_low_latency_buffer needs low_latency_mode=True",)),
    "clean_low_latency_buffer: sizes beyond num_rdma_bytes": (
        lambda c: c.ll.clean_low_latency_buffer(64 * T, H, E),
        ("needs num_rdma_bytes >=", "this Buffer has")),
    # ---- misc
    "destroy without explicitly_destroy": (
        lambda c: c.buf.destroy(),
        ("destroy() is only for buffers made with explicitly_destroy=True",)),
    "local buffer view larger than the buffer": (
        lambda c: c.buf.get_local_buffer_tensor(torch.bfloat16, (1 << 20,)),
        (f"needs {2 << 20} bytes", f"the buffer has {1 << 20}")),
    "local buffer offset outside": (
        lambda c: c.buf.get_local_buffer_tensor(torch.uint8, offset=(1 << 20) + 1),
        (f"offset {(1 << 20) + 1} is outside the {1 << 20}-byte buffer",)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_raises_before_communication(guarded: Ctx, name: str) -> None:
    raises_naming(name, *CASES[name], guarded)


# ----------------------------------------------------------------------------- not per call
def test_input_error_is_a_value_error() -> None:
    assert issubclass(InputError, ValueError)
    assert deep_ep.InputError is InputError


@pytest.mark.parametrize("value", [3, 0, -2, 7])
def test_set_num_sms_rejects_odd_or_non_positive(value: int) -> None:
    before = deep_ep.Buffer.num_sms
    with pytest.raises(InputError) as info:
        deep_ep.Buffer.set_num_sms(value)
    assert "num_sms must be a positive even number" in str(info.value)
    assert f"got {value}" in str(info.value)
    assert deep_ep.Buffer.num_sms == before


def test_config_rejects_non_positive_num_sms() -> None:
    with pytest.raises(ValueError, match=r"num_sms must be positive, got 0"):
        deep_ep.Config(num_sms=0)


def test_in_process_cases_follow_the_default_dtype_asked_for(group) -> None:
    assert torch.get_default_dtype() == (default_dtype() or torch.float32)


def test_buffer_rejects_negative_sizes(group) -> None:
    with pytest.raises(InputError) as info:
        deep_ep.Buffer(group, num_nvl_bytes=-1)
    assert "buffer sizes must be >= 0" in str(info.value) and "num_nvl_bytes=-1" in str(info.value)
    with pytest.raises(InputError, match=r"num_rdma_bytes=-5"):
        deep_ep.Buffer(group, num_rdma_bytes=-5, low_latency_mode=True)


def test_destroyed_buffer_rejects_every_call(group) -> None:
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, 1, E)
    buffer = deep_ep.Buffer(group, num_nvl_bytes=1 << 20, num_rdma_bytes=rdma, low_latency_mode=True,
                            explicitly_destroy=True)
    x = torch.randn(N, H, dtype=torch.float32).to(torch.bfloat16)
    topk = torch.tensor([[0, 1]] * N)
    _, handle = _normal_dispatch(buffer, x, topk, torch.rand(N, K, dtype=torch.float32))
    buffer.destroy()
    buffer.backend = NoCommunication(buffer.backend)
    calls = [
        lambda: buffer.get_dispatch_layout(topk, E),
        lambda: buffer.dispatch(x, handle=handle),
        lambda: buffer.combine(x, handle),
        lambda: buffer.low_latency_dispatch(x, topk, T, E),
        lambda: buffer.get_local_buffer_tensor(torch.uint8),
        lambda: buffer.destroy(),
    ]
    for call in calls:
        with pytest.raises(InputError, match="this Buffer was destroyed"):
            call()


def test_low_latency_combine_before_the_recv_hook(ctx: Ctx) -> None:
    """A hooked dispatch is not received until hook() runs: combining before that must raise."""
    _, _, handle, _, hook = ctx.ll.low_latency_dispatch(ctx.x, ctx.topk, T, E, use_fp8=False,
                                                       return_recv_hook=True)
    with pytest.raises(InputError) as info:
        ctx.ll.low_latency_combine(ctx.ll_combine_x(), ctx.topk, ctx.weights, handle)
    assert "recv hook" in str(info.value) and "not received" in str(info.value)
    hook()  # the receive still completes afterwards
    ctx.ll.low_latency_combine(ctx.ll_combine_x(), ctx.topk, ctx.weights, handle)


def test_low_latency_combine_with_other_topk_than_dispatched(ctx: Ctx) -> None:
    _, _, handle, _, _ = ctx.ll.low_latency_dispatch(ctx.x, ctx.topk, T, E, use_fp8=False)
    fewer = ctx.topk.clone()
    fewer[0, 0] = -1
    with pytest.raises(InputError) as info:
        ctx.ll.low_latency_combine(ctx.ll_combine_x(), fewer, ctx.weights, handle)
    assert "topk_idx" in str(info.value) and "dispatch of this handle sent" in str(info.value)


# ----------------------------------------------------------------------------- several ranks
MISMATCH_TIMEOUT_S = 20.0


def _ping(group) -> int:
    value = torch.ones(1, dtype=torch.float32)
    dist.all_reduce(value, group=group)
    return int(value)


@pytest.fixture(scope="module")
def pair():
    """A 2-rank pool that is replaced whenever a case leaves it hung or broken."""
    state: dict[str, RankPool] = {}

    def healthy() -> RankPool:
        pool = state.get("pool")
        if pool is not None and pool._processes:
            try:
                if pool.run(_ping) == [2, 2]:
                    return pool
            except Exception:  # noqa: BLE001 - a broken pool is simply replaced
                pass
            pool.close(force=True)
        state["pool"] = RankPool(2, timeout=MISMATCH_TIMEOUT_S, **pool_options())
        return state["pool"]

    yield healthy
    if "pool" in state:
        state["pool"].close(force=True)


def _inputs(rank: int, hidden: int = H, num_topk: int = K, num_experts: int = E, tokens: int = N):
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, hidden, generator=generator, dtype=torch.float32, device="cpu").to(torch.bfloat16)
    topk = torch.stack([torch.randperm(num_experts, generator=generator, device="cpu")[:num_topk]
                        for _ in range(tokens)])
    return x, topk, torch.rand(tokens, num_topk, generator=generator, dtype=torch.float32, device="cpu")


def _dispatch(buffer, x, topk, weights, num_experts=E, **kwargs):
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, num_experts)
    return buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                           num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=weights, **kwargs)


def _ll_buffer(group, hidden=2 * H, tokens=2 * T, num_experts=2 * E):
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(tokens, hidden, group.size(), num_experts)
    return deep_ep.Buffer(group, num_nvl_bytes=1 << 20, num_rdma_bytes=rdma, low_latency_mode=True)


def _experts_not_divisible_layout(group, rank):
    buffer = deep_ep.Buffer(group, num_nvl_bytes=1 << 20)
    return buffer.get_dispatch_layout(torch.zeros(N, K, dtype=torch.int64), 3)


def _experts_not_divisible_dispatch(group, rank):
    buffer = deep_ep.Buffer(group, num_nvl_bytes=1 << 20)
    x, _, weights = _inputs(rank)
    return buffer.dispatch(x, num_tokens_per_rank=torch.zeros(2, dtype=torch.int32),
                           is_token_in_rank=torch.zeros(N, 2, dtype=torch.bool),
                           num_tokens_per_expert=torch.zeros(3, dtype=torch.int32),
                           topk_idx=torch.zeros(N, K, dtype=torch.int64), topk_weights=weights)


def _experts_not_divisible_ll(group, rank):
    buffer = _ll_buffer(group)
    x, _, _ = _inputs(rank)
    return buffer.low_latency_dispatch(x, torch.zeros(N, K, dtype=torch.int64), T, 3)


def _hidden_differs(group, rank):
    buffer = deep_ep.Buffer(group, num_nvl_bytes=1 << 20)
    return _dispatch(buffer, *_inputs(rank, hidden=H * (rank + 1)))


def _topk_differs(group, rank):
    buffer = deep_ep.Buffer(group, num_nvl_bytes=1 << 20)
    return _dispatch(buffer, *_inputs(rank, num_topk=K + rank))


def _num_experts_differs(group, rank):
    buffer = deep_ep.Buffer(group, num_nvl_bytes=1 << 20)
    x, topk, weights = _inputs(rank)
    return _dispatch(buffer, x, topk, weights, num_experts=E * (rank + 1))


def _fp8_on_one_rank(group, rank):
    buffer = deep_ep.Buffer(group, num_nvl_bytes=1 << 20)
    x, topk, weights = _inputs(rank)
    if rank == 1:
        x = (x.to(FP8), torch.ones(N, H // 128, dtype=torch.float32))
    return _dispatch(buffer, x, topk, weights)


def _num_worst_tokens_too_small(group, rank):
    buffer = deep_ep.Buffer(group, num_nvl_bytes=1 << 20)
    x, _, weights = _inputs(rank)
    topk = torch.tensor([[0, E // 2]] * N)  # every token goes to both ranks: each receives 2N rows
    return _dispatch(buffer, x, topk, weights, num_worst_tokens=N)


def _v2_max_tokens_differ(group, rank):
    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=2 * N, hidden=H, num_topk=K)
    x, topk, weights = _inputs(rank)
    return buffer.dispatch(x, topk_idx=topk, topk_weights=weights, num_experts=E, do_cpu_sync=False,
                           num_max_tokens_per_rank=N + rank)


def _cached_hidden_differs(group, rank):
    buffer = deep_ep.Buffer(group, num_nvl_bytes=1 << 20)
    x, topk, weights = _inputs(rank)
    handle = _dispatch(buffer, x, topk, weights)[4]
    return buffer.dispatch(_inputs(rank, hidden=H * (rank + 1))[0], handle=handle)


def _cached_fp8_on_one_rank(group, rank):
    buffer = deep_ep.Buffer(group, num_nvl_bytes=1 << 20)
    x, topk, weights = _inputs(rank)
    handle = _dispatch(buffer, x, topk, weights)[4]
    if rank == 1:
        x = (x.to(FP8), torch.ones(N, H // 128, dtype=torch.float32))
    return buffer.dispatch(x, handle=handle)


def _combine_hidden_differs(group, rank):
    buffer = deep_ep.Buffer(group, num_nvl_bytes=1 << 20)
    x, topk, weights = _inputs(rank)
    recv_x, _, _, _, handle, _ = _dispatch(buffer, x, topk, weights)
    return buffer.combine(torch.zeros(recv_x.shape[0], H * (rank + 1), dtype=torch.bfloat16), handle)


def _combine_weights_on_one_rank(group, rank):
    buffer = deep_ep.Buffer(group, num_nvl_bytes=1 << 20)
    x, topk, weights = _inputs(rank)
    recv_x, _, recv_w, _, handle, _ = _dispatch(buffer, x, topk, weights)
    return buffer.combine(recv_x, handle, topk_weights=recv_w if rank == 0 else None)


def _ll_tokens_differ(group, rank):
    x, topk, _ = _inputs(rank)
    return _ll_buffer(group).low_latency_dispatch(x, topk, T + rank, E, use_fp8=False)


def _ll_hidden_differs(group, rank):
    x, topk, _ = _inputs(rank, hidden=H * (rank + 1))
    return _ll_buffer(group).low_latency_dispatch(x, topk, T, E, use_fp8=False)


def _ll_num_experts_differs(group, rank):
    x, topk, _ = _inputs(rank)
    return _ll_buffer(group).low_latency_dispatch(x, topk, T, E * (rank + 1), use_fp8=False)


def _ll_fp8_on_one_rank(group, rank):
    x, topk, _ = _inputs(rank)
    return _ll_buffer(group).low_latency_dispatch(x, topk, T, E, use_fp8=rank == 1)


def _ll_combine_other_topk_on_one_rank(group, rank):
    buffer = _ll_buffer(group)
    x, topk, weights = _inputs(rank)
    _, _, handle, _, _ = buffer.low_latency_dispatch(x, topk, T, E, use_fp8=False)
    if rank == 1:
        topk = topk.clone()
        topk[0, 0] = -1  # one (token, expert) pair fewer than this rank dispatched
    y = torch.zeros(E // 2, 2 * T, H, dtype=torch.bfloat16)
    return buffer.low_latency_combine(y, topk, weights, handle)


# scenario -> fragments every rank's InputError message must hold
MISMATCHES: dict[str, tuple[Callable, tuple[str, ...]]] = {
    "E not divisible by R: get_dispatch_layout": (
        _experts_not_divisible_layout, ("num_experts (3) must be divisible by the number of ranks (2)",)),
    "E not divisible by R: dispatch": (
        _experts_not_divisible_dispatch, ("num_experts (3) must be divisible by the number of ranks (2)",)),
    "E not divisible by R: low_latency_dispatch": (
        _experts_not_divisible_ll, ("num_experts (3) must be divisible by the number of ranks (2)",)),
    "dispatch: hidden differs": (_hidden_differs, ("hidden", f"rank 0: {H}", f"rank 1: {2 * H}")),
    "dispatch: top-k differs": (_topk_differs, ("top-k", f"rank 0: {K}", f"rank 1: {K + 1}")),
    "dispatch: num_experts differs": (
        _num_experts_differs, ("num_experts", f"rank 0: {E}", f"rank 1: {2 * E}")),
    "dispatch: bf16 on one rank, fp8 on the other": (_fp8_on_one_rank, ("dtype",)),
    "dispatch: num_worst_tokens below the received count": (
        _num_worst_tokens_too_small, (f"num_worst_tokens={N}", f"receives {2 * N} tokens")),
    "V2 dispatch without CPU sync: num_max_tokens_per_rank differs": (
        _v2_max_tokens_differ, ("num_max_tokens_per_rank", f"rank 0: {N}", f"rank 1: {N + 1}")),
    "cached dispatch: hidden differs": (_cached_hidden_differs, ("hidden",)),
    "cached dispatch: bf16 on one rank, fp8 on the other": (_cached_fp8_on_one_rank, ("dtype",)),
    "combine: hidden differs": (_combine_hidden_differs, ("hidden",)),
    "combine: topk_weights on one rank only": (_combine_weights_on_one_rank, ("topk_weights",)),
    "low_latency_dispatch: T differs": (
        _ll_tokens_differ, ("num_max_dispatch_tokens_per_rank", f"rank 0: {T}", f"rank 1: {T + 1}")),
    "low_latency_dispatch: hidden differs": (
        _ll_hidden_differs, ("hidden", f"rank 0: {H}", f"rank 1: {2 * H}")),
    "low_latency_dispatch: num_experts differs": (
        _ll_num_experts_differs, ("num_experts", f"rank 0: {E}", f"rank 1: {2 * E}")),
    "low_latency_dispatch: use_fp8 differs": (_ll_fp8_on_one_rank, ("use_fp8",)),
    "low_latency_combine: topk_idx differs from the dispatch on one rank": (
        _ll_combine_other_topk_on_one_rank, ("topk_idx",)),
}


def _outcome(group, scenario: str) -> tuple[str, str]:
    """Run one scenario on this rank; report how it ended instead of raising."""
    try:
        MISMATCHES[scenario][0](group, group.rank())
    except Exception as error:  # noqa: BLE001 - the test inspects every kind of failure
        return type(error).__name__, str(error)
    return "returned", "no exception"


@pytest.mark.parametrize("scenario", list(MISMATCHES))
def test_ranks_that_disagree_all_raise(pair, scenario: str) -> None:
    """Every rank raises InputError naming the disagreement; none hangs or returns data."""
    pool = pair()
    try:
        outcomes = pool.run(_outcome, scenario)
    except RankFailure as failure:  # a hang: the pool was killed after MISMATCH_TIMEOUT_S
        pytest.fail(f"{scenario}: ranks hung instead of raising ({failure})")
    except (EOFError, OSError) as error:  # a rank process died, e.g. gloo aborting on a size mismatch
        pytest.fail(f"{scenario}: a rank process died instead of raising ({type(error).__name__}; its stderr "
                    "shows why, typically gloo's 'Received data size doesn't match expected size')")
    fragments = MISMATCHES[scenario][1]
    for rank, (kind, message) in enumerate(outcomes):
        assert kind == "InputError", f"{scenario}: rank {rank} ended with {kind}: {message}"
        for fragment in fragments:
            assert fragment in message, f"{scenario}: rank {rank} message {message!r} lacks {fragment!r}"
