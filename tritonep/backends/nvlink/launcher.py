"""Launching a Triton kernel with as little host work as possible.

``kernel[grid](...)`` binds the arguments, computes a specialisation key and looks the
compiled kernel up on every call: tens of microseconds for kernels with many arguments,
which a decode-time call cannot afford.
``FastLauncher`` does that once per specialisation and afterwards calls the compiled kernel
directly. Its key holds what Triton specialises our arguments on: the constexpr values,
which pointers are 16-byte aligned, and for integers whether they need 64 bits and, unless
the kernel lists them in ``do_not_specialize``, whether they equal 1 or divide by 16. A key
seen for the first time goes through ``kernel[grid]`` (which compiles only if Triton's own
cache misses). Under the interpreter it is a plain ``kernel[grid](...)``.
"""

from __future__ import annotations

from typing import Any

import torch

from .sync import INTERPRET


def _arg_kind(value: Any, specialised: bool) -> Any:
    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    if isinstance(value, int) and not isinstance(value, bool):
        fits_32_bits = -2**31 <= value < 2**31
        return (fits_32_bits, value == 1, value % 16 == 0) if specialised else fits_32_bits
    return value   # anything else (None, floats) is part of the key as it is


class FastLauncher:
    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.names = kernel.arg_names
        # (The interpreter's functions have no params; they never reach the fast path.)
        self.specialised = [not param.do_not_specialize for param in getattr(kernel, "params", ())]
        self.compiled: dict[tuple, Any] = {}

    def __call__(self, grid: int, args: tuple, constants: dict[str, Any], num_warps: int) -> None:
        """``args``: the non-constexpr arguments in order; ``constants``: the constexprs by name."""
        if INTERPRET:
            self.kernel[(grid,)](*args, **constants, num_warps=num_warps)
            return
        kinds = tuple(_arg_kind(value, specialised) for value, specialised in zip(args, self.specialised))
        key = (tuple(constants.values()), kinds, num_warps)
        compiled = self.compiled.get(key)
        if compiled is None:
            self.compiled[key] = self.kernel[(grid,)](*args, **constants, num_warps=num_warps)
            return
        stream = torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())
        compiled.run(grid, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *args,
                     *[constants[name] for name in self.names[len(args):]])
