"""The replays of normal-mode calls with a handle (tritonep/backends/nvlink/normal/replay.py)
launch exactly what the general path launches, and decline whatever they were not learnt for.

As in tests/test_low_latency_fast.py: under Triton's interpreter the NVLink backend makes no
compiled launches, so nothing would be learnt. Here a real fresh dispatch (on the interpreter)
makes the handle; then the kernels are replaced by stand-ins that compile nothing, and every
launch records its raw argument list (tests/recorded_launches.py). Every
cached dispatch and combine then runs twice from the same engine state (``NormalState``'s
counters), through its replay and through the general path (the handle's replay table emptied
for that run): the launches (with each run's new outputs named instead of their addresses),
the results' shapes and the counters after must be equal. The kernels themselves run in the
GPU tests, where repeated calls take these paths.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from recorded_launches import RecordedLaunch, named_launches, normal_launches_recorded, result_shapes

import tritonep as deep_ep
from tritonep.core.replay import ReplayTable

TOKENS, HIDDEN, EXPERTS, TOPK, CALLS = 12, 256, 8, 3, 3
# What each kind of call advances in the engine's state.
DISPATCH_COUNTERS = ("dispatch_epoch", "dispatch_released", "dispatch_arrived")
COMBINE_COUNTERS = ("combine_epoch", "combine_released")


def _status_word_in_every_launch(status_address: int) -> bool:
    """Every dispatch and combine launch learnt so far passes the status word as
    ``StatusWord.address``: what Triton makes of the pinned tensor the engine passes."""
    from tritonep.backends.nvlink.normal.combine_kernel import COMBINE
    from tritonep.backends.nvlink.normal.dispatch_kernel import DISPATCH
    from tritonep.runtime.launcher import argument_positions

    setups = [(launcher, setup) for launcher in (DISPATCH, COMBINE) for setup in launcher.setups.values()]
    return bool(setups) and all(setup.args[argument_positions(launcher.kernel, "status_ptr")[0]] == status_address
                                for launcher, setup in setups)


def replays_match_general_path(group: dist.ProcessGroup, tuning: dict) -> list[str]:
    """Every check above, with the backend's kernel shapes changed by ``tuning``."""
    import dataclasses

    from nvlink_cases import count_replays, make_buffer

    from tritonep import nvl_bytes_for

    R = group.size()
    generator = torch.Generator().manual_seed(group.rank())

    def bf16(tokens: int = TOKENS, hidden: int = HIDDEN) -> torch.Tensor:
        return torch.randn(tokens, hidden, generator=generator, dtype=torch.float32).to(torch.bfloat16)

    buffer = make_buffer(group, "nvlink", num_nvl_bytes=nvl_bytes_for(TOKENS, HIDDEN, R), explicitly_destroy=True)
    backend = buffer.backend
    backend.tuning = dataclasses.replace(backend.tuning, **tuning)
    state = backend.normal.state

    def fresh_dispatch(tokens: int = TOKENS) -> tuple:
        """(handle, its rows, its received top-k weights) of a dispatch of new routing."""
        topk_idx = torch.rand(tokens, EXPERTS, generator=generator, dtype=torch.float32).topk(TOPK, dim=1).indices
        weights = torch.rand(tokens, TOPK, generator=generator, dtype=torch.float32)
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, EXPERTS)
        recv_x, _, recv_weights, _, handle, _ = buffer.dispatch(
            bf16(tokens), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=topk_idx, topk_weights=weights)
        return handle, recv_x.shape[0], recv_weights

    handle, rows, recv_weights = fresh_dispatch()
    # New handles (made here: their kernels run), the last one of another token count.
    others = [fresh_dispatch(), fresh_dispatch(), fresh_dispatch(TOKENS + 1)]
    problems: list[str] = []

    def both_paths(call: Callable[[], object], counters: tuple[str, str], what: str, subject: object = None,
                   rebound: bool = False) -> None:
        """``call`` (made with ``subject``, by default ``handle``) through its replay, then
        through the general path, from the same counters. ``rebound``: the replay is the
        Buffer's latest of another handle, rebound to ``subject`` (its own table emptied)."""
        subject = handle if subject is None else subject
        before = tuple(getattr(state, counter) for counter in counters)
        learnt, latest, runs = subject.replays, buffer._handle_replays, []
        for through_replay in (True, False):
            for counter, value in zip(counters, before):
                setattr(state, counter, value)
            # (What the general run learns goes.)
            subject.replays = learnt if through_replay and not rebound else ReplayTable()
            buffer._handle_replays = latest if through_replay else ReplayTable()
            RecordedLaunch.log = []
            result = call()[:2]   # (recv_x, None) or (combined_x, combined_topk_weights)
            runs.append((named_launches(RecordedLaunch.log, result), result_shapes(result),
                         tuple(getattr(state, counter) for counter in counters)))
        subject.replays, buffer._handle_replays = learnt, latest
        if runs[0] != runs[1]:
            problems.append(f"{what}: replay {runs[0]} != general {runs[1]}")

    def expect_error(call: Callable[[], object], error: type[Exception], words: str) -> None:
        try:
            call()
            problems.append(f"no error (expected one about {words})")
        except error as raised:
            if words not in str(raised):
                problems.append(f"unexpected error: {raised}")

    def served(taken: dict[str, int], wanted: dict[str, int], what: str) -> None:
        if taken != wanted:
            problems.append(f"{what}: replays served {taken}, expected {wanted}")

    try:
        with normal_launches_recorded(), count_replays() as taken:
            # Cached dispatch, bf16 and fp8; then combine with and without top-k weights.
            for make_x in (bf16, lambda: deep_ep.utils.per_token_cast_to_fp8(bf16())):
                buffer.dispatch(make_x(), handle=handle)   # the general path learns
                for _ in range(CALLS):
                    both_paths(functools.partial(buffer.dispatch, make_x(), handle=handle), DISPATCH_COUNTERS,
                               "cached dispatch")
            for topk_weights in (recv_weights, None):
                buffer.combine(bf16(rows), handle, topk_weights)   # the general path learns
                for _ in range(CALLS):
                    both_paths(functools.partial(buffer.combine, bf16(rows), handle, topk_weights), COMBINE_COUNTERS,
                               "combine")
            wanted = {"cached_dispatch": 2 * CALLS, "combine": 2 * CALLS, "low_latency": 0}
            served(taken, wanted, "learnt calls")
            # New handles' first calls (training routes anew every step): the latest replays,
            # rebound to each, launch what the general path launches for it.
            # The dispatch replays learnt x's token count: the last handle's cached dispatches take
            # the general path, its combines (any rows) are rebound.
            for other, other_rows, other_weights in others:
                tokens = other.is_token_in_rank.shape[0]
                for make_x in (bf16, lambda tokens: deep_ep.utils.per_token_cast_to_fp8(bf16(tokens))):
                    both_paths(functools.partial(buffer.dispatch, make_x(tokens), handle=other), DISPATCH_COUNTERS,
                               "rebound cached dispatch", other, rebound=True)
                for topk_weights in (other_weights, None):
                    both_paths(functools.partial(buffer.combine, bf16(other_rows), other, topk_weights),
                               COMBINE_COUNTERS, "rebound combine", other, rebound=True)
            wanted = {"cached_dispatch": 2 * CALLS + 4, "combine": 2 * CALLS + 6, "low_latency": 0}
            served(taken, wanted, "rebound calls")
            if not _status_word_in_every_launch(state.status.address):
                problems.append("a launch does not pass the status word's address")
            # Declined (the general path serves them): other scale strides; another num_sms and
            # a bias (no replay under their keys).
            x_fp8, scales = deep_ep.utils.per_token_cast_to_fp8(bf16())
            buffer.dispatch((x_fp8, scales.t().contiguous().t()), handle=handle)
            buffer.dispatch(bf16(), handle=handle, config=deep_ep.Config(deep_ep.Buffer.num_sms + 2))
            buffer.combine(bf16(rows), handle, config=deep_ep.Config(deep_ep.Buffer.num_sms + 2))
            buffer.combine(bf16(rows), handle, bias=bf16())
            # Declined for the engine's state: a time-out to report (the general path raises it),
            # a num_worst_tokens dispatch's counts to check, new kernel shapes.
            state.status.view[0] = 1
            expect_error(lambda: buffer.dispatch(bf16(), handle=handle), RuntimeError, "timed out")
            expect_error(lambda: buffer.combine(bf16(rows), handle), RuntimeError, "timed out")
            state.status.clear()
            state.unchecked_padding = (state.notify_epoch, 1 << 30)
            buffer.dispatch(bf16(), handle=handle)
            state.unchecked_padding = (state.notify_epoch, 1 << 30)
            buffer.combine(bf16(rows), handle)
            served(taken, wanted, "declined calls")
            backend.tuning = backend.tuning   # a new launch generation: learnt again, then served
            for _ in range(2):
                buffer.dispatch(bf16(), handle=handle)
                buffer.combine(bf16(rows), handle)
            served(taken, {**wanted, "cached_dispatch": wanted["cached_dispatch"] + 1,
                           "combine": wanted["combine"] + 1}, "calls after new kernel shapes")
            # Wrong inputs: the replays decline, the general path raises.
            expect_error(lambda: buffer.dispatch(bf16(hidden=2 * HIDDEN)[:, :HIDDEN], handle=handle),
                         deep_ep.InputError, "contiguous")
            expect_error(lambda: buffer.dispatch(bf16(tokens=TOKENS + 1), handle=handle), deep_ep.InputError,
                         "tokens")
            expect_error(lambda: buffer.combine(bf16(rows + 1), handle), deep_ep.InputError, "shape")
            expect_error(lambda: buffer.combine(bf16(rows), handle, recv_weights.double()), deep_ep.InputError,
                         "dtype")
    finally:
        buffer.destroy()
    return problems


