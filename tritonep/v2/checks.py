"""The checks of DeepEP V2's dispatch and combine: each turns a call's arguments into a record, or raises.

Every check runs before any communication, on the rank that made the call, so a bad call raises
InputError there instead of leaving its peers waiting (the shared pieces are in ``core/checks.py``).
Where V2 has a rule, the rule is V2's (a row is a multiple of 16 bytes; ``previous_event``
needs ``allocate_on_comm_stream``; a cached dispatch takes no ``topk_idx`` and no CPU sync).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tritonep.core import checks
from tritonep.core.checks import FP8_DTYPE, InputError, describe, is_int, require
from tritonep.core.event import EventOverlap
from tritonep.v2.handle import EPHandle


@dataclass
class DispatchCall:
    """A checked V2 dispatch."""

    x: torch.Tensor                       # [N, H] bf16 or fp8 e4m3
    scales: torch.Tensor | None           # [N, S] float32 or int32 (packed UE8M0), any strides
    topk_idx: torch.Tensor                # [N, K] int64: the call's, or the cached handle's
    topk_weights: torch.Tensor | None     # [N, K] float32
    handle: EPHandle | None               # cached dispatch
    num_experts: int
    num_max_tokens_per_rank: int
    expert_alignment: int
    do_cpu_sync: bool
    do_expand: bool


@dataclass
class CombineCall:
    """A checked V2 combine."""

    x: torch.Tensor                       # bf16 [rows or expanded rows, H]
    handle: EPHandle
    topk_weights: torch.Tensor | None     # float32 [rows, K], or [expanded rows] when expanded
    bias: tuple[torch.Tensor | None, torch.Tensor | None]


def check_handle(handle: object, buffer_id: int) -> EPHandle:
    if not isinstance(handle, EPHandle):
        raise InputError(f"handle must be an EPHandle from this ElasticBuffer's dispatch, got {type(handle).__name__}")
    require(handle._state.buffer_id == buffer_id,
            "this EPHandle was made by another ElasticBuffer; pass it only to the buffer that dispatched")
    return handle


def check_stream_args(previous_event: object, previous_event_before_epilogue: object,
                      allocate_on_comm_stream: object) -> None:
    if previous_event is None and previous_event_before_epilogue is None:   # the usual call: nothing to check
        return
    for name, event in (("previous_event", previous_event),
                        ("previous_event_before_epilogue", previous_event_before_epilogue)):
        require(event is None or isinstance(event, EventOverlap),
                f"{name} must be None or an event from ElasticBuffer.capture(), got {type(event).__name__}")
    if previous_event is not None:
        require(bool(allocate_on_comm_stream),
                "previous_event needs allocate_on_comm_stream=True (the call's work, and its outputs, then wait "
                "for that event on the communication stream)")


def check_sms_and_qps(num_sms: object, num_qps: object, num_allocated_qps: int) -> None:
    if type(num_sms) is int and num_sms >= 0 and type(num_qps) is int and 0 <= num_qps <= num_allocated_qps:
        return   # plain ints in range: the checks below would pass
    require(is_int(num_sms) and num_sms >= 0, f"num_sms must be an int >= 0 (0: automatic), got {num_sms!r}")
    require(is_int(num_qps) and 0 <= num_qps <= num_allocated_qps,
            f"num_qps must be an int in [0, num_allocated_qps={num_allocated_qps}] (0: automatic), got {num_qps!r}")


def _check_row_bytes(name: str, tensor: torch.Tensor) -> None:
    # (Messages are formatted only on failure: an f-string passed to ``require`` costs every call.)
    if tensor.shape[1] <= 0:
        raise InputError(f"{name} must have hidden > 0, got shape {list(tensor.shape)}")
    row_bytes = tensor.shape[1] * tensor.element_size()
    if row_bytes % 16:
        raise InputError(f"{name}: a row must be a multiple of 16 bytes (hidden {tensor.shape[1]} of "
                         f"{tensor.dtype} is {row_bytes} bytes)")


def split_x(x: object, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """dispatch's ``x``: bf16 [N, H], or (fp8 e4m3 [N, H], scales [N, S] float32 or packed int32)."""
    if isinstance(x, tuple):
        require(len(x) == 2, f"an fp8 x must be a 2-tuple (data, scales), got {len(x)} elements")
        data, scales = x
        checks.check_tensor("x[0] (fp8 data)", data, dtype=FP8_DTYPE, shape=(None, None), device=device)
        require(isinstance(scales, torch.Tensor) and scales.dim() == 2,
                f"x[1] (scales) must be a 2-D tensor, got {describe(scales)}")
        checks.check_tensor("x[1] (scales)", scales, dtype=(torch.float32, torch.int32),
                            shape=(data.shape[0], None), device=device, contiguous=False)
        _check_row_bytes("x", data)
        return data, scales
    checks.check_tensor("x", x, dtype=torch.bfloat16, shape=(None, None), device=device)
    assert isinstance(x, torch.Tensor)
    _check_row_bytes("x", x)
    return x, None


