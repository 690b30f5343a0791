"""The low-latency replays (tritonep/backends/nvlink/low_latency/replay.py) launch exactly what
the general path launches, and return the same results.

Under Triton's interpreter the NVLink engine makes no compiled launches, so nothing would be
learnt. Here the launches are recorded instead of run: the kernels are replaced by a stand-in
that compiles nothing, and each compiled launch snapshots its raw argument list when called.
Every call of a sequence then runs twice from the same host state (call counters, pending
hooks, zero-copy buffer: the engine's ``LowLatencyCalls``): with the Buffer's replay table as
the calls so far left it, then with an empty one (the general path); the recorded launches
(with their hooks' launches), the results and the state after must be equal. The kernels
themselves are checked by the other low-latency tests, on the interpreter and the GPUs, where
repeated calls are replayed.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import weakref
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from recorded_launches import RecordedLaunch, launches_faked

import tritonep as deep_ep
from tritonep.backends.nvlink.low_latency.call_order import CallOrder, LowLatencyCalls
from tritonep.core.checks import InputError
from tritonep.core.replay import ReplayTable

T, HIDDEN, NUM_EXPERTS, NUM_TOPK = 8, 512, 8, 3
# Tokens per call: the first LEARNING_CALLS run the general path (both slots of both counts),
# the rest are compared; the two counts alternate so that a count left in a shared launch shows.
TOKENS, LEARNING_CALLS = (7, 7, 5, 5, 7, 5, 5, 7, 5, 7), 4

# (dispatch options, combine options): each runs for 6 calls (the first two learn the slots).
SEQUENCES = [
    (dict(use_fp8=True), dict()),
    (dict(use_fp8=False, return_recv_hook=True), dict(return_recv_hook=True)),
    (dict(use_fp8=True, round_scale=True, use_ue8m0=True, stats=True), dict(zero_copy=True, out=True)),
    (dict(use_fp8=True, wait_stats=True), dict(wait_stats=True, return_recv_hook=True, out=True)),
]


def _host_state(calls: LowLatencyCalls) -> tuple:
    return (calls.dispatch_order.sent, dict(calls.dispatch_order.pending), calls.combine_order.sent,
            dict(calls.combine_order.pending), calls.combine_buffer_index)


def _set_host_state(calls: LowLatencyCalls, state: tuple) -> None:
    (calls.dispatch_order.sent, pending_dispatch, calls.combine_order.sent, pending_combine,
     calls.combine_buffer_index) = state
    calls.dispatch_order.pending = dict(pending_dispatch)
    calls.combine_order.pending = dict(pending_combine)


def _summary(value: object) -> object:
    """What a call returned, comparable across the two paths: tensors by identity and address."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.data_ptr(), tuple(value.shape), value.dtype)
    if isinstance(value, deep_ep.EventOverlap):
        return ("event", value.event)
    if callable(value):
        return "hook"
    if isinstance(value, tuple):
        summary = tuple(_summary(item) for item in value)
        state = getattr(value, "backend_state", None)
        if state is not None:
            summary += (_summary(state.topk_slot), _summary(state.dispatch_mask), state.received)
        return summary
    return value


def _both_paths(buffer: deep_ep.Buffer, call: Callable[[], tuple]) -> tuple[tuple, tuple, tuple]:
    """``call`` (and its hook) run twice from the same host state: with the Buffer's replay table
    as the calls so far left it, then with an empty one (the general path; that table, with what
    the run learnt, is dropped after). Returns (replayed run, general run, the general run's
    result); a run is (launches, result summary, host state after)."""
    calls = buffer.backend.low_latency.calls
    before = _host_state(calls)
    replays = buffer._low_latency_replays
    runs = []
    for replayed in (True, False):
        _set_host_state(calls, before)
        buffer._low_latency_replays = replays if replayed else ReplayTable()
        RecordedLaunch.log = []
        try:
            result = call()
            if result[-1] is not None:
                result[-1]()
        finally:
            buffer._low_latency_replays = replays
        runs.append((list(RecordedLaunch.log), _summary(result), _host_state(calls)))
    return runs[0], runs[1], result


