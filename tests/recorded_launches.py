"""Compiled launches faked on CPUs: a replay's learnt argument lists, checked without a GPU.

Under Triton's interpreter ``FastLauncher`` learns no compiled launch, so no replay is made.
Inside ``launches_faked`` the launchers learn and replay as on a GPU, but each learnt launch is a
stand-in (``RecordedLaunch`` records its argument list) and nothing is compiled or run; the
tests of both modes' replays compare what the replays launch with what the general path does.
``launches_counted`` instead lets every launch run (in the interpreter) and logs it, keeping the
interpreter's torch work out of a count of the call's own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType

import torch

from tritonep.runtime.launcher import raw_argument


class RecordedLaunch:
    """Stands for a compiled launch (launcher._Setup): same raw argument list, records calls."""

    log: list = []

    def __init__(self, compiled: object, grid: int, raw_args: list) -> None:
        self.args, self.grid = raw_args, grid

    def __call__(self, stream: int, args: list | None = None) -> None:
        RecordedLaunch.log.append((id(self), self.grid, tuple(self.args if args is None else args)))


class NoKernel:
    """``kernel[grid](...)`` (FastLauncher's first call of a setup) that compiles and runs
    nothing, but records the launch in ``RecordedLaunch.log`` as a learnt one would, setup None:
    a call that makes a new setup (the normal-mode epochs and release targets do now and then,
    as the launcher keys them finer than Triton specialises them) still shows what it launched."""

    def __init__(self, kernel: object) -> None:
        self.arg_names = kernel.arg_names

    def __getitem__(self, grid: tuple) -> object:
        def launch(*args: object, num_warps: int, **constants: object) -> None:
            raw = [raw_argument(value) for value in args]
            RecordedLaunch.log.append((None, grid[0], tuple(raw + [constants[name]
                                                                   for name in self.arg_names[len(args):]])))
        return launch


@contextlib.contextmanager
def launches_faked(fast_launchers: tuple, setup: type, replay_modules: tuple[ModuleType, ...],
                   patches: list[tuple[object, str, object]] = ()) -> Iterator[None]:
    """Inside, ``fast_launchers`` learn ``setup`` stand-ins instead of compiled launches and run
    nothing, the launcher and ``replay_modules`` see stream 7, and each (object, name, value) of
    ``patches`` holds. On exit everything is restored and what the launchers learnt is dropped."""
    from tritonep.runtime import launcher

    patches = [(launcher, "INTERPRET", False), (launcher, "_Setup", setup), (launcher, "current_stream", lambda: 7),
               *[(module, "current_stream", lambda: 7) for module in replay_modules], *patches]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    learnt = [(item, item.kernel, dict(item.setups)) for item in fast_launchers]
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        for item in fast_launchers:
            item.kernel = NoKernel(item.kernel)
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
        for item, kernel, setups in learnt:
            item.kernel = kernel
            item.setups.clear()
            item.setups.update(setups)


@contextlib.contextmanager
def launches_counted() -> Iterator[list[tuple[str, int]]]:
    """Inside, every FastLauncher launch runs as usual and is logged as (kernel name, grid) in the
    list yielded. It runs with torch's dispatch modes off, so that a TorchDispatchMode around a
    call counts the torch ops of the call's host path, not those the interpreter runs a kernel
    with."""
    from torch.utils._python_dispatch import _disable_current_modes

    from tritonep.runtime.launcher import FastLauncher

    log: list[tuple[str, int]] = []
    launch = FastLauncher.__call__

    def logged(self: FastLauncher, grid: int, *args: object) -> object:
        log.append((self.kernel.profiler_name, grid))
        with _disable_current_modes():
            return launch(self, grid, *args)

    FastLauncher.__call__ = logged
    try:
        yield log
    finally:
        FastLauncher.__call__ = launch


def normal_launches_recorded() -> contextlib.AbstractContextManager:
    """Inside, the normal mode's launches are learnt and repeated as on a GPU, but each is a
    ``RecordedLaunch`` and nothing is compiled or run (``launches_faked``)."""
    from tritonep.backends.nvlink.normal import combine_copy_engine, dispatch_copy_engine, replay
    from tritonep.backends.nvlink.normal.combine_kernel import COMBINE
    from tritonep.backends.nvlink.normal.dispatch_kernel import DISPATCH

    launchers = (DISPATCH, COMBINE, combine_copy_engine._WEIGHTS, combine_copy_engine._SIGNAL,
                 dispatch_copy_engine._WAIT)
    return launches_faked(launchers, RecordedLaunch, (replay,))


def tensors_in(result: object) -> list[torch.Tensor]:
    """The tensors in ``result`` (nested tuples flattened, None and other values left out)."""
    if isinstance(result, tuple):
        return [tensor for item in result for tensor in tensors_in(item)]
    return [result] if isinstance(result, torch.Tensor) else []


def named_launches(log: list, result: object) -> list:
    """The recorded launches (grid, arguments) with the addresses of ``result``'s tensors
    replaced by names: two runs that make new outputs compare equal when they launch alike."""
    names = {tensor.data_ptr(): f"output {index}" for index, tensor in enumerate(tensors_in(result))}
    return [(grid, tuple(names.get(value, value) if type(value) is int else value for value in args))
            for _, grid, args in log]


def result_shapes(result: object) -> tuple:
    return tuple((tuple(tensor.shape), tensor.dtype) for tensor in tensors_in(result))
