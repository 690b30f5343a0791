"""Bad inputs to ElasticBuffer raise a clear ``tritonep.InputError`` before any communication.

In-process, on a 1-rank gloo group: while a bad call is made, each buffer's backend is swapped
for a guard that fails the test if any transport method is reached, so "raised before
communicating" is checked, not assumed. Every message must name what was expected and what was
given; the cases assert on both fragments.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from single_rank import NoCommunication, one_rank_group, raises_naming

import tritonep as deep_ep
from tritonep import InputError

FP8 = torch.float8_e4m3fn
N, H, E, K, T = 6, 256, 4, 2, 8
M, PAIRS = 5, 8   # rows the 1-rank dispatch of ctx receives (tokens with an expert), and (token, expert) pairs
MIB2 = 2 << 20


@pytest.fixture(scope="module")
def group():
    yield from one_rank_group("tritonep_v2_errors_")


@dataclass
class Ctx:
    buf: deep_ep.ElasticBuffer            # sized for (T, H, K)
    small: deep_ep.ElasticBuffer          # 2 MiB, no default T
    single: deep_ep.ElasticBuffer         # allow_multiple_reduction=False
    x: torch.Tensor
    topk: torch.Tensor
    weights: torch.Tensor
    handle: deep_ep.EPHandle              # buf's, not expanded
    expanded: deep_ep.EPHandle            # buf's, expanded
    single_expanded: deep_ep.EPHandle     # single's, expanded
    other_handle: deep_ep.EPHandle        # small's

    def fresh(self, **overrides: Any) -> dict:
        kwargs = dict(topk_idx=self.topk, topk_weights=self.weights, num_experts=E)
        kwargs.update(overrides)
        return kwargs


@pytest.fixture(scope="module")
def ctx(group) -> Ctx:
    torch.manual_seed(0)
    buf = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=T, hidden=H, num_topk=K)
    small = deep_ep.ElasticBuffer(group, num_bytes=MIB2)
    single = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=T, hidden=H, num_topk=K,
                                   allow_multiple_reduction=False)
    x = torch.randn(N, H, dtype=torch.float32).to(torch.bfloat16)
    topk = torch.tensor([[0, 1], [2, -1], [-1, -1], [3, 0], [1, 2], [-1, 3]], dtype=torch.int64)
    weights = torch.rand(N, K, dtype=torch.float32)
    handle = buf.dispatch(x, topk_idx=topk, topk_weights=weights, num_experts=E)[3]
    expanded = buf.dispatch(x, topk_idx=topk, num_experts=E, do_expand=True)[3]
    single_expanded = single.dispatch(x, topk_idx=topk, num_experts=E, do_expand=True)[3]
    other_handle = small.dispatch(x, topk_idx=topk, num_experts=E, num_max_tokens_per_rank=T)[3]
    return Ctx(buf, small, single, x, topk, weights, handle, expanded, single_expanded, other_handle)


@pytest.fixture
def guarded(ctx: Ctx):
    buffers = (ctx.buf, ctx.small, ctx.single)
    real = [b.backend for b in buffers]
    for b in buffers:
        b.backend = b._engine.backend = NoCommunication(b.backend)
    yield ctx
    for b, backend in zip(buffers, real):
        b.backend = b._engine.backend = backend


def _rows(c: Ctx) -> torch.Tensor:
    return torch.zeros(c.handle.num_recv_tokens, H, dtype=torch.bfloat16)


Case = tuple[Callable[[Ctx], Any], tuple[str, ...]]

CASES: dict[str, Case] = {
    # ---- dispatch: x
    "x float32": (lambda c: c.buf.dispatch(c.x.float(), **c.fresh()), ("x must have dtype torch.bfloat16",
                                                                       "got torch.float32")),
    "x row of 8 bytes": (lambda c: c.buf.dispatch(c.x[:, :4].contiguous(), **c.fresh()),
                         ("multiple of 16 bytes", "hidden 4")),
    "x non-contiguous": (lambda c: c.buf.dispatch(c.x.t().contiguous().t(), **c.fresh()),
                         ("x must be contiguous",)),
    "fp8 x of 3 parts": (lambda c: c.buf.dispatch((c.x.to(FP8), c.x, c.x), **c.fresh()), ("2-tuple", "got 3")),
    "fp8 scales float16": (
        lambda c: c.buf.dispatch((c.x.to(FP8), torch.ones(N, 2, dtype=torch.float16)), **c.fresh()),
        ("x[1] (scales) must have dtype", "got torch.float16")),
    "fp8 scales rows": (
        lambda c: c.buf.dispatch((c.x.to(FP8), torch.ones(N + 1, 2, dtype=torch.float32)), **c.fresh()),
        ("x[1] (scales) must have shape", f"got [{N + 1}, 2]")),
    # ---- dispatch: routing
    "no topk_idx, no handle": (lambda c: c.buf.dispatch(c.x, num_experts=E), ("needs topk_idx",)),
    "topk_idx int32": (lambda c: c.buf.dispatch(c.x, **c.fresh(topk_idx=c.topk.int())),
                       ("topk_idx must have dtype torch.int64", "got torch.int32")),
    "topk_idx rows": (lambda c: c.buf.dispatch(c.x, **c.fresh(topk_idx=c.topk[:3].contiguous())),
                      ("topk_idx must have shape", "got [3, 2]")),
    "expert id == E": (lambda c: c.buf.dispatch(c.x, **c.fresh(topk_idx=c.topk.clamp(max=E - 1) + 1)),
                       (f"[-1, {E})", f"got values in [0, {E}]")),
    "num_experts missing": (lambda c: c.buf.dispatch(c.x, **c.fresh(num_experts=None)), ("needs num_experts",)),
    "num_experts 0": (lambda c: c.buf.dispatch(c.x, **c.fresh(num_experts=0)),
                      ("num_experts must be a positive int", "got 0")),
    "topk_weights float64": (lambda c: c.buf.dispatch(c.x, **c.fresh(topk_weights=c.weights.double())),
                             ("topk_weights must have dtype torch.float32", "got torch.float64")),
    "topk_weights shape": (lambda c: c.buf.dispatch(c.x, **c.fresh(topk_weights=c.weights[:, :1].contiguous())),
                           ("topk_weights must have shape", "got [6, 1]")),
    "more tokens than T": (lambda c: c.buf.dispatch(c.x, **c.fresh(num_max_tokens_per_rank=4)),
                           (f"x has {N} tokens", "num_max_tokens_per_rank=4")),
    "no T anywhere": (lambda c: c.small.dispatch(c.x, **c.fresh()),
                      ("num_max_tokens_per_rank must be a positive int", "got 0")),
    "buffer too small": (lambda c: c.small.dispatch(c.x, **c.fresh(num_max_tokens_per_rank=4096)),
                         ("needs", "bytes of buffer", f"has {MIB2}")),
    "expert_alignment 0": (lambda c: c.buf.dispatch(c.x, **c.fresh(expert_alignment=0)),
                           ("expert_alignment must be an int >= 1", "got 0")),
    "zero padding without expand": (lambda c: c.buf.dispatch(c.x, **c.fresh(do_zero_padding=True)),
                                    ("do_zero_padding", "do_expand=True")),
    "stats int64": (lambda c: c.buf.dispatch(c.x, **c.fresh(cumulative_local_expert_recv_stats=torch.zeros(
        E, dtype=torch.int64))), ("cumulative_local_expert_recv_stats must have dtype torch.int32", "torch.int64")),
    "stats shape": (lambda c: c.buf.dispatch(c.x, **c.fresh(cumulative_local_expert_recv_stats=torch.zeros(
        E + 1, dtype=torch.int32))), ("cumulative_local_expert_recv_stats must have shape", f"got [{E + 1}]")),
    # ---- dispatch: SMs, QPs, events
    "num_sms negative": (lambda c: c.buf.dispatch(c.x, **c.fresh(num_sms=-2)), ("num_sms must be an int >= 0",
                                                                                "got -2")),
    "num_qps above allocated": (lambda c: c.buf.dispatch(c.x, **c.fresh(num_qps=1000)),
                                ("num_qps must be an int in [0, num_allocated_qps=129]", "got 1000")),
    "previous_event without allocate_on_comm_stream": (
        lambda c: c.buf.dispatch(c.x, **c.fresh(previous_event=deep_ep.ElasticBuffer.capture())),
        ("previous_event needs allocate_on_comm_stream=True",)),
    "previous_event of another kind": (
        lambda c: c.buf.dispatch(c.x, **c.fresh(previous_event=object(), allocate_on_comm_stream=True)),
        ("previous_event must be None or an event", "got object")),
    # ---- cached dispatch
    "cached with topk_idx": (lambda c: c.buf.dispatch(c.x, topk_idx=c.topk, handle=c.handle),
                             ("takes no topk_idx",)),
    "cached with CPU sync": (lambda c: c.buf.dispatch(c.x, handle=c.handle, do_cpu_sync=True),
                             ("cannot do a CPU sync",)),
    "cached with other num_experts": (lambda c: c.buf.dispatch(c.x, handle=c.handle, num_experts=2 * E),
                                      (f"num_experts={2 * E}", f"handle's {E}")),
    "cached with other T": (lambda c: c.buf.dispatch(c.x, handle=c.handle, num_max_tokens_per_rank=2 * T),
                            (f"num_max_tokens_per_rank={2 * T}", f"handle's {T}")),
    "cached with other tokens": (lambda c: c.buf.dispatch(c.x[:2].contiguous(), handle=c.handle),
                                 ("x has 2 tokens", f"made for {N}")),
    "cached expand on a plain handle": (lambda c: c.buf.dispatch(c.x, handle=c.handle, do_expand=True),
                                        ("do_expand=True needs a handle from an expanded dispatch",)),
    "handle of another buffer": (lambda c: c.buf.dispatch(c.x, handle=c.other_handle), ("another ElasticBuffer",)),
    "handle of another kind": (lambda c: c.buf.dispatch(c.x, handle=(1, 2)), ("EPHandle", "got tuple")),
    # ---- combine
    "combine: x rows": (lambda c: c.buf.combine(c.x, c.handle),
                        (f"x must have shape [{M}, *]", f"got [{N}, {H}]")),
    "combine: x float32": (lambda c: c.buf.combine(_rows(c).float(), c.handle),
                           ("x must have dtype torch.bfloat16", "got torch.float32")),
    "combine: 1-D weights, not expanded": (
        lambda c: c.buf.combine(_rows(c), c.handle, topk_weights=torch.zeros(M, dtype=torch.float32)),
        (f"topk_weights must have shape [{M}, {K}]", f"got [{M}]")),
    "combine: 2-D weights, expanded": (
        lambda c: c.buf.combine(torch.zeros(c.expanded.num_expanded_tokens, H, dtype=torch.bfloat16), c.expanded,
                                topk_weights=torch.zeros(PAIRS, K, dtype=torch.float32)),
        (f"topk_weights must have shape [{PAIRS}]", f"got [{PAIRS}, {K}]")),
    "combine: bias shape": (lambda c: c.buf.combine(_rows(c), c.handle, bias=torch.zeros(N + 1, H,
                                                                                         dtype=torch.bfloat16)),
                            ("bias[0] must have shape", f"got [{N + 1}, {H}]")),
    "combine: bias of 3": (lambda c: c.buf.combine(_rows(c), c.handle, bias=(None, None, None)),
                           ("bias must be None, a tensor or a 2-tuple",)),
    "combine: handle of another buffer": (lambda c: c.buf.combine(_rows(c), c.other_handle),
                                          ("another ElasticBuffer",)),
    "combine: expanded without multiple reduction": (
        lambda c: c.single.combine(torch.zeros(c.single_expanded.num_expanded_tokens, H, dtype=torch.bfloat16),
                                   c.single_expanded),
        ("allow_multiple_reduction=False", "allow_multiple_reduction=True")),
    "combine: previous_event without allocate_on_comm_stream": (
        lambda c: c.buf.combine(_rows(c), c.handle, previous_event=deep_ep.ElasticBuffer.capture()),
        ("previous_event needs allocate_on_comm_stream=True",)),
    # ---- helpers
    "num_scaleout_topk": (lambda c: c.buf.get_theoretical_num_sms(E, K, num_scaleout_topk=1),
                          ("num_scaleout_topk is reserved", "got 1")),
    "model num_experts": (lambda c: c.buf.get_theoretical_num_sms(0, K), ("num_experts must be a positive int",)),
    "qps of 0 SMs": (lambda c: c.buf.get_theoretical_num_qps(0), ("num_sms must be a positive int", "got 0")),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_raises_before_communication(guarded: Ctx, name: str) -> None:
    raises_naming(name, *CASES[name], guarded)


CONSTRUCTOR_CASES: dict[str, tuple[dict, tuple[str, ...]]] = {
    "num_bytes not 2 MiB": (dict(num_bytes=MIB2 + 1), ("positive multiple of 2 MiB", f"got {MIB2 + 1}")),
    "num_bytes 0": (dict(num_bytes=0), ("positive multiple of 2 MiB", "got 0")),
    "num_bytes negative": (dict(num_bytes=-MIB2), ("buffer sizes must be >= 0", f"num_bytes={-MIB2}")),
    "no sizes": (dict(), ("num_max_tokens_per_rank must be a positive int to size the buffer", "got 0")),
    "no hidden": (dict(num_max_tokens_per_rank=8), ("hidden must be a positive int", "got 0")),
    "cpu bytes without num_bytes": (dict(num_cpu_bytes=MIB2, num_max_tokens_per_rank=8, hidden=H),
                                    ("num_cpu_bytes needs num_bytes",)),
    "cpu bytes not 2 MiB": (dict(num_bytes=2 * MIB2, num_cpu_bytes=7), ("num_cpu_bytes must be a multiple of 2 MiB",
                                                                         "got 7")),
    "cpu bytes above num_bytes": (dict(num_bytes=MIB2, num_cpu_bytes=2 * MIB2), ("exceeds num_bytes",)),
    "negative QPs": (dict(num_bytes=MIB2, num_allocated_qps=-1), ("num_allocated_qps must be an int >= 0", "got -1")),
    "timeout 0": (dict(num_bytes=MIB2, num_gpu_timeout_secs=0), ("num_gpu_timeout_secs must be positive", "got 0")),
}


@pytest.mark.parametrize("name", list(CONSTRUCTOR_CASES))
def test_bad_constructor_arguments(group, name: str) -> None:
    kwargs, fragments = CONSTRUCTOR_CASES[name]
    with pytest.raises(InputError) as info:
        deep_ep.ElasticBuffer(group, **kwargs)
    for fragment in fragments:
        assert fragment in str(info.value), f"{name}: {info.value!r} lacks {fragment!r}"


def test_group_must_be_a_process_group() -> None:
    with pytest.raises(InputError, match="group must be a torch.distributed ProcessGroup, got NoneType"):
        deep_ep.ElasticBuffer(None, num_bytes=MIB2)
    with pytest.raises(InputError, match="got str"):
        deep_ep.get_physical_domain_size("world")