def _sequence(buffer: deep_ep.Buffer, dispatch_options: dict, combine_options: dict,
              generator: torch.Generator) -> list[str]:
    """Dispatch + combine rounds of one set of options: four that learn the two slots of two token
    counts (which share compiled launches), then six with each call through both paths."""
    R, problems = buffer.group_size, []
    dispatch_options, combine_options = dict(dispatch_options), dict(combine_options)
    stats, wait = dispatch_options.pop("stats", False), dispatch_options.pop("wait_stats", False)
    use_out = combine_options.pop("out", False)
    combine_wait = combine_options.pop("wait_stats", False)
    for call_index, tokens in enumerate(TOKENS):
        x = torch.randn(tokens, HIDDEN, generator=generator).to(torch.bfloat16)
        topk_idx = torch.rand(tokens, NUM_EXPERTS, generator=generator).topk(NUM_TOPK, dim=1).indices
        weights = torch.rand(tokens, NUM_TOPK, generator=generator, dtype=torch.float32)
        out = torch.empty(tokens, HIDDEN, dtype=torch.bfloat16) if use_out else None
        recv_stats = torch.zeros(NUM_EXPERTS // R, dtype=torch.int32) if stats else None
        wait_stats = torch.zeros(R, dtype=torch.int64) if wait else None
        dispatch = functools.partial(buffer.low_latency_dispatch, x, topk_idx, T, NUM_EXPERTS, recv_stats,
                                     wait_stats, **dispatch_options)
        if call_index < LEARNING_CALLS:
            result = dispatch()
            if result[-1] is not None:
                result[-1]()
        else:
            replayed, general, result = _both_paths(buffer, dispatch)
            if replayed != general:
                problems.append(f"dispatch {dispatch_options} call {call_index}: replayed {replayed} != general "
                                f"{general}")
        handle = result[2]   # received: _both_paths ran its hook
        expert_rows = torch.randn(NUM_EXPERTS // R, R * T, HIDDEN, generator=generator).to(torch.bfloat16)
        if combine_options.get("zero_copy"):
            buffer.get_next_low_latency_combine_buffer(handle).copy_(expert_rows)
        combine = functools.partial(buffer.low_latency_combine, expert_rows, topk_idx, weights, handle, out=out,
                                    combine_wait_recv_cost_stats=torch.zeros(R, dtype=torch.int64)
                                    if combine_wait else None, **combine_options)
        if call_index < LEARNING_CALLS:
            hook = combine()[-1]
            if hook is not None:
                hook()
            continue
        replayed, general, _ = _both_paths(buffer, combine)
        if replayed != general:
            problems.append(f"combine {combine_options} call {call_index}: replayed {replayed} != general {general}")
    return problems


def _hooks_keep_inputs(buffer: deep_ep.Buffer, generator: torch.Generator) -> list[str]:
    """A replayed call's receive hook keeps the call's tensors alive: the receive half reads some of
    them (a combine's top-k weights), and two micro-batches drop theirs before the hooks run.
    SEQUENCES[1] (bf16, hooks) has learnt both slots for 7 tokens."""
    R, problems = buffer.group_size, []
    x = torch.randn(7, HIDDEN, generator=generator).to(torch.bfloat16)
    topk_idx = torch.rand(7, NUM_EXPERTS, generator=generator).topk(NUM_TOPK, dim=1).indices
    weights = torch.rand(7, NUM_TOPK, generator=generator, dtype=torch.float32)
    _, _, handle, _, hook = buffer.low_latency_dispatch(x, topk_idx, T, NUM_EXPERTS, use_fp8=False,
                                                        return_recv_hook=True)
    references = [weakref.ref(x), weakref.ref(topk_idx)]
    del x
    gc.collect()
    problems += [f"dispatch hook let input {i} go" for i, ref in enumerate(references) if ref() is None]
    hook()
    expert_rows = torch.randn(NUM_EXPERTS // R, R * T, HIDDEN, generator=generator).to(torch.bfloat16)
    _, _, hook = buffer.low_latency_combine(expert_rows, topk_idx, weights, handle, return_recv_hook=True)
    references = [weakref.ref(expert_rows), weakref.ref(topk_idx), weakref.ref(weights)]
    del expert_rows, topk_idx, weights
    gc.collect()
    problems += [f"combine hook let input {i} go" for i, ref in enumerate(references) if ref() is None]
    hook()
    return problems


@contextlib.contextmanager
def launches_replaced(buffer: deep_ep.Buffer, setup: type) -> Iterator[None]:
    """Inside, ``buffer``'s low-latency engine learns and replays compiled launches as on a GPU,
    but each is a ``setup`` (``RecordedLaunch``, or one that does nothing) and nothing is compiled
    or run (``recorded_launches.launches_faked``); on exit the Buffer's replays are dropped too."""
    from tritonep.backends.nvlink.low_latency import launch, replay

    engine = buffer.backend.low_latency
    fast_launchers = (engine.dispatch_launcher.fast_launcher, engine.combine_launcher.fast_launcher)
    # A single launch's grid is capped at what the compiled kernel lets the GPU hold: no kernel here.
    with launches_faked(fast_launchers, setup, (replay,), [(launch, "INTERPRET", False), (
            launch, "resident_programs", lambda kernel, args, constants, warps, device, wanted: wanted)]):
        yield
    buffer._low_latency_replays.clear()


def replays_match_general_path(group: dist.ProcessGroup) -> list[str]:
    from nvlink_cases import count_replays, make_buffer

    size = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, HIDDEN, group.size(), NUM_EXPERTS)
    buffer = make_buffer(group, "nvlink", num_rdma_bytes=size, low_latency_mode=True, explicitly_destroy=True)
    problems: list[str] = []
    try:
        with launches_replaced(buffer, RecordedLaunch), count_replays() as taken:
            generator = torch.Generator().manual_seed(group.rank())
            for dispatch_options, combine_options in SEQUENCES:
                problems += _sequence(buffer, dispatch_options, combine_options, generator)
            problems += _hooks_keep_inputs(buffer, generator)
    finally:
        buffer.destroy()
    # Every compared call is replayed: each of the dispatch's and the combine's replays can serve
    # only these calls (a learning call finds its slot not learnt yet), so the total says both.
    expected = (len(TOKENS) - LEARNING_CALLS) * len(SEQUENCES) + 1   # + _hooks_keep_inputs's
    if taken != {"cached_dispatch": 0, "combine": 0, "low_latency": 2 * expected}:
        problems.append(f"replays served {taken}, expected {expected} dispatches and {expected} combines")
    return problems


def test_replays_launch_what_the_general_path_launches(nvlink_host_pools) -> None:
    problems = nvlink_host_pools(1).run(replays_match_general_path)
    assert problems == [[]]


def test_call_order_alternates_slots_and_holds_those_awaiting_hooks() -> None:
    """The host bookkeeping a replay inlines (``CallOrder.start``): slots alternate, a third call
    awaiting its hook would reuse a held slot, and a hook runs once."""
    order = CallOrder("low_latency_dispatch")
    assert [order.start(with_hook=True) for _ in range(2)] == [(1, 0), (2, 1)]
    with pytest.raises(InputError, match="call 1 still awaits its receive hook"):
        order.start(with_hook=False)
    order.finish(1, 0)
    assert order.start(with_hook=False) == (3, 0) and order.pending == {1: 2}
    with pytest.raises(InputError, match="already called"):
        order.finish(1, 0)


def combine_mask_rows_aligned(group: dist.ProcessGroup) -> list[int]:
    """The byte offset modulo 16 of each combine slot's mask row (a combine kernel argument)."""
    from nvlink_cases import make_buffer

    size = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, HIDDEN, group.size(), NUM_EXPERTS)
    buffer = make_buffer(group, "nvlink", num_rdma_bytes=size, low_latency_mode=True, explicitly_destroy=True)
    try:
        masks = buffer.backend.low_latency.combine_masks
        return [masks[slot].data_ptr() % 16 for slot in range(2)]
    finally:
        buffer.destroy()


@pytest.mark.parametrize("num_ranks", [2, 3])
def test_both_combine_slots_share_one_specialisation(nvlink_host_pools, num_ranks: int) -> None:
    """Triton specialises a pointer argument on 16-byte alignment: a slot whose mask row sat at an
    odd offset compiled a second combine variant on its first call, inside a CUDA graph capture
    when the capture made that call, where NVSHMEM cannot set a module up."""
    assert nvlink_host_pools(num_ranks).run(combine_mask_rows_aligned) == [[0, 0]] * num_ranks
