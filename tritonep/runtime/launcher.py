"""Launching a Triton kernel with as little host work as possible.

``kernel[grid](...)`` binds the arguments, computes a specialisation key and looks the
compiled kernel up on every call; Triton's C launcher then calls ``data_ptr()`` and the driver's
``cuPointerGetAttribute`` for every tensor. For a decode-time call with twenty-odd arguments
that is tens of microseconds, more than the kernel.

``FastLauncher`` does that work once per *setup*: the caller names the arguments that change
from call to call (``changing``) and passes a hashable ``setup`` key that stands for all the
others and the constexprs (equal keys promise equal values). The first call of a setup goes
through ``kernel[grid]`` (which compiles only if Triton's own cache misses) and keeps the
compiled kernel with its argument list in raw form: tensors as device addresses. Later calls
of that setup convert only the changing arguments to addresses, check that they still fall in
the same specialisation (Triton specialises pointers on 16-byte alignment and integers on
being 1 or a multiple of 16, unless the kernel lists them in ``do_not_specialize``), and call
Triton's compiled launcher with plain integers, which it passes to ``cuLaunchKernelEx`` as
they are. Under the interpreter every call is a plain ``kernel[grid](...)``.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Callable
from typing import Any

import torch

from tritonep.runtime.platform import INTERPRET

# TRITONEP_CHECK_LAUNCHES=1 (the GPU tests set it): every repeated launch first checks that the
# arguments its setup holds fixed did not change, which a setup key missing one would allow.
CHECK_LAUNCHES = os.environ.get("TRITONEP_CHECK_LAUNCHES") == "1"


def _kinds(raw: list[int]) -> tuple[int, ...]:
    """For raw arguments (addresses and ints), what Triton may specialise them on: dividing by 16
    (a 16-byte aligned address), being 1, fitting in 32 bits. Finer than Triton's own key for
    arguments it does not specialise, which only costs a second setup entry, never a wrong one."""
    return tuple([(value & 15 == 0) + 2 * (value == 1) + 4 * (-2**31 <= value < 2**31) for value in raw])


def next_power_of_2(value: int) -> int:
    """``triton.next_power_of_2`` for a call's host path: Triton's goes through its JIT wrapper,
    1.5 us per call on a workstation CPU against 0.04 us for this."""
    return 1 << max(value - 1, 0).bit_length()


def programs_per_multiprocessor(registers_per_thread: int, num_warps: int, shared_bytes: int,
                                 registers_per_multiprocessor: int = 65536, threads_per_multiprocessor: int = 2048,
                                 shared_per_multiprocessor: int = 233472) -> int:
    """Programs of one kernel that fit on a multiprocessor at once, counted like CUDA's
    occupancy calculator: registers allocated per warp in units of 256, threads, and shared
    memory plus the 1 KB the driver reserves per block (defaults: Hopper's limits)."""
    registers_per_warp = -(-registers_per_thread * 32 // 256) * 256
    by_registers = registers_per_multiprocessor // max(registers_per_warp * num_warps, 1)
    by_threads = threads_per_multiprocessor // (32 * num_warps)
    by_shared = shared_per_multiprocessor // (shared_bytes + 1024) if shared_bytes else 32
    return max(1, min(by_registers, by_threads, by_shared, 32))


def resident_programs(kernel: Any, args: tuple, constants: dict[str, Any], num_warps: int,
                      device: torch.device, wanted: int) -> int:
    """How many programs of ``kernel`` (compiled for these arguments, nothing launched) can run
    at once on ``device``, at most ``wanted``: the grid for a launch whose programs wait for each
    other (receivers spinning on senders of the same launch), which hangs if any program has to
    wait for another to finish before it is scheduled."""
    compiled = kernel.warmup(*args, grid=(1,), **constants, num_warps=num_warps)
    compiled._init_handles()   # fills n_regs
    properties = torch.cuda.get_device_properties(device)
    per_multiprocessor = programs_per_multiprocessor(
        compiled.n_regs, num_warps, compiled.metadata.shared,
        getattr(properties, "regs_per_multiprocessor", 65536),
        getattr(properties, "max_threads_per_multi_processor", 2048),
        getattr(properties, "shared_memory_per_multiprocessor", 233472))
    return min(wanted, properties.multi_processor_count * per_multiprocessor)


def aligned(*addresses: int) -> bool:
    """Every address 16-byte aligned: what Triton specialises pointers on, so what a learnt
    launch may assume of the tensors a replay writes into it."""
    bits = 0
    for address in addresses:
        bits |= address
    return not bits & 15


def as_words(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as int32 words along its last dimension (how the kernels move rows). An
    empty tensor may carry zero strides (numpy's, through ``torch.from_numpy``), which ``view``
    refuses: it is replaced by an empty tensor of the same shape."""
    if tensor.numel() == 0:
        tensor = tensor.new_empty(tensor.shape)
    return tensor.view(torch.int32)


class DeviceAddress:
    """A pointer argument into a tensor: ``base``'s memory from ``byte_offset`` on, as ``dtype``
    elements (a whole number of them). Triton binds it as it binds a tensor of that dtype
    (``data_ptr`` and ``dtype``) and a launch passes the address, so a kernel may write into part
    of a larger allocation without the tensor object a view would cost the host (a few
    microseconds each). Under the interpreter, which reads tensors and not addresses, the launch
    makes that view (``as_tensor``)."""

    __slots__ = ("base", "byte_offset", "dtype")

    def __init__(self, base: torch.Tensor, byte_offset: int, dtype: torch.dtype) -> None:
        self.base, self.byte_offset, self.dtype = base, byte_offset, dtype

    def data_ptr(self) -> int:
        return self.base.data_ptr() + self.byte_offset

    def as_tensor(self) -> torch.Tensor:
        return self.base.view(torch.uint8).view(-1)[self.byte_offset:].view(self.dtype)


def raw_argument(value: Any) -> Any:
    """A launch argument as the compiled launcher takes it: tensors and device addresses as
    addresses, the rest as they are."""
    return value.data_ptr() if isinstance(value, (torch.Tensor, DeviceAddress)) else value


def current_stream() -> int:
    """The raw handle of the current CUDA stream, without making a torch Stream object."""
    return torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())


def respecialised(kernel: Any, raw: list, values: dict[int, int]) -> list | None:
    """A copy of a launch's raw argument list (``_Setup.args``) with ``values`` (position -> raw
    value) written in, or None when one of them falls into another specialisation than the value
    it replaces (``_kinds``; an argument the kernel does not specialise, ``kernel_names.jit``'s
    ``unspecialised``, takes any value): the launch was compiled for the values it holds."""
    names, unspecialised = kernel.arg_names, kernel.unspecialised
    for position, value in values.items():
        if names[position] not in unspecialised:
            was, now = _kinds((raw[position], value))
            if was != now:
                return None
    args = list(raw)
    for position, value in values.items():
        args[position] = value
    return args


def argument_positions(kernel: Any, *names: str) -> tuple[int, ...]:
    """Where the arguments ``names`` sit in ``kernel``'s argument list, and so in the raw list of
    a launch of it (``_Setup.args``): the places a replay rewrites, found by name so that the
    kernel's signature may be regrouped."""
    return tuple(kernel.arg_names.index(name) for name in names)


class _Setup:
    """A compiled kernel and its raw argument list, constexprs included (Triton's launcher
    takes them and skips them)."""

    __slots__ = ("args", "launch", "grid", "function", "metadata", "cooperative", "pdl", "fallback")

    def __init__(self, compiled: Any, grid: int, raw_args: list) -> None:
        run = compiled.run
        self.args, self.grid = raw_args, grid
        self.function, self.metadata = compiled.function, compiled.packed_metadata
        if getattr(run, "global_scratch_size", 1) == 0 and getattr(run, "profile_scratch_size", 1) == 0:
            # Triton's C entry point itself: nothing to allocate per launch.
            self.launch, self.cooperative, self.pdl = run.launch, run.launch_cooperative_grid, run.launch_pdl
        else:
            self.launch, self.fallback = None, run

    def __call__(self, stream: int, args: list | None = None) -> None:
        """Launch on ``stream`` with ``args`` (a raw list of the same form), or with ``self.args``."""
        raw = self.args if args is None else args
        if self.launch is not None:
            self.launch(self.grid, 1, 1, stream, self.function, self.cooperative, self.pdl, None, None,
                        self.metadata, None, None, None, *raw)
        else:
            self.fallback(self.grid, 1, 1, stream, self.function, self.metadata, None, None, None, *raw)


class FastLauncher:
    def __init__(self, kernel: Any, changing: tuple[str, ...] | None = None) -> None:
        """``changing``: names of the arguments (tensors or ints) that may differ between calls of
        one setup; None: all of them (every call then converts every argument, still far cheaper
        than Triton's binder)."""
        self.kernel = kernel
        self.names = kernel.arg_names
        self.changing = None if changing is None else tuple(self.names.index(name) for name in changing)
        # Picks the changing arguments out of ``args`` in one C call (two or more positions:
        # itemgetter then returns a tuple).
        self._pick = operator.itemgetter(*self.changing) if self.changing is not None and len(self.changing) > 1 \
            else None
        self.setups: dict[Any, _Setup] = {}

    def __call__(self, grid: int, setup: Any, args: tuple,
                 constants: dict[str, Any] | Callable[[], dict[str, Any]], num_warps: int) -> _Setup | None:
        """``args``: the non-constexpr arguments in order (tensors or ints); ``constants``: the
        constexprs by name, or (with a ``setup``) a function that makes them, called only when
        the setup is new, so a repeated launch builds no dict; ``setup``: hashable, equal only
        for calls whose non-changing arguments, constants, grid and num_warps are equal, or None
        to derive it from grid, num_warps and constants (right when every argument is
        changing). Returns the setup it launched (its ``args`` may be rewritten and the launch
        repeated: a replay), None under the interpreter."""
        if INTERPRET:
            args = [value.as_tensor() if isinstance(value, DeviceAddress) else value for value in args]
            self.kernel[(grid,)](*args, **(constants() if callable(constants) else constants), num_warps=num_warps)
            return None
        stream = current_stream()
        positions = self.changing if self.changing is not None else range(len(args))
        picked = self._pick(args) if self._pick is not None else map(args.__getitem__, positions)
        # (``raw_argument``, inlined: this runs for every argument of every launch)
        changing = [value.data_ptr() if isinstance(value, (torch.Tensor, DeviceAddress)) else value
                    for value in picked]
        if setup is None:
            setup = (grid, num_warps, *constants.values())
        key = (setup, _kinds(changing))
        known = self.setups.get(key)
        if known is not None:
            raw = known.args
            if CHECK_LAUNCHES:
                self._check_fixed(raw, args, positions)
            for i, value in zip(positions, changing):
                raw[i] = value
            known(stream)
            return known
        # First call of this setup and specialisation: Triton binds, compiles if needed, launches.
        if callable(constants):
            constants = constants()
        compiled = self.kernel[(grid,)](*args, **constants, num_warps=num_warps)
        raw = [raw_argument(value) for value in args]
        known = self.setups[key] = _Setup(compiled, grid, raw + [constants[name] for name in self.names[len(args):]])
        return known

    def _check_fixed(self, raw: list, args: tuple, changing_positions: Any) -> None:
        changing = set(changing_positions)
        for i, value in enumerate(args):
            if i not in changing and raw[i] != raw_argument(value):
                raise RuntimeError(f"{getattr(self.kernel, '__name__', self.kernel)}: argument {self.names[i]} "
                                   f"changed from {raw[i]} to {value} within one launch setup: its setup key "
                                   "must include it, or the launcher must list it as changing")
