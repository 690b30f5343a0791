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
  the results of the real calls (a fresh dispatch's count exchange waits on the kernels); V2's
  expert-layout launch is faked like the others. What is timed is each front end's own work,
  V2's handle fields' host side included.

On GPUs each torch op of a call is also an allocation or a launch, so a difference here is a
lower bound of the difference the device bench (``python -m benchmarks --api v2``) sees.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))   # recorded_launches

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import tritonep as deep_ep  # noqa: E402

TOKENS, HIDDEN, EXPERTS, TOPK, NUM_SMS = 12, 256, 8, 3, 4


def median_us(call: Callable[[], object], calls: int) -> float:
    """Median host time of ``call`` in microseconds, one call at a time, after 50 untimed."""
    for _ in range(50):
        call()
    times = []
    for _ in range(calls):
        start = time.perf_counter_ns()
        call()
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1e3


def answering_with_fresh_results(backend: object) -> Callable[[], None]:
    """Make ``backend``'s ``get_dispatch_layout``, and its ``dispatch`` without a handle, answer
    with their next real call's result from then on; returns the undo."""
    layout, dispatch = backend.get_dispatch_layout, backend.dispatch
    remembered: dict[str, object] = {}

    def fresh_layout(*args: object) -> object:
        if "layout" not in remembered:
            remembered["layout"] = layout(*args)
        return remembered["layout"]

    def fresh_dispatch(request: object) -> object:
        if request.cached_handle is not None:
            return dispatch(request)
        if "dispatch" not in remembered:
            remembered["dispatch"] = dispatch(request)
        return remembered["dispatch"]

    backend.get_dispatch_layout, backend.dispatch = fresh_layout, fresh_dispatch
    return lambda: (delattr(backend, "get_dispatch_layout"), delattr(backend, "dispatch"))


def measure(calls: int) -> dict[str, tuple[float, float]]:
    from recorded_launches import RecordedLaunch, launches_faked

    from tritonep.backends.nvlink.normal import combine_copy_engine, expert_layout_kernel, layout_kernel, replay
    from tritonep.backends.nvlink.normal.combine_kernel import COMBINE
    from tritonep.backends.nvlink.normal.dispatch_kernel import DISPATCH

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

    def v1_fresh() -> tuple:
        per_rank, _, per_expert, in_rank, _ = v1.get_dispatch_layout(topk_idx, EXPERTS)
        return v1.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                           topk_idx=topk_idx, topk_weights=weights, config=config)

    def v2_fresh() -> tuple:
        return v2.dispatch(x, topk_idx=topk_idx, topk_weights=weights, num_experts=EXPERTS, num_sms=NUM_SMS)

    undo = [answering_with_fresh_results(buffer.backend) for buffer in (v1, v2)]
    recv_x1, _, recv_weights1, _, handle1, _ = v1_fresh()
    recv_x2, _, recv_weights2, handle2, _ = v2_fresh()
    pairs = {
        "fresh dispatch": (v1_fresh, v2_fresh),
        "cached dispatch": (lambda: v1.dispatch(x, handle=handle1, config=config),
                            lambda: v2.dispatch(x, handle=handle2, num_sms=NUM_SMS)),
        "combine": (lambda: v1.combine(recv_x1, handle1, config=config), lambda: v2.combine(recv_x2, handle2)),
        "combine, top-k weights": (lambda: v1.combine(recv_x1, handle1, recv_weights1, config=config),
                                   lambda: v2.combine(recv_x2, handle2, topk_weights=recv_weights2)),
    }
    launchers = (DISPATCH, COMBINE, combine_copy_engine._WEIGHTS, combine_copy_engine._SIGNAL, layout_kernel._LAYOUT,
                 expert_layout_kernel._EXPERT_LAYOUT)
    rows = {}
    try:
        with launches_faked(launchers, RecordedLaunch, (replay, layout_kernel, expert_layout_kernel)):
            for name, (v1_call, v2_call) in pairs.items():
                v1_call(), v2_call()   # the general paths learn what the repeats replay
                RecordedLaunch.log = []
                rows[name] = (median_us(v1_call, calls), median_us(v2_call, calls))
                RecordedLaunch.log = []
    finally:
        for step in undo:
            step()
        v1.destroy()
        v2.destroy()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.v2_host", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=5000, help="timed calls per figure")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:   # the store deletes its file when done
        dist.init_process_group("gloo", store=dist.FileStore(f"{folder}/store", 1), rank=0, world_size=1)
        try:
            rows = measure(args.calls)
        finally:
            dist.destroy_process_group()
    print(f"host us per call, one CPU rank, launches faked, median of {args.calls} ({TOKENS} tokens, hidden "
          f"{HIDDEN}, top-{TOPK} of {EXPERTS} experts)")
    print(f"{'call':<26}{'v1':>8}{'v2':>8}{'v2 - v1':>9}")
    for name, (v1_us, v2_us) in rows.items():
        print(f"{name:<26}{v1_us:>8.1f}{v2_us:>8.1f}{v2_us - v1_us:>9.1f}")


if __name__ == "__main__":
    main()
