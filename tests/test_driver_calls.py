"""The per-call CUDA driver calls (``runtime/driver_calls.py``) and the side streams' graph fork
through them, checked without a GPU against a stand-in for libcuda: the entry points bound,
the calls a fork and join make in order, and failures raised with their CUresult named."""

from __future__ import annotations

import ctypes

import pytest
import torch

from tritonep.runtime import side_streams
from tritonep.runtime.driver_calls import DriverCalls, DriverError
from tritonep.runtime.side_streams import PeerStreams

_ERROR_NAMES = {1: b"CUDA_ERROR_INVALID_VALUE", 400: b"CUDA_ERROR_INVALID_HANDLE"}


class _Entry:
    """One of the stand-in library's functions: notes its calls, returns the library's next
    result (0 unless a test queued failures)."""

    def __init__(self, library: _FakeLibcuda, name: str) -> None:
        self.library, self.name = library, name
        self.argtypes, self.restype = None, None

    def __call__(self, *args: object) -> int:
        self.library.calls.append((self.name, *args))
        return self.library.results.pop(0) if self.library.results else 0


class _FakeLibcuda:
    """libcuda as ``ctypes.CDLL`` would give it, for the symbols ``DriverCalls`` looks up."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.results: list[int] = []
        self.symbols: dict[str, object] = {}

    def __getattr__(self, symbol: str) -> object:
        return self.symbols.setdefault(symbol, _ErrorName() if symbol == "cuGetErrorName" else _Entry(self, symbol))


class _ErrorName:
    """The stand-in's ``cuGetErrorName``: writes the name's char* through ``byref``."""

    argtypes = restype = None

    def __call__(self, code: int, name: object) -> int:
        if code not in _ERROR_NAMES:
            return 1   # CUDA_ERROR_INVALID_VALUE: no such CUresult
        name._obj.value = _ERROR_NAMES[code]
        return 0


def test_entry_points_are_the_64_bit_symbols_with_their_argument_types() -> None:
    library = _FakeLibcuda()
    calls = DriverCalls(bindings=None, libcuda=library)
    assert calls.cuMemcpyDtoDAsync is library.symbols["cuMemcpyDtoDAsync_v2"]
    assert calls.cuStreamWriteValue64 is library.symbols["cuStreamWriteValue64_v2"]
    copy = library.symbols["cuMemcpyDtoDAsync_v2"]
    assert copy.argtypes == (ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p)
    for symbol in ("cuEventRecord", "cuStreamWaitEvent", "cuGraphLaunch", "cuGraphExecDestroy"):
        assert library.symbols[symbol].restype is ctypes.c_int
        assert library.symbols[symbol].argtypes[0] is ctypes.c_void_p   # a handle, passed as an int


def test_failure_names_the_cuda_result() -> None:
    calls = DriverCalls(bindings=None, libcuda=_FakeLibcuda())
    calls.check(0, "event record")
    with pytest.raises(DriverError, match=r"graph launch failed: CUDA_ERROR_INVALID_HANDLE \(400\)") as raised:
        calls.check(400, "graph launch")
    assert raised.value.code == 400
    with pytest.raises(DriverError, match=r"stream wait failed: unknown CUresult \(12345\)"):
        calls.check(12345, "stream wait")


def _graph_streams(monkeypatch: pytest.MonkeyPatch, library: _FakeLibcuda) -> PeerStreams:
    """Side streams as after a capture (events 11 and 12, side stream 7), on caller stream 5."""
    monkeypatch.setattr(side_streams, "raw_current_stream", lambda: 5)
    streams = PeerStreams(torch.device("cpu"))
    streams.driver = DriverCalls(bindings=None, libcuda=library)
    streams._graph_events, streams._graph_stream = (11, 12), 7
    return streams


def test_graph_fork_and_join_are_five_driver_calls_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    library = _FakeLibcuda()
    streams = _graph_streams(monkeypatch, library)
    streams.fork_graph(99, 5)
    streams.join(5)
    assert library.calls == [("cuEventRecord", 11, 5), ("cuStreamWaitEvent", 7, 11, 0), ("cuGraphLaunch", 99, 7),
                             ("cuEventRecord", 12, 7), ("cuStreamWaitEvent", 5, 12, 0)]
    streams.fork_graph(99, 5)
    streams.join()   # the current stream's handle looked up: the same caller
    assert library.calls[5:] == library.calls[:5]
    streams.join()   # nothing forked since: no call
    assert len(library.calls) == 10


def test_failed_graph_launch_raises_and_stops_the_fork(monkeypatch: pytest.MonkeyPatch) -> None:
    library = _FakeLibcuda()
    streams = _graph_streams(monkeypatch, library)
    library.results = [0, 0, 1]
    with pytest.raises(DriverError, match="graph launch failed: CUDA_ERROR_INVALID_VALUE"):
        streams.fork_graph(99, 5)
    assert [call[0] for call in library.calls] == ["cuEventRecord", "cuStreamWaitEvent", "cuGraphLaunch"]


def test_cuda_bindings_failure_names_the_cuda_result() -> None:
    import enum

    from tritonep.runtime.driver_calls import driver_result

    class CUresult(enum.IntEnum):   # how cuda-bindings returns a status
        CUDA_SUCCESS = 0
        CUDA_ERROR_NOT_PERMITTED = 800

    assert driver_result((CUresult.CUDA_SUCCESS, "graph"), "graph instantiation") == "graph"
    assert driver_result((CUresult.CUDA_SUCCESS,), "graph destruction") is None
    with pytest.raises(DriverError, match=r"graph capture failed: CUDA_ERROR_NOT_PERMITTED \(800\)"):
        driver_result((CUresult.CUDA_ERROR_NOT_PERMITTED, None), "graph capture")