def _fresh_tensors_fit(x: object, topk_idx: object, topk_weights: object, on_gpu: bool) -> bool:
    """The usual fresh dispatch's tensors pass every check below: contiguous bf16 x [N, H] with
    16-byte rows, int64 topk_idx [N, K > 0] and float32 topk_weights [N, K] or None, all on the
    buffer's kind of device. A few reads in one function; a miss runs the full checks, which
    say what is wrong."""
    if type(x) is not torch.Tensor or type(topk_idx) is not torch.Tensor:
        return False
    if not ((x.is_cuda and topk_idx.is_cuda) if on_gpu else (x.is_cpu and topk_idx.is_cpu)):
        return False
    if (x.dtype is not torch.bfloat16 or topk_idx.dtype is not torch.int64 or x.dim() != 2 or topk_idx.dim() != 2
            or not x.is_contiguous() or not topk_idx.is_contiguous()):
        return False
    num_tokens, hidden = x.shape
    if topk_idx.shape[0] != num_tokens or topk_idx.shape[1] <= 0 or hidden <= 0 or hidden % 8:   # 8 bf16: 16 bytes
        return False
    return topk_weights is None or (
        type(topk_weights) is torch.Tensor and topk_weights.dtype is torch.float32
        and topk_weights.shape == topk_idx.shape and (topk_weights.is_cuda if on_gpu else topk_weights.is_cpu)
        and topk_weights.is_contiguous())


def _positive_int(value: object) -> bool:
    """A Python or numpy int > 0 (not a bool); a plain int is told in one read."""
    return (type(value) is int or is_int(value)) and value > 0   # type: ignore[operator]


def _matches(name: str, given: object, cached: int) -> int:
    if not (given is None or given == cached):
        raise InputError(f"cached dispatch: {name}={given!r} differs from the handle's {cached}")
    return cached


