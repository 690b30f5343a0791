"""Where a low-latency call's host time goes, layer by layer, at one rank: the CUDA launch
itself (an empty Triton kernel with as many arguments, launched five ways: Triton's binder,
FastLauncher, Triton's compiled launcher alone, the driver through cuda-bindings and through
ctypes), then the dispatch and combine through the engine, the backend and the Buffer (the
Buffer's repeats take the fast path; ``general_path_*``: the same calls with it off;
``*_after_profiler``: again after one torch.profiler session). CPU microseconds per call,
median of rounds of 20 calls (synchronised between rounds, so the GPU never backs the host up).

    PYTHONPATH=. python scripts/launch_cost_probe.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
import triton
import triton.language as tl

import tritonep as deep_ep
from tritonep.backends.base import LowLatencyDispatchRequest
from tritonep.bench_timing import back_to_back_host_us as host_us  # the host-path probe's rounds
from tritonep.rank_pool import RankPool
from tritonep.runtime.launcher import FastLauncher, current_stream


@triton.jit(do_not_specialize=["a1", "a2", "a3", "a4", "a5", "a6", "a7", "a8"])
def empty_kernel(p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14,
                 a1, a2, a3, a4, a5, a6, a7, a8, FLAG: tl.constexpr):
    """As many pointers and ints as the low-latency dispatch; does nothing."""
    if FLAG:
        tl.store(p0, a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8)


def _cuda_bindings_launcher(setup: object, pointers: list, ints: list, stream: int) -> object:
    """The same compiled kernel launched through cuda-bindings' ``cuLaunchKernel`` with its
    parameter array packed once (Triton's signature: the pointers, the i32s, then its two
    scratch pointers): what a launch costs without Triton's argument parsing."""
    import ctypes

    from cuda.bindings import driver

    values = [ctypes.c_uint64(p.data_ptr()) for p in pointers] + [ctypes.c_int32(v) for v in ints] \
        + [ctypes.c_uint64(0), ctypes.c_uint64(0)]
    params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    function, cu_stream = driver.CUfunction(setup.function), driver.CUstream(stream)
    num_warps, _, shared = setup.metadata
    address = ctypes.addressof(params)

    def launch() -> None:
        driver.cuLaunchKernel(function, 132, 1, 1, 32 * num_warps, 1, 1, shared, cu_stream, address, 0)

    (result,) = driver.cuLaunchKernel(function, 132, 1, 1, 32 * num_warps, 1, 1, shared, cu_stream, address, 0)
    torch.cuda.synchronize()
    if result != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuLaunchKernel: {result}")
    launch.keep_alive = (values, params)   # type: ignore[attr-defined]
    return launch


def _ctypes_launcher(setup: object, pointers: list, ints: list, stream: int) -> object:
    """The same compiled kernel launched by calling the driver's ``cuLaunchKernel`` through
    ctypes: one 8-byte slot per parameter (Triton's order: the pointers, the i32s, its two
    scratch pointers), made once; each call writes the three arguments that change (p0, p1,
    a1), as a repeated launch would, then launches."""
    import ctypes

    values = [p.data_ptr() for p in pointers] + list(ints) + [0, 0]
    slots = (ctypes.c_uint64 * len(values))(*values)
    base = ctypes.addressof(slots)
    params = (ctypes.c_void_p * len(values))(*[base + 8 * i for i in range(len(values))])
    launch_kernel = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
    launch_kernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    launch_kernel.restype = ctypes.c_int
    num_warps, _, shared = setup.metadata
    function, block, p0, p1 = setup.function, 32 * num_warps, pointers[0].data_ptr(), pointers[1].data_ptr()

    def launch() -> None:
        slots[0] = p0
        slots[1] = p1
        slots[15] = 1
        launch_kernel(function, 132, 1, 1, block, 1, 1, shared, stream, params, None)

    if launch_kernel(function, 132, 1, 1, block, 1, 1, shared, stream, params, None) != 0:
        raise RuntimeError("cuLaunchKernel through ctypes failed")
    torch.cuda.synchronize()
    launch.keep_alive = (slots, params)   # type: ignore[attr-defined]
    return launch


