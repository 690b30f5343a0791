"""V2's front end against V1's on the host, with the kernels' launches faked, at one CPU rank.

``python -m benchmarks.v2_host`` (run with the interpreter environment, ``.venv-interpreter``:
the NVLink backend runs on CPUs only under Triton's interpreter). A real fresh dispatch of each
API makes the handles (kernels in the interpreter); then every compiled launch is faked
(``tests/recorded_launches.py``: the launchers learn and replay as on a GPU, each launch records
its argument list and nothing runs), and each call below is timed one at a time, V1's and V2's
in turn, the median of ``--calls`` calls each:

* cached dispatch and combine (with and without the received top-k weights), through the
  replays both front ends take for repeated calls;
* fresh dispatch: V2's ``dispatch(x, topk_idx=..., num_experts=E)`` against V1's
  ``get_dispatch_layout`` then ``dispatch``, the backend's layout and dispatch answering with
  the results of the real calls (a fresh dispatch's count exchange waits on the kernels). What
  is timed is each front end's own work: on the NVLink backend the dispatch itself writes V2's
  handle fields (not expanded), so their host side (one allocation and the launch's arguments)
  is in the answered dispatch and not timed here; the expanded layout's launch is faked like the
  others;
* the same without a CPU sync: V2's ``do_cpu_sync=False`` against V1's ``num_worst_tokens``
  (R * T rows), the backend answering with the results of real calls of that kind.

``--cold`` times each call with the CPU's caches overwritten before it, as the device bench's fresh
rows are timed after a synchronize and a barrier (each torch op then costs several times what it
costs warm). The expert ids' range check, which on GPUs the layout kernel makes on the device, is left out
of both (on CPU tensors V1 reads it back twice, V2 once).

On GPUs each torch op of a call is also an allocation or a launch, so a difference here is a
lower bound of the difference the device bench (``python -m benchmarks --api v2``) sees. So
that the rest can be told, each row also counts what V2's call runs beyond V1's (the backend's
own work, the same in both, answers from memory and runs nothing): the torch ops (on GPUs an
allocation costs a few microseconds) and the launches (a launch several).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))   # recorded_launches

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import tritonep as deep_ep  # noqa: E402

TOKENS, HIDDEN, EXPERTS, TOPK, NUM_SMS = 12, 256, 8, 3, 4


# ``--cold``: bytes written and seconds slept before each timed call.
COLD_BYTES, COLD_SLEEP_S = 32 << 20, 0.0003


def median_us(call: Callable[[], object], calls: int, cold: bool = False) -> float:
    """Median host time of ``call`` in microseconds, one call at a time, after 50 untimed.
    ``cold``: before each call the CPU's caches are overwritten and the thread sleeps, as after
    the device bench's synchronize and barrier (``timing.idle_host_us``), where the fresh rows'
    host times are taken: a path's cost then grows with the code and data it touches."""
    for _ in range(50):
        call()
    scratch = torch.ones(COLD_BYTES, dtype=torch.uint8, device="cpu") if cold else None
    times = []
    for _ in range(calls):
        if scratch is not None:
            scratch.add_(1)
            time.sleep(COLD_SLEEP_S)
        start = time.perf_counter_ns()
        call()
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1e3


class TorchOps(TorchDispatchMode):
    """Counts the torch ops run inside, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.ops[str(func.overloadpacket).removeprefix("aten.")] += 1
        return func(*args, **(kwargs or {}))


def work_of(call: Callable[[], object]) -> tuple[Counter[str], int]:
    """The torch ops and the (faked) launches of one ``call``."""
    from recorded_launches import RecordedLaunch

    RecordedLaunch.log = []
    with TorchOps() as counter:
        call()
    launches, RecordedLaunch.log = len(RecordedLaunch.log), []
    return counter.ops, launches


def answering_with_fresh_results(backend: object) -> Callable[[], None]:
    """Make ``backend``'s ``get_dispatch_layout``, and its ``dispatch`` without a handle, answer
    with their next real call's result from then on (per ``num_worst_tokens``); returns the undo."""
    layout, dispatch = backend.get_dispatch_layout, backend.dispatch
    remembered: dict[object, object] = {}

    def fresh_layout(*args: object) -> object:
        if "layout" not in remembered:
            remembered["layout"] = layout(*args)
        return remembered["layout"]

    def fresh_dispatch(request: object) -> object:
        if request.cached_handle is not None:
            return dispatch(request)
        if request.num_worst_tokens not in remembered:
            remembered[request.num_worst_tokens] = dispatch(request)
        return remembered[request.num_worst_tokens]

    backend.get_dispatch_layout, backend.dispatch = fresh_layout, fresh_dispatch
    return lambda: (delattr(backend, "get_dispatch_layout"), delattr(backend, "dispatch"))