def dispatch_call(x: object, topk_idx: object, topk_weights: object, stats: object, num_experts: object,
                  num_max_tokens_per_rank: object, expert_alignment: object, handle: object, do_cpu_sync: object,
                  do_expand: object, do_zero_padding: object, default_max_tokens: int, num_ranks: int, buffer_id: int,
                  device: torch.device) -> DispatchCall:
    """A fresh dispatch (``topk_idx`` given) or a cached one (``handle`` given), checked."""
    fits = handle is None and _fresh_tensors_fit(x, topk_idx, topk_weights, device.type == "cuda")
    data, scales = (x, None) if fits else split_x(x, device)   # type: ignore[assignment]
    num_tokens = data.shape[0]
    if do_zero_padding and not do_expand:
        raise InputError("do_zero_padding zeroes the expanded layout's gaps: it needs do_expand=True")
    if handle is not None:
        handle = check_handle(handle, buffer_id)
        require(topk_idx is None, "cached dispatch (handle given) takes no topk_idx: the handle's is reused")
        require(not do_cpu_sync, "cached dispatch cannot do a CPU sync: the handle holds the counts")
        require(not do_expand or handle.do_expand,
                "do_expand=True needs a handle from an expanded dispatch (do_expand=True); this one has none of the "
                "expanded layout's slots")
        num_experts = _matches("num_experts", num_experts, handle.num_experts)
        num_max_tokens_per_rank = _matches("num_max_tokens_per_rank", num_max_tokens_per_rank,
                                           handle.num_max_tokens_per_rank)
        expert_alignment = _matches("expert_alignment", expert_alignment, handle.expert_alignment)
        topk_idx = handle.topk_idx
        if num_tokens != topk_idx.shape[0]:
            raise InputError(f"cached dispatch: x has {num_tokens} tokens but the handle was made for "
                             f"{topk_idx.shape[0]}")
        do_cpu_sync = False
    else:
        if not fits:
            require(topk_idx is not None, "dispatch needs topk_idx (or a handle from an earlier dispatch)")
            checks.check_tensor("topk_idx", topk_idx, dtype=torch.int64, shape=(num_tokens, None), device=device)
            assert isinstance(topk_idx, torch.Tensor)
            require(topk_idx.shape[1] > 0, "topk_idx must have at least one column")
        require(num_experts is not None, "dispatch without a handle needs num_experts")
        checks.check_num_experts(num_experts, num_ranks)   # type: ignore[arg-type]
        checks.check_expert_ids("topk_idx", topk_idx, num_experts)   # type: ignore[arg-type]
        num_max_tokens_per_rank = default_max_tokens if num_max_tokens_per_rank is None else num_max_tokens_per_rank
        if not _positive_int(num_max_tokens_per_rank):
            raise InputError(f"num_max_tokens_per_rank must be a positive int (give it here or to the ElasticBuffer), "
                             f"got {num_max_tokens_per_rank!r}")
        expert_alignment = 1 if expert_alignment is None else expert_alignment
        if not _positive_int(expert_alignment):
            raise InputError(f"expert_alignment must be an int >= 1, got {expert_alignment!r}")
        do_cpu_sync = True if do_cpu_sync is None else bool(do_cpu_sync)
    if num_tokens > num_max_tokens_per_rank:   # type: ignore[operator]
        raise InputError(f"x has {num_tokens} tokens, more than num_max_tokens_per_rank={num_max_tokens_per_rank}")
    if topk_weights is not None and not fits:
        checks.check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=tuple(topk_idx.shape),
                            device=device)
    if stats is not None:
        checks.check_tensor("cumulative_local_expert_recv_stats", stats, dtype=torch.int32,
                            shape=(num_experts // num_ranks,), device=device)   # type: ignore[operator]
    return DispatchCall(data, scales, topk_idx, topk_weights, handle, num_experts,  # type: ignore[arg-type]
                        num_max_tokens_per_rank, expert_alignment, do_cpu_sync, bool(do_expand))  # type: ignore[arg-type]


def split_bias(bias: object) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """0, 1 or 2 bias tensors: None, a tensor, or a 2-tuple (of tensors or None)."""
    if bias is None or isinstance(bias, torch.Tensor):
        return bias, None
    require(isinstance(bias, tuple) and len(bias) == 2,
            f"bias must be None, a tensor or a 2-tuple of tensors, got {describe(bias)}")
    return bias   # type: ignore[return-value]


def combine_call(x: object, handle: object, topk_weights: object, bias: object, allow_multiple_reduction: bool,
                 buffer_id: int, device: torch.device) -> CombineCall:
    handle = check_handle(handle, buffer_id)
    expanded = handle.do_expand
    rows = handle.num_expanded_tokens if expanded else handle._state.rows
    checks.check_tensor("x", x, dtype=torch.bfloat16, shape=(rows, None), device=device)
    assert isinstance(x, torch.Tensor)
    _check_row_bytes("x", x)
    if expanded and not allow_multiple_reduction:
        raise InputError("combine of an expanded dispatch with allow_multiple_reduction=False: the engines combine "
                         "one row per token and rank, so a token's expert rows are summed (float32, rounded to "
                         "bf16) on their rank before the cross-rank sum; one single reduction cannot be honoured. "
                         "Make the ElasticBuffer with allow_multiple_reduction=True, or dispatch without do_expand")
    if topk_weights is not None:
        shape = (rows,) if expanded else (rows, handle.topk_idx.shape[1])
        checks.check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=shape, device=device)
    biases = split_bias(bias)
    num_tokens = handle.topk_idx.shape[0]
    for index, item in enumerate(biases):
        if item is not None:
            checks.check_tensor(f"bias[{index}]", item, dtype=torch.bfloat16, shape=(num_tokens, x.shape[1]),
                                device=device)
    return CombineCall(x, handle, topk_weights, biases)   # type: ignore[arg-type]


def check_buffer_room(needed: int, available: int, num_max_tokens_per_rank: int, hidden: int, num_topk: int) -> None:
    require(needed <= available,
            f"a dispatch of up to num_max_tokens_per_rank={num_max_tokens_per_rank} tokens per rank with hidden "
            f"{hidden} and top-{num_topk} needs {needed} bytes of buffer "
            f"(ElasticBuffer.get_buffer_size_hint), this ElasticBuffer has {available}")
