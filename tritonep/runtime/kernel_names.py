"""The names a profiler shows for the kernels: C++-style and namespace-qualified, as DeepEP's.

Tools written for DeepEP find its kernels by name in a torch.profiler trace: DeepEP's
``bench_kineto`` takes a name such as "dispatch", requires exactly one row of the profiler's
table to contain it (its kernels are ``deep_ep::internode_ll::dispatch<...>`` and the like),
and with ``num_kernels_per_period`` picks the launches whose name contains ``::dispatch``
(in hook mode a call's send and receive launches).

Triton names a compiled kernel (its PTX entry) after the Python function. ``jit`` gives it an
Itanium-mangled C++ name instead, ``_ZN8tritonep11low_latency8dispatchE`` for
``tritonep::low_latency::dispatch``: the profiler demangles kernel names as the C++ runtime
does, so the trace shows the qualified name, and the Python function keeps its own. Under
Triton's interpreter nothing is compiled and nothing is renamed.

The names are chosen so that "dispatch" and "combine" each match one kernel of a call: the
helpers of a call (layout, count exchange, weights, signals, cleaning) are named otherwise.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from typing import Any

import triton

from tritonep.runtime.cache_keys import stable_cache_key
from tritonep.runtime.platform import INTERPRET

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def mangled(qualified_name: str) -> str:
    """The Itanium C++ ABI name of ``qualified_name`` ("a::b::c": a nested name, no arguments),
    which demanglers turn back into ``qualified_name``."""
    parts = qualified_name.split("::")
    if len(parts) < 2 or not all(_IDENTIFIER.fullmatch(part) for part in parts):
        raise ValueError(f"a kernel name must be namespace::...::name of C identifiers, got {qualified_name!r}")
    return "_ZN" + "".join(f"{len(part)}{part}" for part in parts) + "E"


class NamedJITFunction(triton.runtime.JITFunction):
    """A ``triton.jit`` function whose compiled kernel is called ``mangled(profiler_name)``."""

    def __init__(self, fn: Callable, profiler_name: str, **options: Any) -> None:
        entry = mangled(profiler_name)
        self.profiler_name = profiler_name
        self._named_key: str | None = None
        super().__init__(fn, repr=lambda _specialization: entry, **options)

    @property
    def cache_key(self) -> str:
        # Triton's on-disk cache keys a kernel by its source, not by the name it compiles it
        # under: without the name in the key, a renamed kernel would come back under its old
        # name. The source key is made independent of what the process hashed before
        # (``cache_keys.py``), so that every process finds the others' builds.
        if self._named_key is None:
            source_key = stable_cache_key(self)
            self._named_key = hashlib.sha256(f"{source_key}:{self.profiler_name}".encode()).hexdigest()
        return self._named_key


def jit(profiler_name: str, **options: Any) -> Callable[[Callable], Any]:
    """``triton.jit(**options)``, the compiled kernel named ``profiler_name`` in profiler traces
    (e.g. "tritonep::low_latency::dispatch"); ``kernel.profiler_name`` holds it either way, and
    ``kernel.unspecialised`` the names of the arguments listed in ``do_not_specialize`` (what a
    learnt launch takes any value of: ``launcher.respecialised``)."""
    mangled(profiler_name)   # a bad name fails at import, on every platform
    unspecialised = frozenset(options.get("do_not_specialize", ()))

    def decorate(fn: Callable) -> Any:
        kernel = triton.jit(**options)(fn) if INTERPRET else NamedJITFunction(fn, profiler_name, **options)
        kernel.profiler_name, kernel.unspecialised = profiler_name, unspecialised
        return kernel
    return decorate
