"""The CUDA driver calls that the host path of a call makes every time, bound once through ctypes.

The copy-engine combine issues a few driver calls per call (``side_streams.PeerStreams``
forks a captured graph with an event record, a stream wait, the graph's launch and a second
record; without a graph, a copy and a stream write per piece). cuda-bindings wraps every
argument and result of such a call in Python objects; ``DriverCalls`` calls the same entry
points of ``libcuda`` directly, with handles and addresses as plain ints and the result as the
bare ``CUresult`` code (``check`` raises, naming it). ``benchmarks/driver_calls.py`` measures
both ways, and torch's events, per call.

The rare calls (graph capture and instantiation, the device attribute query) stay on
cuda-bindings (``DriverCalls.bindings``): their cost does not matter, and their results are
objects that cuda-bindings makes easy to handle.

Each entry point is looked up by the name that CUDA 12's ``cuda.h`` links a call to: for the
calls that have a 64-bit or second version that is the ``_v2`` symbol (``cuMemcpyDtoDAsync``
takes 32-bit addresses, ``cuStreamWriteValue64`` the memory operations of CUDA 8), and the
attributes here keep the header's plain names.

Nothing here is loaded on import: the interpreter tests run without ``libcuda``.
"""

from __future__ import annotations

import ctypes
from typing import Any

# ctypes types of the driver's arguments: handles (CUevent, CUstream, CUgraphExec) are
# pointers, device addresses (CUdeviceptr) 64-bit integers; every call returns a CUresult.
_HANDLE, _ADDRESS, _FLAGS = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint

# (attribute, symbol in libcuda, argument types)
_ENTRY_POINTS = (
    ("cuEventCreate", "cuEventCreate", (ctypes.POINTER(_HANDLE), _FLAGS)),
    ("cuEventRecord", "cuEventRecord", (_HANDLE, _HANDLE)),
    ("cuStreamWaitEvent", "cuStreamWaitEvent", (_HANDLE, _HANDLE, _FLAGS)),
    ("cuGraphLaunch", "cuGraphLaunch", (_HANDLE, _HANDLE)),
    ("cuGraphExecDestroy", "cuGraphExecDestroy", (_HANDLE,)),
    ("cuMemcpyDtoDAsync", "cuMemcpyDtoDAsync_v2", (_ADDRESS, _ADDRESS, ctypes.c_size_t, _HANDLE)),
    ("cuStreamWriteValue64", "cuStreamWriteValue64_v2", (_HANDLE, _ADDRESS, ctypes.c_uint64, _FLAGS)),
)

EVENT_DISABLE_TIMING = 0x2   # CU_EVENT_DISABLE_TIMING


class DriverError(RuntimeError):
    """A CUDA driver call failed; ``code`` is its CUresult."""

    def __init__(self, what: str, code: int, name: str) -> None:
        super().__init__(f"{what} failed: {name} ({code})")
        self.code = code


def driver_result(result: tuple, what: str) -> Any:
    """The value a cuda-bindings driver call returned (None when it returns only its status);
    raises if the call failed."""
    code = result[0]
    if code != 0:   # CUresult.CUDA_SUCCESS
        raise DriverError(what, int(getattr(code, "value", code)), getattr(code, "name", repr(code)))
    return result[1] if len(result) > 1 else None


class DriverCalls:
    """libcuda's entry points for the per-call driver calls, as attributes named like the
    driver's functions (``cuEventRecord``, ...): each takes ints and returns the CUresult code,
    0 on success. ``bindings``: cuda-bindings' ``driver`` module, for everything else."""

    def __init__(self, bindings: Any, libcuda: Any = None) -> None:
        """``libcuda``: the driver library as ctypes loaded it (loaded here when None)."""
        self.bindings = bindings
        if libcuda is None:
            libcuda = ctypes.CDLL("libcuda.so.1")
        for attribute, symbol, argtypes in _ENTRY_POINTS:
            function = getattr(libcuda, symbol)
            function.argtypes, function.restype = argtypes, ctypes.c_int
            setattr(self, attribute, function)
        self._error_name = libcuda.cuGetErrorName
        self._error_name.argtypes = (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p))
        self._error_name.restype = ctypes.c_int

    def check(self, code: int, what: str) -> None:
        """Raise ``DriverError`` naming the CUresult ``code`` unless it is 0 (success)."""
        if code:
            name = ctypes.c_char_p()
            known = self._error_name(code, ctypes.byref(name)) == 0 and name.value
            raise DriverError(what, code, name.value.decode() if known else "unknown CUresult")

    def new_event(self) -> int:
        """A raw CUevent without timing (the cheapest kind to record), never destroyed: the
        side streams make a few, once."""
        event = _HANDLE()
        self.check(self.cuEventCreate(ctypes.byref(event), EVENT_DISABLE_TIMING), "event creation")
        return event.value
