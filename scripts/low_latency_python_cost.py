"""The low-latency fast path's own Python per call, without a GPU: each kernel launch is replaced
by a no-op (as tests/test_low_latency_fast.py records them), so what remains is the host work of
``Buffer.low_latency_dispatch`` / ``low_latency_combine`` around the launch. One CPU rank under
Triton's interpreter (numpy < 2.4: run it with ``.venv-interpreter``). A CPU ``add_`` is printed
as the host's yardstick.

    .venv-interpreter/bin/python scripts/low_latency_python_cost.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"
sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", "tests"), os.path.join(os.path.dirname(__file__), "..")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import tritonep as deep_ep  # noqa: E402


class _NoLaunch:
    """Stands for a compiled launch (launcher._Setup): same argument list, launches nothing."""

    def __init__(self, compiled: object, grid: int, raw_args: list) -> None:
        self.args, self.grid = raw_args, grid

    def __call__(self, stream: int, args: list | None = None) -> None:
        return None


def _per_call_us(fn, calls: int = 2000, rounds: int = 9) -> float:
    samples = []
    for _ in range(rounds):
        begin = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - begin) / calls * 1e6)
    return statistics.median(samples)


def main() -> None:
    from nvlink_cases import make_buffer
    from test_low_latency_fast import launches_replaced

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    T, H, E, K = 128, 7168, 288, 8
    size = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, 1, E)
    buffer = make_buffer(dist.group.WORLD, "nvlink", num_rdma_bytes=size, low_latency_mode=True,
                         explicitly_destroy=True)
    engine = buffer.backend.low_latency
    x = torch.randn(T, H).to(torch.bfloat16)
    topk_idx = torch.rand(T, E).topk(K, dim=1).indices
    weights = torch.rand(T, K)
    expert_rows = torch.randn(E, T, H).to(torch.bfloat16)
    yardstick = torch.ones(16)
    with launches_replaced(engine, _NoLaunch):
        for _ in range(4):   # the general path learns both slots
            _, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, T, E)
            buffer.low_latency_combine(expert_rows, topk_idx, weights, handle)
        calls = {
            "dispatch fp8": lambda: buffer.low_latency_dispatch(x, topk_idx, T, E),
            "dispatch bf16": lambda: buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False),
            "combine": lambda: buffer.low_latency_combine(expert_rows, topk_idx, weights, handle),
            "yardstick: a CPU add_": lambda: yardstick.add_(1),
        }
        for name, call in calls.items():
            print(f"{name:<22} {_per_call_us(call):.2f} us")
        # Every timed call took the fast path (a fall-back to the general path returns from it too).
        for fast_paths in (engine.fast_dispatch, engine.fast_combine):
            for fast in fast_paths.values():
                assert fast.slots.launches[0][0] is not None and fast.slots.launches[1][0] is not None
        key = (x.shape, topk_idx.shape, T, E, True, False, False, False, True, True)
        assert engine.fast_dispatch[key](x, topk_idx, None, None) is not None, "the fast path declined"
    buffer.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
