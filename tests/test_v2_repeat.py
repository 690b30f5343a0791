"""ElasticBuffer's repeated calls (a cached dispatch, a combine) take the replays their engine
handle learnt, launch exactly what V2's general path launches, and add no torch work to V1's
repeated calls (V2's received ids are the handle's; V2's weights are taken per slot from the
expert's rank inside the combine kernel's reduction). A fresh V2 dispatch adds to V1's fresh
dispatch one launch (the expert-layout kernel, which makes the handle's fields) and the
allocations of its outputs, and, expanded, the gather of the rows into their expanded places.

As in tests/test_normal_repeat.py: a real fresh dispatch on the interpreter makes the handles,
then the kernels are replaced by stand-ins that record their launches (tests/recorded_launches.py).
Each call runs twice from the same engine counters, through ElasticBuffer's replay and through
its general path (the engine handle's replay table emptied); launches, result shapes and counters
must be equal. The torch ops a call runs are counted with a dispatch mode, V2's against V1's
call of the same shape: the host time V2's front end adds is the benchmark's
(``python -m benchmarks --api v2``), this is the part of it that does not depend on the host.
The fresh dispatches run for real, the kernels in the interpreter, their launches logged and the
interpreter's own torch work left out of the count (``recorded_launches.launches_counted``).
"""

from __future__ import annotations

import functools
import os
from collections import Counter
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from recorded_launches import RecordedLaunch, named_launches, normal_launches_recorded, result_shapes
from torch.utils._python_dispatch import TorchDispatchMode

import tritonep as deep_ep
from tritonep.core.replay import ReplayTable

TOKENS, HIDDEN, EXPERTS, TOPK, NUM_SMS, CALLS = 12, 256, 8, 3, 4, 3
DISPATCH_COUNTERS, COMBINE_COUNTERS = ("dispatch_epoch", "dispatch_released"), ("combine_epoch", "combine_released")