def run(group: dist.ProcessGroup) -> dict:
    device = torch.device("cuda", torch.cuda.current_device())
    report: dict = {}
    pointers = [torch.zeros(16, device=device) for _ in range(15)]
    ints = list(range(1, 9))
    report["torch_add_"] = host_us(lambda: pointers[0].add_(1))
    report["triton_kernel[grid]"] = host_us(lambda: empty_kernel[(132,)](*pointers, *ints, FLAG=False))
    fast = FastLauncher(empty_kernel, changing=("p0", "p1", "a1"))
    args = (*pointers, *ints)
    report["fast_launcher"] = host_us(lambda: fast(132, "setup", args, {"FLAG": False}, 4))
    (setup,) = fast.setups.values()
    stream = current_stream()
    report["compiled_launch_only"] = host_us(lambda: setup(stream))
    report["current_stream"] = host_us(current_stream)
    try:
        report["cuda_bindings_launch"] = host_us(_cuda_bindings_launcher(setup, pointers, ints, stream))
    except Exception as error:   # noqa: BLE001 (a measurement, not a dependency)
        print(f"cuda-bindings launch not measured: {error!r}")
    try:
        report["ctypes_launch_3_args_written"] = host_us(_ctypes_launcher(setup, pointers, ints, stream))
    except Exception as error:   # noqa: BLE001 (a measurement, not a dependency)
        print(f"ctypes launch not measured: {error!r}")

    T, H, K, E = 128, 7168, 8, 288
    buffer = deep_ep.Buffer(group, 0, deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, 1, E),
                            low_latency_mode=True, explicitly_destroy=True)
    x = torch.randn(T, H, device=device).to(torch.bfloat16)
    topk_idx = torch.randn(T, E, device=device).topk(K, dim=1).indices
    weights = torch.rand(T, K, device=device)
    packed, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, T, E)
    y = torch.randn(packed[0].shape, device=device).to(torch.bfloat16)
    engine = buffer.backend.low_latency
    request = LowLatencyDispatchRequest(x, topk_idx, T, E, True, False, False, None, None, False)
    report["engine_dispatch"] = host_us(lambda: engine.dispatch(request))
    report["buffer_dispatch"] = host_us(lambda: buffer.low_latency_dispatch(x, topk_idx, T, E))
    report["buffer_dispatch_send_then_hook"] = host_us(
        lambda: buffer.low_latency_dispatch(x, topk_idx, T, E, return_recv_hook=True)[4]())
    report["engine_combine"] = host_us(lambda: engine.combine(y, topk_idx, weights, handle, False, False, None))
    report["buffer_combine"] = host_us(lambda: buffer.low_latency_combine(y, topk_idx, weights, handle))
    out = torch.empty(T, H, dtype=torch.bfloat16, device=device)
    report["buffer_combine_out"] = host_us(lambda: buffer.low_latency_combine(y, topk_idx, weights, handle, out=out))
    report["buffer_combine_send_then_hook"] = host_us(
        lambda: buffer.low_latency_combine(y, topk_idx, weights, handle, return_recv_hook=True)[2]())
    report["torch_empty_like_combine_out"] = host_us(
        lambda: torch.empty(T, H, dtype=torch.bfloat16, device=device))
    if hasattr(engine, "fast_dispatch"):   # (a package from before the fast path has none)
        # The same calls with the fast path (backends/nvlink/low_latency_fast.py) off.
        fast_paths = engine.fast_dispatch, engine.fast_combine
        engine.fast_dispatch, engine.fast_combine = {}, {}
        buffer._fast_dispatch, buffer._fast_combine = {}, {}
        report["general_path_buffer_dispatch"] = host_us(lambda: buffer.low_latency_dispatch(x, topk_idx, T, E))
        report["general_path_buffer_combine"] = host_us(
            lambda: buffer.low_latency_combine(y, topk_idx, weights, handle))
        engine.fast_dispatch, engine.fast_combine = fast_paths
        buffer._fast_dispatch, buffer._fast_combine = fast_paths
    # The same calls again after one torch.profiler session with CUDA activity (the bench
    # profiles kernels): does the profiler leave every later launch dearer?
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]):
        for _ in range(10):
            buffer.low_latency_combine(y, topk_idx, weights, handle)
        torch.cuda.synchronize()
    report["torch_add__after_profiler"] = host_us(lambda: pointers[0].add_(1))
    report["compiled_launch_only_after_profiler"] = host_us(lambda: setup(stream))
    report["buffer_dispatch_after_profiler"] = host_us(lambda: buffer.low_latency_dispatch(x, topk_idx, T, E))
    report["buffer_combine_after_profiler"] = host_us(lambda: buffer.low_latency_combine(y, topk_idx, weights, handle))
    buffer.destroy()
    return {name: round(us, 2) for name, us in report.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    with RankPool(1, use_gpu=True, timeout=300) as pool:
        (report,) = pool.run(run)
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
