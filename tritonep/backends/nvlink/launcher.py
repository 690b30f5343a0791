"""Launching a Triton kernel with as little host work as possible.

``kernel[grid](...)`` binds the arguments, computes a specialisation key and looks the
compiled kernel up on every call: tens of microseconds for kernels with many arguments,
which a decode-time call cannot afford. ``FastLauncher`` does that once per specialisation
(the constexpr values, which pointer arguments are 16-byte aligned and which integers need
64 bits: what Triton specialises our arguments on) and afterwards calls the compiled kernel directly.
Integer arguments must be listed in the kernel's ``do_not_specialize``. Under the
interpreter it is a plain ``kernel[grid](...)``.
"""

from __future__ import annotations

from typing import Any

import torch

from .sync import INTERPRET


class FastLauncher:
    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.names = kernel.arg_names
        self.compiled: dict[tuple, Any] = {}

    def __call__(self, grid: int, args: tuple, constants: dict[str, Any], num_warps: int) -> None:
        """``args``: the non-constexpr arguments in order; ``constants``: the constexprs by name."""
        if INTERPRET:
            self.kernel[(grid,)](*args, **constants, num_warps=num_warps)
            return
        # Triton specialises tensors on 16-byte alignment and types ints as i32 or i64.
        kinds = tuple(a.data_ptr() % 16 == 0 if isinstance(a, torch.Tensor) else -2**31 <= a < 2**31 for a in args)
        key = (tuple(constants.values()), kinds, num_warps)
        compiled = self.compiled.get(key)
        if compiled is None:
            self.compiled[key] = self.kernel[(grid,)](*args, **constants, num_warps=num_warps)
            return
        stream = torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())
        compiled.run(grid, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *args,
                     *[constants[name] for name in self.names[len(args):]])