class TorchOps(TorchDispatchMode):
    """Counts the torch ops run inside (by name)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def torch_ops(call: Callable[[], object]) -> Counter[str]:
    with TorchOps() as counter:
        call()
    return counter.ops


def _buffers(group: dist.ProcessGroup) -> tuple[deep_ep.Buffer, deep_ep.ElasticBuffer]:
    os.environ["TRITONEP_BACKEND"] = "nvlink"
    try:
        v1 = deep_ep.Buffer(group, num_nvl_bytes=deep_ep.nvl_bytes_for(TOKENS, HIDDEN, group.size()),
                            explicitly_destroy=True)
        v2 = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=TOKENS, hidden=HIDDEN, num_topk=TOPK,
                                   explicitly_destroy=True)
    finally:
        os.environ.pop("TRITONEP_BACKEND")
    return v1, v2


def replays_match_general_path(group: dist.ProcessGroup) -> list[str]:
    from nvlink_cases import count_replays

    generator = torch.Generator().manual_seed(group.rank())

    def bf16(tokens: int = TOKENS, hidden: int = HIDDEN) -> torch.Tensor:
        return torch.randn(tokens, hidden, generator=generator, dtype=torch.float32).to(torch.bfloat16)

    v1, v2 = _buffers(group)
    state = v2.backend.normal.state
    topk_idx = torch.rand(TOKENS, EXPERTS, generator=generator, dtype=torch.float32).topk(TOPK, dim=1).indices
    weights = torch.rand(TOKENS, TOPK, generator=generator, dtype=torch.float32)
    per_rank, _, per_expert, in_rank, _ = v1.get_dispatch_layout(topk_idx, EXPERTS)
    recv_x1, _, recv_weights1, _, handle1, _ = v1.dispatch(
        bf16(), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=topk_idx, topk_weights=weights, config=deep_ep.Config(NUM_SMS))
    recv_x, _, recv_weights, handle, _ = v2.dispatch(bf16(), topk_idx=topk_idx, topk_weights=weights,
                                                     num_experts=EXPERTS, num_sms=NUM_SMS)
    rows = recv_x.shape[0]
    engine_handle = handle._state.engine_handle
    # A handle of new routing (made here: its kernels run), whose first calls rebind the replays
    # learnt with ``handle``.
    other_topk = torch.rand(TOKENS, EXPERTS, generator=generator, dtype=torch.float32).topk(TOPK, dim=1).indices
    other_recv_x, _, other_weights, other, _ = v2.dispatch(bf16(), topk_idx=other_topk, topk_weights=weights,
                                                           num_experts=EXPERTS, num_sms=NUM_SMS)
    problems: list[str] = []

    def both_paths(call: Callable[[], tuple], counters: tuple[str, str], what: str,
                   subject: deep_ep.EPHandle | None = None) -> None:
        """``call`` through its replay, then through the general path, from the same counters
        (launches, outputs' shapes, counters after, and the class of the event returned alike).
        ``subject``: a handle whose first call this is (its replay is another handle's, rebound)."""
        before = tuple(getattr(state, counter) for counter in counters)
        target = engine_handle if subject is None else subject._state.engine_handle
        learnt, latest, runs = target.replays, v2._engine.handle_replays, []
        for through_replay in (True, False):
            for counter, value in zip(counters, before):
                setattr(state, counter, value)
            target.replays = learnt if through_replay and subject is None else ReplayTable()
            v2._engine.handle_replays = latest if through_replay else ReplayTable()
            RecordedLaunch.log = []
            result = call()
            outputs = tuple(item for item in result if not isinstance(item, deep_ep.EPHandle))[:3]
            runs.append((named_launches(RecordedLaunch.log, outputs), result_shapes(outputs),
                         tuple(getattr(state, counter) for counter in counters), type(result[-1])))
        target.replays, v2._engine.handle_replays = learnt, latest
        if runs[0] != runs[1]:
            problems.append(f"{what}: replay {runs[0]} != general {runs[1]}")

    def expect_error(call: Callable[[], object], words: str) -> None:
        try:
            call()
            problems.append(f"no error (expected one about {words})")
        except deep_ep.InputError as raised:
            if words not in str(raised):
                problems.append(f"unexpected error: {raised}")

    def fp8() -> tuple[torch.Tensor, torch.Tensor]:
        return deep_ep.utils.per_token_cast_to_fp8(bf16())

    try:
        with normal_launches_recorded(), count_replays() as taken:
            for make_x in (bf16, fp8):
                v2.dispatch(make_x(), handle=handle, num_sms=NUM_SMS)   # the general path learns
                for _ in range(CALLS):
                    both_paths(functools.partial(v2.dispatch, make_x(), handle=handle, num_sms=NUM_SMS),
                               DISPATCH_COUNTERS, "cached dispatch")
            # The cached dispatch's options given as the handle has them are still a repeat.
            both_paths(functools.partial(v2.dispatch, bf16(), handle=handle, num_sms=NUM_SMS, num_experts=EXPERTS,
                                         expert_alignment=1, num_max_tokens_per_rank=TOKENS, do_cpu_sync=False),
                       DISPATCH_COUNTERS, "cached dispatch, options as in the handle")
            for topk_weights in (recv_weights, None):   # combine's num_sms: the handle's
                v2.combine(bf16(rows), handle, topk_weights)
                for _ in range(CALLS):
                    both_paths(functools.partial(v2.combine, bf16(rows), handle, topk_weights), COMBINE_COUNTERS,
                               "combine")
            wanted = {"cached_dispatch": 2 * CALLS + 1, "combine": 2 * CALLS, "low_latency": 0}
            if taken != wanted:
                problems.append(f"replays served {taken}, expected {wanted}")
            # A new handle's first calls rebind the latest replays, the combine with weights
            # included (its replay's expert ids become the new handle's).
            for make_x in (bf16, fp8):
                both_paths(functools.partial(v2.dispatch, make_x(), handle=other, num_sms=NUM_SMS), DISPATCH_COUNTERS,
                           "rebound cached dispatch", other)
            for topk_weights in (other_weights, None):
                both_paths(functools.partial(v2.combine, bf16(other_recv_x.shape[0]), other, topk_weights),
                           COMBINE_COUNTERS, "rebound combine", other)
            wanted = {"cached_dispatch": 2 * CALLS + 3, "combine": 2 * CALLS + 2, "low_latency": 0}
            if taken != wanted:
                problems.append(f"replays served {taken} with a new handle, expected {wanted}")
            # Wrong inputs: the replays decline or are not asked, the general path raises.
            expect_error(lambda: v2.dispatch(bf16(hidden=2 * HIDDEN)[:, :HIDDEN], handle=handle, num_sms=NUM_SMS),
                         "contiguous")
            expect_error(lambda: v2.dispatch(bf16(tokens=TOKENS + 1), handle=handle, num_sms=NUM_SMS), "tokens")
            expect_error(lambda: v2.dispatch(bf16(), handle=handle, num_experts=2 * EXPERTS), "num_experts")
            expect_error(lambda: v2.dispatch(bf16(), handle=handle, do_cpu_sync=True), "CPU sync")
            expect_error(lambda: v2.dispatch(bf16(), handle=handle, num_qps=v2.num_allocated_qps + 1), "num_qps")
            expect_error(lambda: v2.combine(bf16(rows + 1), handle), "shape")
            expect_error(lambda: v2.combine(bf16(rows), handle, recv_weights.double()), "dtype")
            expect_error(lambda: v2.combine(bf16(rows), handle, recv_weights[:, :1]), "shape")
            if taken != wanted:
                problems.append(f"bad calls were served by replays: {taken}, expected {wanted}")
            # The torch work V2's repeats add to V1's: none.
            config = deep_ep.Config(NUM_SMS)
            x, y, y1 = bf16(), bf16(rows), bf16(recv_x1.shape[0])
            v1_calls = {"cached dispatch": lambda: v1.dispatch(x, handle=handle1, config=config),
                        "combine": lambda: v1.combine(y1, handle1, config=config),
                        "combine, weights": lambda: v1.combine(y1, handle1, recv_weights1, config=config)}
            for call in v1_calls.values():   # the general path learns
                call()
            v1_ops = {what: torch_ops(call) for what, call in v1_calls.items()}
            v2_ops = {"cached dispatch": torch_ops(lambda: v2.dispatch(x, handle=handle, num_sms=NUM_SMS)),
                      "combine": torch_ops(lambda: v2.combine(y, handle)),
                      "combine, weights": torch_ops(lambda: v2.combine(y, handle, recv_weights))}
            added = {"cached dispatch": Counter(), "combine": Counter(), "combine, weights": Counter()}
            for what, expected in added.items():
                got = v2_ops[what] - v1_ops[what]
                if got != expected:
                    problems.append(f"{what}: V2 runs {dict(got)} more torch ops than V1, expected {dict(expected)}")
    finally:
        v1.destroy()
        v2.destroy()
    return problems


def test_repeats_take_the_replays_and_launch_what_the_general_path_launches(interpreter_pools) -> None:
    for num_ranks in (1, 2):
        problems = interpreter_pools(num_ranks).run(replays_match_general_path)
        assert problems == [[]] * num_ranks


# What a fresh V2 dispatch may add to V1's (get_dispatch_layout, then dispatch) on the NVLink
# backend, and what it leaves out. V1's layout launch is left out: V2's count exchange works the
# layout out from topk_idx itself, allocating is_token_in_rank alone of the layout's three
# outputs. V2 adds the handle fields' output (one block for the fields and the copy of topk_idx),
# which the dispatch's receivers write (no launch of their own), so V1 allocates one tensor more;
# expanded, V2 adds the expert-layout launch, which writes the expanded fields, the block's views
# the call itself reads (source rows, weights: the float32 view is a view and a detach) and the
# gather of the rows into their expanded places (zero padding: the padding rows zeroed).
V1_ONLY_LAUNCHES = ["tritonep::intranode::layout"]
FRESH_LAUNCHES: list[str] = []
EXPANDED_LAUNCHES = ["tritonep::intranode::expert_layout"]
FRESH_OPS: Counter = Counter()
EXPANDED_OPS = FRESH_OPS + Counter({"aten.slice": 2, "aten.view": 1, "aten.detach": 1, "aten.clamp": 1,
                                    "aten.index_select": 1})
ZERO_PADDING_OPS = EXPANDED_OPS + Counter({"aten.lt": 1, "aten.view": 1, "aten.masked_fill_": 1})
# On CPU ranks V1 reads the range of the expert ids back twice (get_dispatch_layout, dispatch),
# V2 once (on GPUs neither does: the count exchange, or V1's layout kernel, counts bad ids).
V1_ONLY_ON_CPU = Counter({"aten.empty": 1, "aten.aminmax": 1, "aten._local_scalar_dense": 2})
# Without a CPU sync V1's outputs have their padding rows filled (source -1, expert -1, weight 0);
# whatever writes V2's handle fields writes them instead (DispatchRequest.pad_outputs).
V1_ONLY_PADDED = V1_ONLY_ON_CPU + Counter({"aten.fill_": 2, "aten.zero_": 1})


def fresh_dispatch_work(group: dist.ProcessGroup) -> list[str]:
    """The launches and torch ops a fresh V2 dispatch adds to V1's fresh dispatch of the same
    routing, with and without a CPU sync, expanded or not: each call runs for real (kernels in
    the interpreter, whose own torch work is not counted: recorded_launches.launches_counted),
    after a first call of its shape."""
    from recorded_launches import launches_counted

    generator = torch.Generator().manual_seed(group.rank())
    x = torch.randn(TOKENS, HIDDEN, generator=generator, dtype=torch.float32).to(torch.bfloat16)
    topk_idx = torch.rand(TOKENS, EXPERTS, generator=generator, dtype=torch.float32).topk(TOPK, dim=1).indices
    weights = torch.rand(TOKENS, TOPK, generator=generator, dtype=torch.float32)
    v1, v2 = _buffers(group)
    config = deep_ep.Config(NUM_SMS)

    def v1_fresh(num_worst_tokens: int) -> Callable[[], object]:
        def call() -> object:
            per_rank, _, per_expert, in_rank, _ = v1.get_dispatch_layout(topk_idx, EXPERTS)
            return v1.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                               num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=weights,
                               num_worst_tokens=num_worst_tokens, config=config)
        return call

    def v2_fresh(**options: object) -> Callable[[], object]:
        return lambda: v2.dispatch(x, topk_idx=topk_idx, topk_weights=weights, num_experts=EXPERTS, num_sms=NUM_SMS,
                                   **options)

    worst = group.size() * TOKENS
    pairs = {"fresh": (v1_fresh(0), v2_fresh(), FRESH_LAUNCHES, FRESH_OPS, V1_ONLY_ON_CPU),
             "fresh, no CPU sync": (v1_fresh(worst), v2_fresh(do_cpu_sync=False), FRESH_LAUNCHES, FRESH_OPS,
                                    V1_ONLY_PADDED),
             "fresh, expanded": (v1_fresh(0), v2_fresh(do_expand=True), EXPANDED_LAUNCHES, EXPANDED_OPS,
                                 V1_ONLY_ON_CPU),
             "fresh, no CPU sync, expanded, zero padding": (
                 v1_fresh(worst), v2_fresh(do_cpu_sync=False, do_expand=True, do_zero_padding=True),
                 EXPANDED_LAUNCHES, ZERO_PADDING_OPS, V1_ONLY_PADDED)}
    problems = []
    try:
        with launches_counted() as launches:
            for what, (v1_call, v2_call, expected_launches, expected_ops, v1_only_ops) in pairs.items():
                counted = []
                for call in (v1_call, v2_call):
                    call()   # the first call of a shape makes what later ones reuse
                    launches.clear()
                    counted.append((torch_ops(call), [name for name, _ in launches]))
                (v1_ops, v1_launches), (v2_ops, v2_launches) = counted
                shared = [name for name in v1_launches if name not in V1_ONLY_LAUNCHES]
                if v2_launches != shared + expected_launches:
                    problems.append(f"{what}: V2 launches {v2_launches}, V1 {v1_launches}: expected V1's but "
                                    f"{V1_ONLY_LAUNCHES}, and {expected_launches}")
                if v2_ops - v1_ops != expected_ops or v1_ops - v2_ops != v1_only_ops:
                    problems.append(f"{what}: V2 runs {dict(v2_ops - v1_ops)} more torch ops than V1 and "
                                    f"{dict(v1_ops - v2_ops)} fewer, expected {dict(expected_ops)} more and "
                                    f"{dict(v1_only_ops)} fewer")
    finally:
        v1.destroy()
        v2.destroy()
    return problems


def test_fresh_dispatch_adds_only_the_handle_fields_outputs(interpreter_pools) -> None:
    """Not expanded, no launch (the dispatch's receivers write the fields); expanded, one."""
    for num_ranks in (1, 2):
        problems = interpreter_pools(num_ranks).run(fresh_dispatch_work)
        assert problems == [[]] * num_ranks


def gpu_repeats_match_general_path(group: dist.ProcessGroup) -> list[str]:
    """On GPUs, with the real kernels: repeated V2 calls are served by replays, and a new handle's
    first calls by the latest replays rebound to it, and give exactly what the general path
    gives for the same inputs."""
    from nvlink_cases import count_replays

    device = torch.device("cuda", torch.cuda.current_device())
    cpu = dict(generator=torch.Generator().manual_seed(group.rank()), dtype=torch.float32, device="cpu")
    tokens, hidden, experts = 64, 512, 4 * group.size()

    def bf16(rows: int) -> torch.Tensor:
        return torch.randn(rows, hidden, **cpu).to(torch.bfloat16).to(device)

    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=tokens, hidden=hidden, num_topk=TOPK,
                                   explicitly_destroy=True)
    topk_idx = torch.rand(tokens, experts, **cpu).topk(TOPK, dim=1).indices.to(device)
    weights = torch.rand(tokens, TOPK, **cpu).to(device)
    recv_x, _, recv_weights, handle, _ = buffer.dispatch(bf16(tokens), topk_idx=topk_idx, topk_weights=weights,
                                                         num_experts=experts, num_sms=NUM_SMS)
    engine_handle = handle._state.engine_handle
    x, y = bf16(tokens), bf16(recv_x.shape[0])
    calls_by_kind = {"cached_dispatch": lambda: buffer.dispatch(x, handle=handle, num_sms=NUM_SMS)[:2],
                     "combine": lambda: buffer.combine(y, handle, recv_weights)[:2]}
    engine = buffer._engine
    problems = []
    try:
        for kind, call in calls_by_kind.items():
            general = call()   # learns
            learnt, latest = engine_handle.replays, engine.handle_replays
            with count_replays() as taken:
                engine_handle.replays, engine.handle_replays = ReplayTable(), ReplayTable()
                general = call()   # learns again, now counted
                repeats = [call() for _ in range(CALLS)]
            engine_handle.replays, engine.handle_replays = learnt, latest
            torch.cuda.synchronize()
            if taken[kind] != CALLS:
                problems.append(f"{kind}: replays served {taken[kind]} of {CALLS} repeats")
            for index, repeat in enumerate(repeats):
                if not all(torch.equal(a, b) for a, b in zip(general, repeat)):
                    problems.append(f"{kind}: repeat {index} differs from the general path's result")
        # A handle of new routing: its first cached dispatch and combines (with weights and
        # without) are the latest replays rebound to it, then the same calls through the general
        # path. Each combine gets a handle of its own, whose first combine it is.
        def new_handle() -> tuple:
            other_idx = torch.rand(tokens, experts, **cpu).topk(TOPK, dim=1).indices.to(device)
            other_x, _, other_weights, other, _ = buffer.dispatch(bf16(tokens), topk_idx=other_idx,
                                                                  topk_weights=weights, num_experts=experts,
                                                                  num_sms=NUM_SMS)
            return other, bf16(other_x.shape[0]), other_weights

        other, _, _ = new_handle()
        weighted, y_weighted, weighted_weights = new_handle()
        plain, y_plain, _ = new_handle()
        buffer.combine(y, handle)   # (the latest combine replay without weights; the one with: above)
        first_calls = [("cached_dispatch", lambda: buffer.dispatch(x, handle=other, num_sms=NUM_SMS)[:2], other),
                       ("combine", lambda: buffer.combine(y_weighted, weighted, weighted_weights)[:2], weighted),
                       ("combine", lambda: buffer.combine(y_plain, plain)[:2], plain)]
        for kind, call, subject in first_calls:
            with count_replays() as taken:
                rebound = call()
            latest, engine.handle_replays = engine.handle_replays, ReplayTable()
            subject._state.engine_handle.replays = ReplayTable()
            general = call()
            engine.handle_replays = latest
            torch.cuda.synchronize()
            if taken[kind] != 1:
                problems.append(f"{kind}: a new handle's first call was served by {taken[kind]} rebound replays, not 1")
            if not all(torch.equal(a, b) for a, b in zip(general, rebound) if a is not None):
                problems.append(f"{kind}: the rebound call differs from the general path's result")
    finally:
        buffer.destroy()
    return problems


@pytest.mark.gpu(min_gpus=1)
def test_gpu_repeats_take_the_replays(gpu_pool) -> None:
    assert gpu_pool.run(gpu_repeats_match_general_path) == [[]] * gpu_pool.num_ranks