def measure(calls: int, cold: bool = False) -> dict[str, tuple[float, float, int, Counter[str], Counter[str]]]:
    """Per call: (V1 us, V2 us, V2's launches beyond V1's, V2's torch ops beyond V1's, V1's beyond V2's)."""
    from recorded_launches import RecordedLaunch, launches_faked

    from tritonep.backends.nvlink.normal import combine_copy_engine, expert_layout_kernel, layout_kernel, replay
    from tritonep.backends.nvlink.normal.combine_kernel import COMBINE
    from tritonep.backends.nvlink.normal.dispatch_kernel import DISPATCH, DISPATCH_WITH_FIELDS
    from tritonep.core import checks as core_checks

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN, generator=generator, dtype=torch.float32).to(torch.bfloat16)
    topk_idx = torch.rand(TOKENS, EXPERTS, generator=generator, dtype=torch.float32).topk(TOPK, dim=1).indices
    weights = torch.rand(TOKENS, TOPK, generator=generator, dtype=torch.float32)
    os.environ["TRITONEP_BACKEND"] = "nvlink"
    group = dist.group.WORLD
    v1 = deep_ep.Buffer(group, num_nvl_bytes=deep_ep.nvl_bytes_for(TOKENS, HIDDEN, 1), explicitly_destroy=True)
    v2 = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=TOKENS, hidden=HIDDEN, num_topk=TOPK,
                               explicitly_destroy=True)
    config = deep_ep.Config(NUM_SMS)

    def v1_fresh(num_worst_tokens: int = 0) -> tuple:
        per_rank, _, per_expert, in_rank, _ = v1.get_dispatch_layout(topk_idx, EXPERTS)
        return v1.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                           topk_idx=topk_idx, topk_weights=weights, num_worst_tokens=num_worst_tokens, config=config)

    def v2_fresh(do_cpu_sync: bool = True) -> tuple:
        return v2.dispatch(x, topk_idx=topk_idx, topk_weights=weights, num_experts=EXPERTS, num_sms=NUM_SMS,
                           do_cpu_sync=do_cpu_sync)

    undo = [answering_with_fresh_results(buffer.backend) for buffer in (v1, v2)]
    recv_x1, _, recv_weights1, _, handle1, _ = v1_fresh()
    recv_x2, _, recv_weights2, handle2, _ = v2_fresh()
    pairs = {
        "fresh dispatch": (v1_fresh, v2_fresh),
        "fresh, no CPU sync": (lambda: v1_fresh(TOKENS), lambda: v2_fresh(False)),   # R * T rows, one rank
        "cached dispatch": (lambda: v1.dispatch(x, handle=handle1, config=config),
                            lambda: v2.dispatch(x, handle=handle2, num_sms=NUM_SMS)),
        "combine": (lambda: v1.combine(recv_x1, handle1, config=config), lambda: v2.combine(recv_x2, handle2)),
        "combine, top-k weights": (lambda: v1.combine(recv_x1, handle1, recv_weights1, config=config),
                                   lambda: v2.combine(recv_x2, handle2, topk_weights=recv_weights2)),
    }
    launchers = (DISPATCH, DISPATCH_WITH_FIELDS, COMBINE, combine_copy_engine._WEIGHTS, combine_copy_engine._SIGNAL,
                 layout_kernel._LAYOUT, expert_layout_kernel._EXPERT_LAYOUT)
    rows = {}
    # On GPUs the layout kernel checks the expert ids' range: neither API reads it back on the
    # host, as both do here on CPU tensors (V1 twice, V2 once).
    as_on_gpus = [(core_checks, "check_expert_ids", lambda *args: None)]
    try:
        with launches_faked(launchers, RecordedLaunch, (replay, layout_kernel, expert_layout_kernel), as_on_gpus):
            for name, (v1_call, v2_call) in pairs.items():
                v1_call(), v2_call()   # the general paths learn what the repeats replay
                RecordedLaunch.log = []
                v1_us, v2_us = median_us(v1_call, calls, cold), median_us(v2_call, calls, cold)
                (v1_ops, v1_launches), (v2_ops, v2_launches) = work_of(v1_call), work_of(v2_call)
                rows[name] = (v1_us, v2_us, v2_launches - v1_launches, v2_ops - v1_ops, v1_ops - v2_ops)
    finally:
        for step in undo:
            step()
        v1.destroy()
        v2.destroy()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.v2_host", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=5000, help="timed calls per figure")
    parser.add_argument("--cold", action="store_true", help="caches overwritten and a sleep before each call "
                                                            "(as the device bench's fresh rows)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:   # the store deletes its file when done
        dist.init_process_group("gloo", store=dist.FileStore(f"{folder}/store", 1), rank=0, world_size=1)
        try:
            rows = measure(args.calls, args.cold)
        finally:
            dist.destroy_process_group()
    print(f"host us per call{', cold caches' if args.cold else ''}, one CPU rank, launches faked, median of "
          f"{args.calls} ({TOKENS} tokens, hidden {HIDDEN}, top-{TOPK} of {EXPERTS} experts)")
    print(f"{'call':<26}{'v1':>8}{'v2':>8}{'v2 - v1':>9}   launches and torch ops V2 runs beyond V1 (V1 beyond V2)")
    for name, (v1_us, v2_us, extra_launches, v2_only, v1_only) in rows.items():
        print(f"{name:<26}{v1_us:>8.1f}{v2_us:>8.1f}{v2_us - v1_us:>9.1f}   {extra_launches:+d} launches, "
              f"{_listed(v2_only)} ({_listed(v1_only)})")


def _listed(ops: Counter[str]) -> str:
    return ", ".join(f"{count} {op}" for op, count in sorted(ops.items())) or "none"


if __name__ == "__main__":
    main()
