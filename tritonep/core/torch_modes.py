"""Front-end calls run with torch-function handling off.

``torch.set_default_device('cuda')``, which DeepEP's users run, installs a torch-function mode
that intercepts every torch call made from Python, a few microseconds each: it would triple the
host time of a low-latency call. Every tensor tritonep makes names its device and dtype (a test
scans for it), so such modes have nothing to do inside a call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

# ``with torch_functions_off():`` around a call's body.
torch_functions_off = torch._C.DisableTorchFunction


def without_torch_function(call: Callable) -> Callable:
    """``call`` run with torch-function handling off."""
    @functools.wraps(call)
    def plain(*args: Any, **kwargs: Any) -> Any:
        with torch_functions_off():
            return call(*args, **kwargs)
    return plain


def plain_hook(receive: Callable[[], None] | None) -> Callable[[], None] | None:
    """A receive hook, run like the call that made it. A plain closure: functools.wraps would
    cost a decode-time call more than the rest of the hook."""
    if receive is None:
        return None

    def hook() -> None:
        with torch_functions_off():
            receive()
    return hook
