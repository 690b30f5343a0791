"""Run the tests' rank workers under other torch defaults, chosen by environment variables.

DeepEP's test harness and serving stacks call ``torch.set_default_dtype(torch.bfloat16)`` and
``torch.set_default_device('cuda')`` before building a Buffer; nothing in tritonep may depend on
either. Every RankPool of the tests is made with :func:`pool_options`, so the whole suite can
run once more under those defaults:

    TRITONEP_TEST_DEFAULT_DTYPE=bfloat16 python -m pytest -q -m "not gpu"
    TRITONEP_TEST_DEFAULT_DTYPE=bfloat16 TRITONEP_TEST_DEFAULT_DEVICE=cuda python -m pytest -q -m gpu

``TRITONEP_TEST_DEFAULT_DTYPE`` (a floating torch dtype name) applies to every pool.
``TRITONEP_TEST_DEFAULT_DEVICE`` applies to GPU pools only (NCCL, one GPU per rank): the CPU
pools' test code builds CPU inputs with the default device on purpose. The CPU tests check the
default device separately (test_torch_defaults.py runs Buffer calls under the "meta" default
device, where any tensor made on the default device fails loudly).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

DTYPE_VARIABLE = "TRITONEP_TEST_DEFAULT_DTYPE"
DEVICE_VARIABLE = "TRITONEP_TEST_DEFAULT_DEVICE"


def default_dtype() -> torch.dtype | None:
    """The dtype ``TRITONEP_TEST_DEFAULT_DTYPE`` names (e.g. bfloat16), or None."""
    name = os.environ.get(DTYPE_VARIABLE, "")
    if not name:
        return None
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{DTYPE_VARIABLE}={name!r} is not a floating torch dtype (e.g. bfloat16)")
    return dtype


def default_device(use_gpu: bool) -> str | None:
    """The device ``TRITONEP_TEST_DEFAULT_DEVICE`` names, for GPU pools; None for CPU pools."""
    name = os.environ.get(DEVICE_VARIABLE, "")
    return name if name and use_gpu else None


def pool_options(use_gpu: bool = False) -> dict:
    """Keyword arguments for ``RankPool(...)``: the defaults the environment asks for."""
    return {"default_dtype": default_dtype(), "default_device": default_device(use_gpu)}


@contextlib.contextmanager
def torch_defaults(dtype: torch.dtype | None = None, device: str | torch.device | None = None) -> Iterator[None]:
    """Set the default dtype and/or device inside the block, restoring both after it."""
    previous_dtype = torch.get_default_dtype()
    try:
        if dtype is not None:
            torch.set_default_dtype(dtype)
        with torch.device(device) if device is not None else contextlib.nullcontext():
            yield
    finally:
        torch.set_default_dtype(previous_dtype)
