"""The copy-engine side work's graphs on GPUs: results and host work (run on every rank of a pool).

A combine replay captures its copy-engine side work as a CUDA graph once a call repeats the
last call's input addresses, and a cached dispatch received on the copy engines once a call's
outputs land where the last call's did (``replay.py``); each forks its graph afterwards.
``graph_combines`` checks the results against the CPU backend while the addresses stay,
change, come back and outnumber the graphs a replay keeps; ``graph_cached_dispatches`` does
the same for cached dispatches, and counts their graph launches and copies;
``combine_host_calls`` lists the CUDA calls that one replayed combine makes with a graph and
without one: the runtime calls and kernel launches the profiler records, and the driver calls
made through cuda-bindings, which the profiler leaves out (counted by a stand-in for the driver
module that passes each call on).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import torch
import torch.distributed as dist
from deep_ep_user import dispatch_with_layout
from nvlink_cases import Case, bf16_mismatch, combine_rounding, make_inputs, shared_buffers

import tritonep as deep_ep
from tritonep.utils import per_token_cast_to_fp8


def _dispatched(buffer: deep_ep.Buffer, inputs: dict, case: Case, device: torch.device) -> tuple:
    """(recv_x, recv_topk_weights, handle) of a fresh dispatch of ``inputs`` on ``buffer``."""
    recv_x, _, recv_weights, _, handle, _ = dispatch_with_layout(
        buffer, inputs["x"].to(device), inputs["topk_idx"].to(device), inputs["topk_weights"].to(device),
        case.num_experts, config=deep_ep.Config(case.num_sms))
    return recv_x, recv_weights, handle


def _graph_case(group: dist.ProcessGroup) -> Case:
    tokens = tuple(1500 if rank % 2 == 0 else 900 for rank in range(group.size()))
    return Case(seed=404, tokens=tokens, hidden=4096, num_experts=16 * group.size(), num_topk=8, num_sms=24)


def graph_combines(group: dist.ProcessGroup, nvl_bytes: int = 1 << 30) -> list[str]:
    """Mismatches on this rank (empty when every combine matched the CPU backend's) over
    combines with one handle: one input changed in place between calls (a graph reads what is
    there when it runs), then inputs whose addresses change, each used twice in a row (a graph
    each, more than a replay keeps), then come back; with top-k weights and without."""
    nvlink, cpu = shared_buffers(group, nvl_bytes)
    case = _graph_case(group)
    inputs = make_inputs(case, group.rank(), group.size())
    device = nvlink.device
    recv_x, recv_weights, handle = _dispatched(nvlink, inputs, case, device)
    cpu_x, cpu_weights, cpu_handle = _dispatched(cpu, inputs, case, torch.device("cpu"))
    rounding = combine_rounding(device, bias=False)
    config = deep_ep.Config(case.num_sms)
    problems = []

    def check(label: str, x: torch.Tensor, weighted: bool) -> None:
        got, got_weights, _ = nvlink.combine(x, handle, topk_weights=recv_weights if weighted else None,
                                             config=config)
        expected, expected_weights, _ = cpu.combine(x.cpu(), cpu_handle,
                                                    topk_weights=cpu_weights if weighted else None, config=config)
        mismatch = bf16_mismatch(got.cpu(), expected, rounding)
        if mismatch:
            problems.append(f"{label}: {mismatch}")
        if weighted and not torch.equal(got_weights.cpu(), expected_weights):
            problems.append(f"{label}: combined top-k weights differ")

    assert torch.equal(recv_x.cpu(), cpu_x), "the two backends dispatched different rows"
    for weighted in (True, False):
        same = recv_x.clone()
        for call in range(5):
            check(f"same input, call {call}, weights {weighted}", same, weighted)
            same.mul_(2.0)   # exact in bf16: the next call must see the new values
        others = [recv_x * 2.0 ** -k for k in range(6)]   # six live tensors: six addresses
        for k in [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 0, 0, 3]:
            check(f"input {k}, weights {weighted}", others[k], weighted)
    return problems


class CountingDriver:
    """cuda-bindings' driver module, passing each ``cu*`` call on and noting its name."""

    def __init__(self, driver: object) -> None:
        self.driver, self.calls = driver, []

    def __getattr__(self, name: str) -> object:
        value = getattr(self.driver, name)
        if not name.startswith("cu"):   # types and enums (CUresult, CUstream...)
            return value

        def counted(*args: object) -> object:
            self.calls.append(name)
            return value(*args)

        return counted


def _cuda_calls(call: Callable[[], object], driver: CountingDriver) -> list[str]:
    """The CUDA calls ``call`` makes on this thread, by name: the runtime calls and kernel
    launches the profiler records (its own calls outside the marked range left out), then the
    driver calls made through ``driver``."""
    from torch.profiler import ProfilerActivity, profile, record_function

    mark = "tritonep: call under test"
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function(mark):
            call()
        torch.cuda.synchronize()
    events = prof.events()
    window = next(event.time_range for event in events if event.name == mark)
    return [event.name for event in events
            if re.match(r"cuda[A-Z]|cu[A-Z]", event.name) and "Synchronize" not in event.name
            and window.start <= event.time_range.start and event.time_range.end <= window.end] + driver.calls


def combine_host_calls(group: dist.ProcessGroup, nvl_bytes: int = 1 << 30) -> dict[str, object]:
    """The CUDA calls of one replayed combine (with top-k weights): "graph", after calls with
    the same input; "ops", with an input at a new address (no graph: the side work op by op)."""
    nvlink, _ = shared_buffers(group, nvl_bytes)
    case = _graph_case(group)
    recv_x, recv_weights, handle = _dispatched(nvlink, make_inputs(case, group.rank(), group.size()), case,
                                               nvlink.device)
    config = deep_ep.Config(case.num_sms)
    copier = nvlink.backend.normal.copier
    # The copies and tail writes go through the copier's driver, the graphs and the fork and
    # join through its streams' (the same module): one counting stand-in for both, for this
    # function's calls.
    real = copier.driver
    assert real is not None and copier.streams.driver is real, "the combine's pieces do not go through the driver"
    counting = CountingDriver(real)

    def combine(x: torch.Tensor) -> Callable[[], object]:
        return lambda: nvlink.combine(x, handle, topk_weights=recv_weights, config=config)

    def calls_of(call: Callable[[], object]) -> list[str]:
        counting.calls = []
        copier.driver = copier.streams.driver = counting
        try:
            return _cuda_calls(call, counting)
        finally:
            copier.driver = copier.streams.driver = real

    for _ in range(4):
        combine(recv_x)()
    calls = {"graph": calls_of(combine(recv_x))}
    fresh = [recv_x.clone() for _ in range(3)]   # alive together: three addresses, none seen twice in a row
    for x in fresh[:2]:
        combine(x)()
    calls["ops"] = calls_of(combine(fresh[2]))
    calls["capture error"] = copier.streams.capture_error   # None when graphs were made
    torch.cuda.synchronize()
    dist.barrier(group=group)
    return calls


def _differing(got: torch.Tensor | tuple, expected: torch.Tensor | tuple) -> list[str]:
    """The parts of a dispatch's received x (rows, or rows and scales) that differ bit for bit."""
    pairs = zip(got, expected) if isinstance(got, tuple) else [(got, expected)]
    return [name for name, (g, e) in zip(("rows", "scales"), pairs)
            if not torch.equal(g.cpu().view(torch.uint8), e.view(torch.uint8))]


def graph_cached_dispatches(group: dist.ProcessGroup, nvl_bytes: int = 1 << 30) -> dict[str, object]:
    """Cached dispatches with one handle, received on the copy engines, bf16 and fp8, each on
    new inputs: first with each call's outputs dropped before the next (the allocator hands
    their blocks back: one address, a graph from the third call), then with the outputs kept
    alive (new addresses: the side work op by op, but for a first call that may land where the
    last phase's outputs did). Returns this rank's mismatches against the
    CPU backend, and each call's driver calls by phase (a capture's copies among them: the
    driver is called while the stream records)."""
    nvlink, cpu = shared_buffers(group, nvl_bytes)
    backend = nvlink.backend
    default = backend.tuning
    backend.tuning = dataclasses.replace(default, copy_engine_dispatch=2)   # from 2 ranks on
    case = _graph_case(group)
    inputs = make_inputs(case, group.rank(), group.size())
    device = nvlink.device
    config = deep_ep.Config(case.num_sms)
    copier = backend.normal.dispatch_copier
    real = copier.driver
    counting = CountingDriver(real)
    problems: list[str] = []
    calls: dict[str, list[list[str]]] = {}
    try:
        _, _, handle = _dispatched(nvlink, inputs, case, device)
        _, _, cpu_handle = _dispatched(cpu, inputs, case, torch.device("cpu"))
        copier.driver = copier.streams.driver = counting
        for fp8 in (False, True):
            for phase, count in (("same address", 6), ("kept alive", 3)):
                # Every input made first, so that only the outputs come and go in the loop.
                xs = [inputs["x"] * 2.0 ** -call for call in range(count)]   # exact in bf16 and fp8 scales
                xs_in = [per_token_cast_to_fp8(x.to(device)) if fp8 else x.to(device) for x in xs]
                kept, per_call = [], []
                for call, (x, x_in) in enumerate(zip(xs, xs_in)):
                    x_cpu = tuple(t.cpu() for t in x_in) if fp8 else x
                    counting.calls = []
                    got = nvlink.dispatch(x_in, handle=handle, config=config)[0]
                    per_call.append(counting.calls)
                    expected = cpu.dispatch(x_cpu, handle=cpu_handle, config=config)[0]
                    problems += [f"{phase}, fp8 {fp8}, call {call}: {name} differ"
                                 for name in _differing(got, expected)]
                    if phase == "kept alive":
                        kept.append(got)
                    del got   # (no other reference: its block goes back to the allocator)
                calls[f"{phase}, fp8 {fp8}"] = per_call
        torch.cuda.synchronize()
    finally:
        copier.driver = copier.streams.driver = real
        backend.tuning = default
    dist.barrier(group=group)
    return {"problems": problems, "calls": calls, "capture error": copier.streams.capture_error}
