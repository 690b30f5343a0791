"""Byte packing and thin collective wrappers shared by normal and low-latency mode.

Several small per-row payloads (top-k ids, weights, scales, source indices) travel in one
``all_to_all_single`` as raw bytes: one collective instead of four, and no dtype restrictions
(gloo cannot reduce or even send every dtype, e.g. float8). Everything is device agnostic so
the same code runs on gloo/CPU and NCCL/CUDA.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from tritonep.core.checks import InputError

# all_gather_into_tensor is deprecated in newer torch in favour of all_gather_single.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def compact(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with row-major strides. ``.contiguous()`` is not enough for a dtype view: it
    accepts any stride on size-1 and empty dimensions (column-major [N, 1] scales, a [0, H]
    tensor with stride 0)."""
    if tensor.stride() == torch.empty(tensor.shape, dtype=tensor.dtype, device="meta").stride():
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def row_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """[S, ...] tensor of any dtype -> uint8 [S, bytes per row] (copies only if not row-major)."""
    rows = tensor.shape[0]
    per_row = math.prod(tensor.shape[1:]) * tensor.element_size()
    return compact(tensor).view(torch.uint8).reshape(rows, per_row)


def pack_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate the byte rows of ``parts`` (same first dimension) into one uint8 [S, B]."""
    return torch.cat([row_bytes(part) for part in parts], dim=1)


def unpack_rows(packed: torch.Tensor, specs: list[tuple[torch.dtype, int]]) -> list[torch.Tensor]:
    """Inverse of :func:`pack_rows`: ``specs`` lists (dtype, elements per row) per part."""
    parts, start = [], 0
    for dtype, count in specs:
        width = count * dtype.itemsize
        # A fresh compact copy: a column slice (even a "contiguous" one-row slice) keeps the
        # parent's row stride and offset, which view(dtype) rejects.
        column = torch.empty((packed.shape[0], width), dtype=torch.uint8, device=packed.device)
        column.copy_(packed[:, start:start + width])
        parts.append(column.view(dtype).reshape(packed.shape[0], count))
        start += width
    return parts


def all_gather_rows(group: dist.ProcessGroup, values: torch.Tensor) -> torch.Tensor:
    """All-gather an int64 vector (same length on every rank) -> host int64 [R, L].

    The result goes to the host because split sizes and checks need Python ints anyway.
    """
    num_ranks = group.size()
    values = values.to(torch.int64).contiguous()
    out = torch.empty(num_ranks * values.numel(), dtype=torch.int64, device=values.device)
    _all_gather_single(out, values, group=group)
    return out.view(num_ranks, -1).cpu()


def all_to_all_rows(
    group: dist.ProcessGroup,
    send: torch.Tensor,
    send_splits: list[int],
    recv_splits: list[int],
    out: torch.Tensor | None = None,
    async_op: bool = False,
) -> tuple[torch.Tensor, dist.Work | None]:
    """Uneven all-to-all of rows: ``send_splits[r]`` rows go to rank r, ``recv_splits[s]`` come
    from rank s, laid out by source ascending. Returns (output, work or None).

    float8 rows travel as bytes because gloo has no float8 type.
    """
    if out is None:
        out = torch.empty((sum(recv_splits), *send.shape[1:]), dtype=send.dtype, device=send.device)
    send = compact(send)
    wire_send, wire_out = send, out
    if send.dtype not in (torch.bfloat16, torch.float32, torch.int64, torch.int32, torch.uint8):
        wire_send, wire_out = send.view(torch.uint8), out.view(torch.uint8)
    work = dist.all_to_all_single(wire_out, wire_send, output_split_sizes=recv_splits,
                                  input_split_sizes=send_splits, group=group, async_op=async_op)
    return out, (work if async_op else None)


def check_same_on_all_ranks(table: torch.Tensor, names: list[str], what: str) -> None:
    """``table`` [R, len(names)]: raise the same InputError on every rank if any column differs."""
    for column, name in enumerate(names):
        values = table[:, column].tolist()
        if any(value != values[0] for value in values):
            per_rank = ", ".join(f"rank {rank}: {value}" for rank, value in enumerate(values))
            raise InputError(f"{what}: every rank must pass the same {name}, got {per_rank}")
