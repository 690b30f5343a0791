"""The host work of the normal-mode calls a training step repeats, counted: ``get_dispatch_layout``
and a cached dispatch (``handle=``) on the NVLink backend.

Their host path is what a loop that issues calls back to back waits on, and each piece of it
costs microseconds on the device machines: a compiled launch, a torch op (an allocation, a
fill, a view), an event record or wait (a side stream's fork and join). Timing them here would
say little about those machines, so this test counts them, which any machine can check: the
layout is one launch into three fresh outputs (no zeroing, no views), and a cached dispatch one
launch of both halves into its one output (two with fp8 scales), with no side stream, at one
rank and at two. A repeated layout launches exactly what the first call launched.

As in tests/test_normal_repeat.py, a real fresh dispatch (on the interpreter) makes the handle;
then the compiled launches are faked (tests/recorded_launches.py): each records its raw argument
list and nothing runs. The torch ops are counted by a dispatch mode, which sees every op the
call runs, whatever torch-function mode the caller has.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from recorded_launches import RecordedLaunch, launches_faked
from torch.utils._python_dispatch import TorchDispatchMode

import tritonep as deep_ep
from tritonep.runtime.side_streams import PeerStreams

TOKENS, HIDDEN, EXPERTS, TOPK = 12, 256, 8, 3
EMPTY = "aten.empty.memory_format"


class TorchOps(TorchDispatchMode):
    """Counts the torch ops run inside it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def side_stream_forks() -> Iterator[list[int]]:
    """Counts PeerStreams.fork calls (on a GPU: an event record, then a wait and a record per job)."""
    forks = [0]
    fork = PeerStreams.fork

    def counting_fork(self: PeerStreams, *args: object, **kwargs: object) -> None:
        forks[0] += 1
        fork(self, *args, **kwargs)

    PeerStreams.fork = counting_fork
    try:
        yield forks
    finally:
        PeerStreams.fork = fork


def _work(call: Callable[[], object]) -> tuple[int, dict[str, int], int, list]:
    """(launches, torch ops by name, side-stream forks, the launches' argument lists with the
    result's addresses named) of one call."""
    RecordedLaunch.log = []
    with side_stream_forks() as forks, TorchOps() as counted:
        result = call()
    outputs = [t for t in (result if isinstance(result, tuple) else (result,)) if isinstance(t, torch.Tensor)]
    names = {tensor.data_ptr(): f"output {index}" for index, tensor in enumerate(outputs)}
    launches = [(grid, tuple(names.get(v, v) if type(v) is int else v for v in args))
                for _, grid, args in RecordedLaunch.log]
    return len(RecordedLaunch.log), dict(counted.ops), forks[0], launches


def host_work(group: dist.ProcessGroup) -> dict[str, tuple]:
    """Each counted call's ``_work`` (without the argument lists, which are compared here)."""
    from nvlink_cases import make_buffer

    from tritonep.backends.nvlink.normal import combine_copy_engine, layout_kernel, replay
    from tritonep.backends.nvlink.normal.combine_kernel import COMBINE
    from tritonep.backends.nvlink.normal.dispatch_kernel import DISPATCH

    generator = torch.Generator().manual_seed(group.rank())
    buffer = make_buffer(group, "nvlink", num_nvl_bytes=deep_ep.nvl_bytes_for(TOKENS, HIDDEN, group.size()),
                         explicitly_destroy=True)
    x = torch.randn(TOKENS, HIDDEN, generator=generator, dtype=torch.float32).to(torch.bfloat16)
    x_fp8 = deep_ep.utils.per_token_cast_to_fp8(x)
    topk_idx = torch.rand(TOKENS, EXPERTS, generator=generator, dtype=torch.float32).topk(TOPK, dim=1).indices
    weights = torch.rand(TOKENS, TOPK, generator=generator, dtype=torch.float32)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, EXPERTS)
    handle = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                             num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=weights)[4]
    launchers = (DISPATCH, COMBINE, combine_copy_engine._WEIGHTS, combine_copy_engine._SIGNAL, layout_kernel._LAYOUT)
    counted = {}
    try:
        with launches_faked(launchers, RecordedLaunch, (replay, layout_kernel)):
            layouts = [_work(lambda: buffer.get_dispatch_layout(topk_idx, EXPERTS)[:4]) for _ in range(3)]
            counted["layout"] = layouts[0][:3]
            counted["layout, repeated"] = layouts[2][:3]
            counted["layout, repeated, launches what the first launched"] = layouts[1][3] == layouts[2][3] == \
                layouts[0][3]
            for name, dispatch_x in (("bf16", x), ("fp8", x_fp8)):
                calls = [_work(lambda x=dispatch_x: buffer.dispatch(x, handle=handle)[0]) for _ in range(3)]
                counted[f"cached dispatch {name}"] = calls[0][:3]
                counted[f"cached dispatch {name}, repeated"] = calls[2][:3]
    finally:
        buffer.destroy()
    return counted


def test_layout_and_cached_dispatch_host_work(interpreter_pools) -> None:
    # One launch, three empty outputs and, on CPU ranks only, the ids' value check (their range in
    # one aminmax, both ends read back; on a GPU the layout kernel counts bad ids instead), nothing else.
    layout = (1, {EMPTY: 3, "aten.aminmax.default": 1, "aten._local_scalar_dense.default": 2}, 0)
    for num_ranks in (1, 2):
        for counted in interpreter_pools(num_ranks).run(host_work):
            assert counted["layout"] == counted["layout, repeated"] == layout, counted
            assert counted["layout, repeated, launches what the first launched"], counted
            # The first cached dispatch of a handle takes the general path (one launch, no side
            # stream; its views and the handle's scratch output are counted elsewhere); the
            # repeats are replayed: one launch into one fresh output per tensor returned.
            for name, outputs in (("bf16", 1), ("fp8", 2)):
                launches, _, forks = counted[f"cached dispatch {name}"]
                assert (launches, forks) == (1, 0), (num_ranks, name, counted)
                assert counted[f"cached dispatch {name}, repeated"] == (1, {EMPTY: outputs}, 0), (num_ranks, counted)
