"""The repeat paths of normal-mode calls with a handle (tritonep/backends/nvlink/normal_repeat.py)
launch exactly what the general path launches, and decline whatever they were not learnt for.

As in tests/test_low_latency_fast.py: under Triton's interpreter the NVLink backend makes no
compiled launches, so nothing would be learnt. Here a real fresh dispatch (on the interpreter)
makes the handle; then the kernels are replaced by stand-ins that compile nothing, and every
launch records its raw argument list (that file's ``NoKernel`` and ``RecordedLaunch``). Every
cached dispatch and combine then runs twice from the same host state, through the repeat path
and through the general path: the launches (with each run's new outputs named instead of their
addresses), the results' shapes and the host counters after must be equal. The kernels
themselves run in the GPU tests, where repeated calls take these paths.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist

import tritonep as deep_ep

TOKENS, HIDDEN, EXPERTS, TOPK, CALLS = 12, 256, 8, 3, 3


def _tensors(result: object) -> list[torch.Tensor]:
    """The tensors in ``result`` (nested tuples flattened, None left out)."""
    if isinstance(result, tuple):
        return [tensor for item in result for tensor in _tensors(item)]
    return [result] if isinstance(result, torch.Tensor) else []


def _named(log: list, result: object) -> list:
    """The recorded launches (grid, arguments) with the addresses of ``result``'s tensors
    replaced by names."""
    names = {tensor.data_ptr(): f"output {index}" for index, tensor in enumerate(_tensors(result))}
    return [(grid, tuple(names.get(value, value) if type(value) is int else value for value in args))
            for _, grid, args in log]


def _shapes(result: object) -> tuple:
    return tuple((tuple(tensor.shape), tensor.dtype) for tensor in _tensors(result))


def repeats_match_general_path(group: dist.ProcessGroup) -> list[str]:
    from nvlink_cases import count_repeats, make_buffer, uncount_repeats
    from test_low_latency_fast import NoKernel, RecordedLaunch

    from tritonep import nvl_bytes_for
    from tritonep.backends.nvlink import backend as nvlink_backend
    from tritonep.backends.nvlink.normal import combine_copy_engine
    from tritonep.backends.nvlink.normal import replay as normal_repeat
    from tritonep.runtime import launcher

    R = group.size()
    generator = torch.Generator().manual_seed(group.rank())

    def bf16(tokens: int = TOKENS, hidden: int = HIDDEN) -> torch.Tensor:
        return torch.randn(tokens, hidden, generator=generator, dtype=torch.float32).to(torch.bfloat16)

    buffer = make_buffer(group, "nvlink", num_nvl_bytes=nvl_bytes_for(TOKENS, HIDDEN, R), explicitly_destroy=True)
    backend = buffer.backend
    topk_idx = torch.rand(TOKENS, EXPERTS, generator=generator, dtype=torch.float32).topk(TOPK, dim=1).indices
    weights = torch.rand(TOKENS, TOPK, generator=generator, dtype=torch.float32)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, EXPERTS)
    recv_x, _, recv_weights, _, handle, _ = buffer.dispatch(
        bf16(), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=topk_idx, topk_weights=weights)
    rows = recv_x.shape[0]
    plan = handle.backend_state
    problems: list[str] = []

    def both_paths(call: Callable[[], object], attribute: str, counters: tuple[str, str]) -> None:
        """``call`` through each path from the same host state (``counters`` of the backend);
        ``attribute``: where the handle's plan keeps the repeat."""
        before = tuple(getattr(backend, counter) for counter in counters)
        learnt, runs = getattr(plan, attribute), []
        for use_repeat in (True, False):
            for counter, value in zip(counters, before):
                setattr(backend, counter, value)
            setattr(plan, attribute, learnt if use_repeat else None)
            RecordedLaunch.log = []
            result = call()[:2]   # (recv_x, None) or (combined_x, combined_topk_weights)
            runs.append((_named(RecordedLaunch.log, result), _shapes(result),
                         tuple(getattr(backend, counter) for counter in counters)))
        setattr(plan, attribute, learnt)
        if runs[0] != runs[1]:
            problems.append(f"{attribute}: repeat {runs[0]} != general {runs[1]}")

    def expect_error(call: Callable[[], object], words: str) -> None:
        try:
            call()
            problems.append(f"no error (expected one about {words})")
        except deep_ep.InputError as error:
            if words not in str(error):
                problems.append(f"unexpected error: {error}")

    launchers = (nvlink_backend._DISPATCH, nvlink_backend._COMBINE, combine_copy_engine._WEIGHTS,
                 combine_copy_engine._SIGNAL)
    saved = (launcher.INTERPRET, launcher._Setup, launcher.current_stream, normal_repeat.current_stream,
             [(item.kernel, dict(item.setups)) for item in launchers])
    taken = count_repeats(backend)
    try:
        launcher.INTERPRET = False
        launcher._Setup = RecordedLaunch
        launcher.current_stream = normal_repeat.current_stream = lambda: 7
        for item in launchers:
            item.kernel = NoKernel(item.kernel)
        # Cached dispatch, bf16 and fp8; then combine with and without top-k weights.
        for make_x in (bf16, lambda: deep_ep.utils.per_token_cast_to_fp8(bf16())):
            buffer.dispatch(make_x(), handle=handle)   # the general path learns
            for _ in range(CALLS):
                both_paths(functools.partial(buffer.dispatch, make_x(), handle=handle), "repeat",
                           ("dispatch_epoch", "dispatch_released"))
        for topk_weights in (recv_weights, None):
            buffer.combine(bf16(rows), handle, topk_weights)   # the general path learns
            for _ in range(CALLS):
                both_paths(functools.partial(buffer.combine, bf16(rows), handle, topk_weights), "combine_repeat",
                           ("combine_epoch", "combine_released"))
        wanted = {"repeat_cached_dispatch": 2 * CALLS, "repeat_combine": 2 * CALLS}
        if taken != wanted:
            problems.append(f"the repeat paths took {taken} calls, expected {wanted}")
        # Declined (the general path serves them, and learns each): other scale strides, then
        # bf16 again, then another num_sms; a combine with other num_sms, with a bias.
        x_fp8, scales = deep_ep.utils.per_token_cast_to_fp8(bf16())
        buffer.dispatch((x_fp8, scales.t().contiguous().t()), handle=handle)
        buffer.dispatch(bf16(), handle=handle)
        buffer.dispatch(bf16(), handle=handle, config=deep_ep.Config(deep_ep.Buffer.num_sms + 2))
        buffer.combine(bf16(rows), handle, config=deep_ep.Config(deep_ep.Buffer.num_sms + 2))
        buffer.combine(bf16(rows), handle, bias=bf16())
        if taken != wanted:
            problems.append(f"the repeat paths took calls they were not learnt for: {taken}")
        # Wrong inputs: the general path's errors.
        expect_error(lambda: buffer.dispatch(bf16(hidden=2 * HIDDEN)[:, :HIDDEN], handle=handle), "contiguous")
        expect_error(lambda: buffer.dispatch(bf16(tokens=TOKENS + 1), handle=handle), "tokens")
        expect_error(lambda: buffer.combine(bf16(rows + 1), handle), "shape")
        expect_error(lambda: buffer.combine(bf16(rows), handle, recv_weights.double()), "dtype")
    finally:
        launcher.INTERPRET, launcher._Setup, launcher.current_stream, normal_repeat.current_stream, kernels = saved
        for item, (kernel, setups) in zip(launchers, kernels):
            item.kernel = kernel
            item.setups.clear()
            item.setups.update(setups)
        uncount_repeats(backend, taken)
        buffer.destroy()
    return problems


def test_repeats_launch_what_the_general_path_launches(interpreter_pools) -> None:
    for num_ranks in (1, 2):
        problems = interpreter_pools(num_ranks).run(repeats_match_general_path)
        assert problems == [[]] * num_ranks
