"""``v2/checks.dispatch_call``'s quick acceptance of the usual fresh dispatch agrees with its full checks.

The usual call (bf16 x, int64 topk_idx, float32 weights or none) is accepted in a few reads;
anything else takes the full checks. Each variant below differs from a good call in one way the
quick test looks at, and must still raise the full checks' InputError, naming what is wrong.
"""

from __future__ import annotations

import pytest
import torch

from tritonep import InputError
from tritonep.v2 import checks

N, H, E, K = 6, 256, 4, 2
CPU = torch.device("cpu")


def _call(x: object, topk_idx: object, topk_weights: object) -> checks.DispatchCall:
    return checks.dispatch_call(x, topk_idx, topk_weights, None, E, None, None, None, None, False, False, 8, 1, 1,
                                CPU)


def _good() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.zeros(N, H, dtype=torch.bfloat16, device=CPU)
    topk_idx = torch.zeros(N, K, dtype=torch.int64, device=CPU)
    return x, topk_idx, torch.zeros(N, K, dtype=torch.float32, device=CPU)


@pytest.mark.parametrize("weights", [True, False])
def test_usual_call_is_accepted_as_given(weights: bool) -> None:
    x, topk_idx, topk_weights = _good()
    call = _call(x, topk_idx, topk_weights if weights else None)
    assert call.x is x and call.scales is None and call.topk_idx is topk_idx
    assert call.topk_weights is (topk_weights if weights else None)
    assert (call.num_experts, call.num_max_tokens_per_rank, call.expert_alignment, call.do_cpu_sync) == (E, 8, 1, True)


VARIANTS = {
    "x on meta": (lambda x, i, w: (x.to("meta"), i, w), "x must be on cpu"),
    "topk_idx on meta": (lambda x, i, w: (x, i.to("meta"), w), "topk_idx must be on cpu"),
    "topk_weights on meta": (lambda x, i, w: (x, i, w.to("meta")), "topk_weights must be on cpu"),
    "x float32": (lambda x, i, w: (x.float(), i, w), "x must have dtype torch.bfloat16"),
    "topk_idx int32": (lambda x, i, w: (x, i.int(), w), "topk_idx must have dtype torch.int64"),
    "x 1-D": (lambda x, i, w: (x[0], i, w), "x must have shape [*, *]"),
    "topk_idx 1-D": (lambda x, i, w: (x, i[:, 0].contiguous(), w), "topk_idx must have shape"),
    "topk_idx no column": (lambda x, i, w: (x, i[:, :0].contiguous(), w[:, :0].contiguous()), "at least one column"),
    "x rows of 8 bytes": (lambda x, i, w: (x[:, :4].contiguous(), i, w), "multiple of 16 bytes"),
    "x no hidden": (lambda x, i, w: (x[:, :0].contiguous(), i, w), "hidden > 0"),
    "topk_idx non-contiguous": (lambda x, i, w: (x, i.t().contiguous().t(), w), "topk_idx must be contiguous"),
    "topk_weights non-contiguous": (lambda x, i, w: (x, i, w.t().contiguous().t()),
                                    "topk_weights must be contiguous"),
    "topk_weights float64": (lambda x, i, w: (x, i, w.double()), "topk_weights must have dtype torch.float32"),
    "topk_weights shape": (lambda x, i, w: (x, i, w[:, :1].contiguous()), "topk_weights must have shape"),
    "topk_weights a list": (lambda x, i, w: (x, i, w.tolist()), "topk_weights must be a torch.Tensor"),
    "topk_idx rows": (lambda x, i, w: (x, i[:3].contiguous(), w[:3].contiguous()), "topk_idx must have shape"),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_each_difference_gets_the_full_checks(name: str) -> None:
    change, message = VARIANTS[name]
    with pytest.raises(InputError, match=message.replace("[", r"\[").replace("*", r"\*")):
        _call(*change(*_good()))
