"""The kernels' names in a profiler trace are what tools written for DeepEP look for.

DeepEP's ``bench_kineto`` (its test utilities) profiles a function with torch.profiler, and for
each name it is given ("dispatch", "combine") requires that exactly one row of the profiler's
table contains the name, then reads that row's time and launch count; with
``num_kernels_per_period`` (hook mode: a send and a receive launch per call) it splits the
trace's events whose name contains ``::dispatch`` by their place in the period. Our kernels are
named ``tritonep::<namespace>::<name>`` (``tritonep/runtime/kernel_names.py``).

On CPUs: every name is a valid C++ name that the C++ runtime's demangler (the one the profiler
uses) gives back, and within each mode only the dispatch kernel's name holds "dispatch" and
only the combine kernel's "combine". That each compiled kernel carries its name as its PTX
entry is checked where the kernels are compiled for sm_90 (tests/test_kernels_compile.py). On
a GPU: the calls profiled as bench_kineto profiles them, names asserted as it asserts them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import tempfile
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from tritonep.backends.nvlink.low_latency.clean_kernel import low_latency_clean_kernel
from tritonep.backends.nvlink.low_latency.combine_kernel import low_latency_combine_kernel
from tritonep.backends.nvlink.low_latency.dispatch_kernel import low_latency_dispatch_kernel
from tritonep.backends.nvlink.normal.combine_copy_engine import combine_piece_signal_kernel, combine_weights_kernel
from tritonep.backends.nvlink.normal.combine_kernel import combine_kernel
from tritonep.backends.nvlink.normal.dispatch_copy_engine import arrival_wait_kernel
from tritonep.backends.nvlink.normal.dispatch_kernel import dispatch_kernel
from tritonep.backends.nvlink.normal.expert_layout_kernel import expert_layout_kernel
from tritonep.backends.nvlink.normal.layout_kernel import dispatch_layout_kernel
from tritonep.backends.nvlink.normal.notify_kernel import notify_dispatch_kernel
from tritonep.runtime.kernel_names import mangled

# The kernels a mode's calls launch, by mode: within a mode, a name DeepEP's tools look for
# must match one kernel.
NORMAL_KERNELS = (dispatch_layout_kernel, notify_dispatch_kernel, dispatch_kernel, combine_kernel,
                  combine_weights_kernel, combine_piece_signal_kernel, expert_layout_kernel, arrival_wait_kernel)
LOW_LATENCY_KERNELS = (low_latency_dispatch_kernel, low_latency_combine_kernel, low_latency_clean_kernel)
NAMESPACES = {"normal": "tritonep::intranode", "low_latency": "tritonep::low_latency"}


def demangle(symbol: str) -> str | None:
    """``symbol`` demangled by the C++ runtime's ``__cxa_demangle`` (what the profiler calls),
    or None where it is not a mangled name."""
    library = ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6")
    library.__cxa_demangle.restype = ctypes.c_void_p
    status = ctypes.c_int()
    text = library.__cxa_demangle(symbol.encode(), None, None, ctypes.byref(status))
    if status.value != 0 or not text:
        return None
    try:
        return ctypes.string_at(text).decode()
    finally:
        ctypes.CDLL(None).free(ctypes.c_void_p(text))


@pytest.mark.parametrize("kernel", NORMAL_KERNELS + LOW_LATENCY_KERNELS, ids=lambda kernel: kernel.__name__)
def test_each_kernel_name_demangles_to_its_qualified_name(kernel) -> None:
    assert kernel.profiler_name.startswith("tritonep::")
    assert demangle(mangled(kernel.profiler_name)) == kernel.profiler_name
    assert demangle(kernel.__name__) is None   # the Python name would show as it is


@pytest.mark.parametrize("mode,kernels", [("normal", NORMAL_KERNELS), ("low_latency", LOW_LATENCY_KERNELS)])
def test_dispatch_and_combine_each_match_one_kernel_of_a_mode(mode: str, kernels: tuple) -> None:
    names = [kernel.profiler_name for kernel in kernels]
    assert len(set(names)) == len(names)
    for wanted in ("dispatch", "combine"):
        assert [name for name in names if wanted in name] == [f"{NAMESPACES[mode]}::{wanted}"], names


def test_names_that_are_not_cpp_names_are_refused() -> None:
    assert mangled("a::bc") == "_ZN1a2bcE"
    for bad in ("dispatch", "tritonep::", "tritonep::low latency::dispatch", "tritonep::dispatch<1>"):
        with pytest.raises(ValueError, match="namespace"):
            mangled(bad)


# ----------------------------------------------------------------------------- on a GPU
CALLS = 4


def kineto(fn: Callable[[], object], calls: int) -> tuple[list[str], list[dict]]:
    """``fn`` profiled as DeepEP's bench_kineto profiles it (CUDA activity, a discarded warm-up
    step, then ``calls`` calls): the rows of the profiler's table and the trace's events."""
    from torch.profiler import ProfilerActivity, profile, schedule

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA], schedule=schedule(wait=0, warmup=1, active=1, repeat=1),
                 acc_events=True) as profiler:
        for _ in range(2):
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            profiler.step()
    rows = profiler.key_averages().table(sort_by="cuda_time_total", max_name_column_width=100).split("\n")
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        profiler.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return rows, events


def findable(rows: list[str], events: list[dict], name: str, namespace: str, launches_per_call: int | None,
             calls: int, what: str) -> list[str]:
    """What would stop bench_kineto from finding ``name``: not exactly one table row holding
    it, a row that is not ``namespace::name``, a launch count that is not a whole number of
    launches per call (``launches_per_call`` of them, when given), or trace events holding
    ``::name`` in another number (bench_kineto's split of a period)."""
    matching = [row for row in rows if name in row]
    if len(matching) != 1:
        return [f"{what}: {len(matching)} rows of the profiler's table hold {name!r}: {matching}"]
    fields = matching[0].split()
    problems = []
    if fields[0] != f"{namespace}::{name}":
        problems.append(f"{what}: the kernel is called {fields[0]!r}, not {namespace}::{name}")
    launches = int(fields[-1])
    if launches % calls or not launches or (launches_per_call and launches != launches_per_call * calls):
        problems.append(f"{what}: {launches} launches of {fields[0]} for {calls} calls")
    in_period = [event for event in events if f"::{name}" in event.get("name", "")]
    if len(in_period) != launches:
        problems.append(f"{what}: {len(in_period)} trace events hold '::{name}', the table counts {launches}")
    return problems


def profiled_names(group: dist.ProcessGroup) -> list[str]:
    """Every call of both APIs and both modes, profiled; what bench_kineto would trip over."""
    import tritonep as deep_ep

    R, T, H, E, K = group.size(), 32, 1024, 8 * group.size(), 4
    device = torch.device("cuda", torch.cuda.current_device())
    cpu = dict(generator=torch.Generator().manual_seed(group.rank()), dtype=torch.float32, device="cpu")
    x = torch.randn(T, H, **cpu).to(torch.bfloat16).to(device)
    topk_idx = torch.rand(T, E, **cpu).topk(K, dim=1).indices.to(device)
    weights = torch.rand(T, K, **cpu).to(device)
    problems: list[str] = []

    decode = deep_ep.Buffer(group, 0, deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, R, E),
                            low_latency_mode=True, num_qps_per_rank=E // R, explicitly_destroy=True)
    packed = decode.low_latency_dispatch(x, topk_idx, T, E)[0]
    expert_out = torch.randn(packed[0].shape, **cpu).to(torch.bfloat16).to(device)

    def decode_step(hook: bool) -> None:   # DeepEP's low-latency test_func, without its GEMMs
        _, _, handle, _, receive = decode.low_latency_dispatch(x, topk_idx, T, E, use_fp8=True,
                                                               return_recv_hook=hook)
        if hook:
            receive()
        _, _, receive = decode.low_latency_combine(expert_out, topk_idx, weights, handle, return_recv_hook=hook)
        if hook:
            receive()

    try:
        for hook in (False, True):
            rows, events = kineto(lambda hook=hook: decode_step(hook), CALLS)
            for name in ("dispatch", "combine"):
                problems += findable(rows, events, name, NAMESPACES["low_latency"], 2 if hook else 1, CALLS,
                                     f"low-latency {name}{', hook mode' if hook else ''}")
        rows, _ = kineto(lambda: decode.clean_low_latency_buffer(T, H, E), CALLS)
        if not any(row.split()[:1] == ["tritonep::low_latency::clean_buffer"] for row in rows):
            problems.append(f"clean_low_latency_buffer: no tritonep::low_latency::clean_buffer row in {rows}")
        problems += [f"clean_low_latency_buffer: a row holds {name!r}" for name in ("dispatch", "combine")
                     if any(name in row for row in rows)]
    finally:
        decode.destroy()

    v1 = deep_ep.Buffer(group, num_nvl_bytes=deep_ep.nvl_bytes_for(T, H, R), explicitly_destroy=True)
    v2 = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=T, hidden=H, num_topk=K, explicitly_destroy=True)

    def v1_fresh() -> tuple:
        per_rank, _, per_expert, in_rank, _ = v1.get_dispatch_layout(topk_idx, E)
        return v1.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                           topk_idx=topk_idx, topk_weights=weights)

    def v2_fresh(**options: object) -> tuple:
        return v2.dispatch(x, topk_idx=topk_idx, topk_weights=weights, num_experts=E, **options)

    recv_x1, _, _, _, handle1, _ = v1_fresh()
    recv_x2, _, recv_weights2, handle2, _ = v2_fresh()
    calls = {
        "V1 fresh dispatch (layout included)": (v1_fresh, "dispatch"),
        "V1 cached dispatch": (lambda: v1.dispatch(x, handle=handle1), "dispatch"),
        "V1 combine": (lambda: v1.combine(recv_x1, handle1), "combine"),
        "V2 fresh dispatch": (v2_fresh, "dispatch"),
        "V2 dispatch without CPU sync, expanded": (lambda: v2_fresh(do_cpu_sync=False, do_expand=True), "dispatch"),
        "V2 cached dispatch": (lambda: v2.dispatch(x, handle=handle2), "dispatch"),
        "V2 combine": (lambda: v2.combine(recv_x2, handle2, topk_weights=recv_weights2), "combine"),
    }
    try:
        for what, (call, name) in calls.items():
            rows, events = kineto(call, CALLS)
            problems += findable(rows, events, name, NAMESPACES["normal"], None, CALLS, what)
            other = "combine" if name == "dispatch" else "dispatch"
            problems += [f"{what}: a row holds {other!r}: {row}" for row in rows if other in row]
    finally:
        v1.destroy()
        v2.destroy()
    return problems


@pytest.mark.gpu(min_gpus=1)
def test_gpu_profiler_finds_each_call_as_deepeps_bench_kineto_does() -> None:
    from gpu_pools import own_gpu_pool

    with own_gpu_pool(1, "the profiler test's GPU rank") as pool:   # (its kernels listed for the next session)
        assert pool.run(profiled_names) == [[]]
