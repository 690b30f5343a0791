"""A kernel's Triton cache key that does not depend on the order kernels were first hashed in.

Triton keys its on-disk cache by the kernel's ``cache_key``, which hashes the source of the
kernel and of every Triton function it calls, plus the values of the constexpr globals they
use. A function's list of used globals (``used_global_vals``) is filled when its own key is
computed, and a caller merges its callees' lists *before* asking for their keys. So a kernel
whose helpers were not hashed yet leaves their globals out of its key, and one hashed after
another kernel that shares those helpers puts them in: the key depends on which kernels the
process hashed first. Two processes that launch kernels in different orders then miss each
other's cache entries (ranks rebuilt NVSHMEM kernels the test suite's warming pool had just
built, about five seconds each: docs/findings.md).

``stable_cache_key`` first hashes the helpers a kernel reaches, callees before callers, so
every function's list is complete when a caller merges it; the key is then the same whatever
the process did before. Triton's main branch has since made its own keys independent of the
order (triton-lang/triton#10494); Triton 3.6 still shows the problem, and with a fixed Triton
this changes nothing but the few milliseconds it costs.
"""

from __future__ import annotations

from types import CodeType, ModuleType

from triton.runtime import JITFunction


def _code_names(code: CodeType) -> set[str]:
    """The global and attribute names ``code`` and the code nested in it use."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, CodeType):
            names |= _code_names(constant)
    return names


def _callees(function: JITFunction) -> list[JITFunction]:
    """The Triton functions ``function`` may call: the globals its code names, and the
    attributes of global modules by the names its code uses (``nvshmem.fence()``). A superset
    of what it calls is harmless here: more helpers are hashed ahead, none left out."""
    names = _code_names(function.fn.__code__)
    found = []
    for name in sorted(names):
        value = function.fn.__globals__.get(name)
        if isinstance(value, ModuleType):
            found += [getattr(value, attribute, None) for attribute in sorted(names)]
        else:
            found.append(value)
    return [value for value in found if isinstance(value, JITFunction)]


def callees_first(kernel: JITFunction) -> list[JITFunction]:
    """``kernel`` and the Triton functions it reaches, each after those it calls."""
    order: list[JITFunction] = []
    visiting: set[int] = set()

    def visit(function: JITFunction) -> None:
        if id(function) in visiting:
            return   # reached before (or a recursive call: Triton hashes it once either way)
        visiting.add(id(function))
        for callee in _callees(function):
            visit(callee)
        order.append(function)

    visit(kernel)
    return order


def stable_cache_key(kernel: JITFunction) -> str:
    """Triton's ``cache_key`` of ``kernel`` with every helper's used globals complete (see the
    module docstring). Costs a few milliseconds per kernel: read it once per process."""
    functions = callees_first(kernel)
    key = None
    # One pass in this order completes every list; a second finds nothing changed. More passes
    # only where a callee escaped ``_callees`` (its list then fills one level per pass).
    for _ in range(len(functions) + 1):
        for function in functions:
            function.hash = None
        for function in functions:
            JITFunction.cache_key.fget(function)
        if kernel.hash == key:
            break
        key = kernel.hash
    return key
