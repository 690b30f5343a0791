"""Input validation shared by the front ends: every message says what was expected and what was given.

All checks run before any communication starts, so a bad call raises on the rank that made
it instead of leaving its peers waiting. Checks that need values (expert ids in range) cost
one reduction on the device; they are skipped nowhere, because silent corruption is worse.
"""

from __future__ import annotations

import operator

import torch

FP8_DTYPE = torch.float8_e4m3fn


class InputError(ValueError):
    """A call to ``Buffer`` was given arguments that do not fit the contract."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise InputError(message)


def is_int(value: object) -> bool:
    """Python and numpy integers (anything ``operator.index`` takes), not bools."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True


def byte_count(name: str, value: object) -> int:
    require(is_int(value), f"{name} must be an int, got {value!r}")
    count = operator.index(value)  # type: ignore[arg-type]
    require(count >= 0, f"buffer sizes must be >= 0, got {name}={count}")
    return count


def fits(tensor: object, dtype: torch.dtype, shape: tuple[int, ...], on_gpu: bool) -> bool:
    """A contiguous tensor of this dtype and exact shape on the Buffer's kind of device: the
    per-call fast path of the checks (a miss runs the full checks, which say why)."""
    return (isinstance(tensor, torch.Tensor) and tensor.dtype == dtype and tensor.shape == shape
            and tensor.is_cuda == on_gpu and tensor.is_contiguous())


def describe(tensor: object) -> str:
    if isinstance(tensor, torch.Tensor):
        return f"tensor(shape={tuple(tensor.shape)}, dtype={tensor.dtype}, device={tensor.device})"
    return type(tensor).__name__


def check_tensor(
    name: str,
    tensor: object,
    *,
    dtype: torch.dtype | tuple[torch.dtype, ...],
    shape: tuple[int | None, ...],
    device: torch.device,
    contiguous: bool = True,
) -> torch.Tensor:
    """``shape`` entries of None match any size."""
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    # Fast path first: a valid call pays for no message formatting (this runs several times per
    # call, so it avoids what costs: ``tensor.device`` builds an object, ``all()`` a generator).
    if (isinstance(tensor, torch.Tensor) and tensor.dtype in dtypes and tensor.dim() == len(shape)
            and (tensor.is_cuda if device.type == "cuda" else tensor.device.type == device.type)
            and (not contiguous or tensor.is_contiguous())):
        for wanted, size in zip(shape, tensor.shape):
            if wanted is not None and wanted != size:
                break
        else:
            return tensor
    require(isinstance(tensor, torch.Tensor), f"{name} must be a torch.Tensor, got {describe(tensor)}")
    assert isinstance(tensor, torch.Tensor)
    require(tensor.dtype in dtypes,
            f"{name} must have dtype {' or '.join(map(str, dtypes))}, got {tensor.dtype}")
    expected = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
    require(tensor.dim() == len(shape) and all(s is None or s == d for s, d in zip(shape, tensor.shape)),
            f"{name} must have shape {expected}, got {list(tensor.shape)}")
    require(tensor.device.type == device.type,
            f"{name} must be on {device.type} like this Buffer's process group, got {tensor.device}")
    if contiguous:
        require(tensor.is_contiguous(), f"{name} must be contiguous (got strides {tensor.stride()})")
    return tensor


def check_expert_ids(name: str, topk_idx: torch.Tensor, num_experts: int) -> None:
    # On the GPU, reading the range back would cost a host sync on every call (and CUDA-graph
    # capture forbids it): there the NVLink layout kernel counts out-of-range ids instead and
    # dispatch raises on every rank before any row moves.
    if topk_idx.numel() == 0 or topk_idx.is_cuda:
        return
    low, high = torch.aminmax(topk_idx)   # one pass for both ends
    low, high = int(low), int(high)
    if low < -1 or high >= num_experts:
        raise InputError(f"{name} entries must be in [-1, {num_experts}) (-1 = no expert), got values in "
                         f"[{low}, {high}]")


def check_num_experts(num_experts: int, num_ranks: int) -> None:
    if not (isinstance(num_experts, int) and num_experts > 0):
        raise InputError(f"num_experts must be a positive int, got {num_experts!r}")
    if num_experts % num_ranks:
        raise InputError(f"num_experts ({num_experts}) must be divisible by the number of ranks ({num_ranks})")


def split_x(x: object, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` of dispatch: bf16 [N, H], or (fp8 e4m3 [N, H], scales). Returns (data, scales)."""
    if isinstance(x, tuple):
        require(len(x) == 2, f"an fp8 x must be a 2-tuple (data, scales), got {len(x)} elements")
        data, scales = x
        check_tensor("x[0] (fp8 data)", data, dtype=FP8_DTYPE, shape=(None, None), device=device)
        hidden = data.shape[1]
        require(hidden % 128 == 0, f"fp8 dispatch needs hidden to be a multiple of 128, got {hidden}")
        require(isinstance(scales, torch.Tensor) and scales.dim() == 2,
                f"x[1] (scales) must be a 2-D tensor, got {describe(scales)}")
        if scales.dtype == torch.float32:
            expected_cols = hidden // 128
        elif scales.dtype == torch.int32:
            expected_cols = (hidden // 128 + 3) // 4
        else:
            raise InputError(f"x[1] (scales) must be float32 or packed int32, got {scales.dtype}")
        check_tensor("x[1] (scales)", scales, dtype=scales.dtype, shape=(data.shape[0], expected_cols),
                     device=device, contiguous=False)
        return data, scales
    check_tensor("x", x, dtype=torch.bfloat16, shape=(None, None), device=device)
    assert isinstance(x, torch.Tensor)
    return x, None


def check_stream_args(previous_event: object, async_finish: bool, allocate_on_comm_stream: bool) -> None:
    if allocate_on_comm_stream:
        require(previous_event is not None and async_finish,
                "allocate_on_comm_stream=True requires previous_event and async_finish=True")