# copy_engine_dispatch: the cached dispatch's senders and its copy-engine side work (waits,
# copies, releases), at 2 ranks where the default leaves it off.
@pytest.mark.parametrize("tuning", [dict(), dict(copy_engine_dispatch=True)], ids=["defaults", "copy_engine_dispatch"])
def test_replays_launch_what_the_general_path_launches(interpreter_pools, tuning: dict) -> None:
    for num_ranks in (1, 2):
        problems = interpreter_pools(num_ranks).run(replays_match_general_path, tuning)
        assert problems == [[]] * num_ranks


def gpu_rebound_calls_match_general_path(group: dist.ProcessGroup) -> list[str]:
    """On GPUs, with the real kernels and copies: handles of new routing (same shapes), each
    one's first cached dispatch (bf16 and fp8) and combine (with top-k weights and without)
    served by the Buffer's latest replay rebound to it, give exactly what the general path gives
    for the same inputs."""
    from nvlink_cases import count_replays, shared_buffers
    from recorded_launches import tensors_in

    buffer, _ = shared_buffers(group, 1 << 30)
    cpu = dict(generator=torch.Generator().manual_seed(100 + group.rank()), dtype=torch.float32, device="cpu")
    tokens, hidden, experts = 700, 2048, 8 * group.size()

    def bf16(rows: int) -> torch.Tensor:
        return torch.randn(rows, hidden, **cpu).to(torch.bfloat16).to(buffer.device)

    def fresh_dispatch() -> tuple:
        topk_idx = torch.rand(tokens, experts, **cpu).topk(TOPK, dim=1).indices.to(buffer.device)
        weights = torch.rand(tokens, TOPK, **cpu).to(buffer.device)
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, experts)
        recv_x, _, recv_weights, _, handle, _ = buffer.dispatch(
            bf16(tokens), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=topk_idx, topk_weights=weights)
        return handle, bf16(recv_x.shape[0]), recv_weights

    x = bf16(tokens)
    x_fp8 = deep_ep.utils.per_token_cast_to_fp8(x)

    def calls(handle: object, y: torch.Tensor, weights: torch.Tensor) -> dict[str, Callable[[], object]]:
        return {"cached dispatch bf16": lambda: buffer.dispatch(x, handle=handle)[0],
                "cached dispatch fp8": lambda: buffer.dispatch(x_fp8, handle=handle)[0],
                "combine, weights": lambda: buffer.combine(y, handle, weights)[:2],
                "combine": lambda: buffer.combine(y, handle)[:2]}

    problems = []
    for call in calls(*fresh_dispatch()).values():   # the general path learns the latest replays
        call()
    for _ in range(2):
        handle, y, weights = fresh_dispatch()
        for what, call in calls(handle, y, weights).items():
            with count_replays() as taken:
                rebound = call()
            latest, buffer._handle_replays = buffer._handle_replays, ReplayTable()
            handle.replays = ReplayTable()
            general = call()
            buffer._handle_replays = latest
            torch.cuda.synchronize()
            if sum(taken.values()) != 1:
                problems.append(f"{what}: a new handle's first call was served by {taken}, not one rebound replay")
            if not all(torch.equal(a, b) for a, b in zip(tensors_in(general), tensors_in(rebound), strict=True)):
                problems.append(f"{what}: the rebound call differs from the general path's result")
    return problems


@pytest.mark.gpu(min_gpus=1)
def test_gpu_rebound_calls_match_the_general_path(gpu_pool) -> None:
    assert gpu_pool.run(gpu_rebound_calls_match_general_path) == [[]] * gpu_pool.num_ranks
