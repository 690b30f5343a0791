"""Launching a low-latency kernel: both halves in one launch, or the send now and the receive in the hook.

Each low-latency kernel has a send half and a receive half (constexprs ``DO_SEND``,
``DO_RECV``). Without a receive hook one launch runs both, its receivers spinning on senders
of the same launch: every program must be resident at once, so that launch gets no more
programs than the compiled kernel's registers and warps let the GPU hold
(``resident_programs``). With a hook the send half launches now and the receive half when the
hook runs. Under the interpreter, which runs programs one after another, the halves always
launch apart, send first.

Launches go through ``FastLauncher``: a setup key stands for every argument but the changing
ones, and each launch returns the compiled launch it made (None under the interpreter), which
a replay learns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tritonep.runtime.launcher import FastLauncher, resident_programs
from tritonep.runtime.platform import GPU_KERNELS, INTERPRET


def kernel_shape(device: torch.device, programs_per_sm: int, warps: int) -> tuple[int, int]:
    """(programs, warps) of a kernel's launches. The interpreter runs programs one after
    another: a few cover the kernels' split of work between programs at little cost."""
    if INTERPRET:
        return 3, 4
    return torch.cuda.get_device_properties(device).multi_processor_count * programs_per_sm, warps


class SendReceiveLauncher:
    """One low-latency kernel's launches. ``changing``: the arguments that may differ between
    two calls of one setup (``FastLauncher``)."""

    def __init__(self, kernel: Any, changing: tuple[str, ...], programs_per_sm: int, warps: int,
                 device: torch.device) -> None:
        self.fast_launcher = FastLauncher(kernel, changing)
        self.programs, self.warps = kernel_shape(device, programs_per_sm, warps)
        self.device = device
        # (setup, DO_SEND, DO_RECV) -> (constexprs, grid)
        self._variants: dict[tuple, tuple[dict, int]] = {}

    def launch(self, setup: tuple, args: tuple, constants: Callable[[], dict],
               with_hook: bool) -> tuple[Any, Callable[[], Any] | None]:
        """Launch send and receive as one kernel, or the send now and return the receive.
        ``setup`` stands for everything but the changing arguments and ``constants`` makes the
        constexprs, needed only the first time a setup is seen. Returns (the compiled launch
        made, the receive or None); the receive returns its compiled launch."""
        if with_hook:
            first = self._run(setup, args, constants, True, False)
            return first, lambda: self._run(setup, args, constants, False, True)
        if INTERPRET:
            self._run(setup, args, constants, True, False)
            self._run(setup, args, constants, False, True)
            return None, None
        return self._run(setup, args, constants, True, True), None

    def _run(self, setup: tuple, args: tuple, constants: Callable[[], dict], do_send: bool, do_recv: bool) -> Any:
        variant = (setup, do_send, do_recv)
        known = self._variants.get(variant)
        if known is None:
            variant_constants = {**constants(), "DO_SEND": do_send, "DO_RECV": do_recv, "GPU": GPU_KERNELS}
            grid = self.programs if INTERPRET or not (do_send and do_recv) else resident_programs(
                self.fast_launcher.kernel, args, variant_constants, self.warps, self.device, self.programs)
            known = self._variants[variant] = (variant_constants, grid)
        variant_constants, grid = known
        return self.fast_launcher(grid, variant, args, variant_constants, self.warps)
