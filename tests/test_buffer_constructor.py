"""``Buffer(...)`` takes DeepEP V1's constructor: names, order, defaults, ``comm``, and a clear
InputError, before any communication, for every option a backend cannot honour.

The ``comm`` path is tested with test doubles of an mpi4py communicator (mpi4py itself is not
installed here): ``GroupCommDouble`` over a torch gloo group of the test's own ranks, and
``StoreCommDouble`` over a TCPStore for processes without torch.distributed. Both implement
only what tritonep calls: Get_rank, Get_size, bcast and allgather. A stand-in ``mpi4py`` module
is put in ``sys.modules`` while they are used, since Buffer requires mpi4py to be importable.
"""

from __future__ import annotations

import contextlib
import inspect
import multiprocessing as mp
import pickle
import sys
import types
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from nvlink_cases import make_buffer
from torch_defaults import pool_options

import tritonep as deep_ep
from tritonep.backends import choice as backend_choice
from tritonep.rank_pool import RankPool

V1_PARAMETERS = [("group", inspect.Parameter.empty), ("num_nvl_bytes", 0), ("num_rdma_bytes", 0),
                 ("low_latency_mode", False), ("num_qps_per_rank", 24), ("allow_nvlink_for_low_latency_mode", True),
                 ("allow_mnnvl", False), ("use_fabric", False), ("explicitly_destroy", False),
                 ("enable_shrink", False), ("comm", None)]


def test_signature_is_deepep_v1() -> None:
    parameters = list(inspect.signature(deep_ep.Buffer.__init__).parameters.values())[1:]
    assert [(p.name, p.default) for p in parameters] == V1_PARAMETERS
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in parameters)


# ----------------------------------------------------------------------------- test doubles
class GroupCommDouble:
    """Test double of an mpi4py communicator over a torch.distributed group (gloo)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.calls: list[str] = []

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's names
        return self.group.rank()

    def Get_size(self) -> int:  # noqa: N802
        return self.group.size()

    def bcast(self, obj, root: int = 0):
        self.calls.append("bcast")
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, root), group=self.group)
        return box[0]

    def allgather(self, obj) -> list:
        self.calls.append("allgather")
        out = [None] * self.group.size()
        dist.all_gather_object(out, obj, group=self.group)
        return out


class ReversedCommDouble(GroupCommDouble):
    """The same processes numbered in reverse: comm rank order is not world-rank order."""

    def Get_rank(self) -> int:  # noqa: N802
        return self.group.size() - 1 - self.group.rank()

    def bcast(self, obj, root: int = 0):
        return super().bcast(obj, self.group.size() - 1 - root)

    def allgather(self, obj) -> list:
        return list(reversed(super().allgather(obj)))


class StoreCommDouble:
    """Test double of an mpi4py communicator for processes without torch.distributed: bcast and
    allgather through a TCPStore that the test process serves."""

    def __init__(self, port: int, rank: int, size: int) -> None:
        self.store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        self.rank, self.size, self.count = rank, size, 0

    def Get_rank(self) -> int:  # noqa: N802
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return self.size

    def bcast(self, obj, root: int = 0):
        self.count += 1
        key = f"bcast/{self.count}"
        if self.rank == root:
            self.store.set(key, pickle.dumps(obj))
        return pickle.loads(self.store.get(key))

    def allgather(self, obj) -> list:
        self.count += 1
        self.store.set(f"allgather/{self.count}/{self.rank}", pickle.dumps(obj))
        return [pickle.loads(self.store.get(f"allgather/{self.count}/{r}")) for r in range(self.size)]


@contextlib.contextmanager
def mpi4py_importable(present: bool = True):
    """``import mpi4py`` succeeds (a stand-in module) or fails (None in sys.modules) inside."""
    previous = sys.modules.get("mpi4py", "absent")
    sys.modules["mpi4py"] = types.ModuleType("mpi4py") if present else None
    try:
        yield
    finally:
        if previous == "absent":
            sys.modules.pop("mpi4py", None)
        else:
            sys.modules["mpi4py"] = previous


# ----------------------------------------------------------------------------- rank functions
def _round_trip(buffer: deep_ep.Buffer) -> bool:
    """combine(dispatch(x)) == x * (number of ranks each token went to)."""
    R, rank = buffer.group_size, buffer.rank
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(6, 128, generator=generator, dtype=torch.float32, device="cpu").to(torch.bfloat16)
    topk_idx = torch.stack([torch.randperm(2 * R, generator=generator, device="cpu")[:2] for _ in range(6)])
    weights = torch.ones(6, 2, dtype=torch.float32, device="cpu")
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, 2 * R)
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                 num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                                                 topk_weights=weights)
    combined, _, _ = buffer.combine(recv_x, handle)
    return torch.equal(combined.float(), x.float() * in_rank.sum(1, keepdim=True))


def _options(buffer: deep_ep.Buffer) -> tuple:
    return (buffer.num_nvl_bytes, buffer.num_rdma_bytes, buffer.low_latency_mode, buffer.num_qps_per_rank,
            buffer.allow_nvlink_for_low_latency_mode, buffer.allow_mnnvl, buffer.use_fabric,
            buffer.explicitly_destroy, buffer.enable_shrink, buffer.comm)


def positional_v1_order(group) -> tuple:
    buffer = deep_ep.Buffer(group, 4096, 8192, False, 1, True, False, False, True, False, None)
    result = (_options(buffer), _round_trip(buffer))
    buffer.destroy()
    return result


def the_reported_call(group) -> bool:
    """The call that raised TypeError (use_fabric) before; the collective backend allocates its
    areas on first use, so 2 GB cost nothing here."""
    buffer = deep_ep.Buffer(group, int(2e9), 0, low_latency_mode=False, num_qps_per_rank=1, explicitly_destroy=True,
                            allow_mnnvl=False, use_fabric=False)
    ok = _round_trip(buffer)
    buffer.destroy()
    return ok


def every_keyword(group) -> tuple:
    """Options meaningless to the collective (gloo) backend are accepted and kept."""
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(8, 128, group.size(), 2 * group.size())
    buffer = deep_ep.Buffer(group=group, num_nvl_bytes=1 << 20, num_rdma_bytes=rdma, low_latency_mode=True,
                            num_qps_per_rank=3, allow_nvlink_for_low_latency_mode=False, allow_mnnvl=True,
                            use_fabric=True, explicitly_destroy=True, enable_shrink=True, comm=None)
    result = (_options(buffer), _round_trip(buffer))
    buffer.destroy()
    return result


def zero_qps_in_normal_mode(group) -> bool:
    return _round_trip(deep_ep.Buffer(group, num_qps_per_rank=0))


def error_of(group, kwargs: dict, mpi4py: bool | None = None) -> str:
    """The InputError message ``Buffer(**kwargs)`` raises on this rank ('' if none). ``group``
    and ``comm`` in kwargs may be the strings "group", "comm", "reversed comm" or "object"."""
    values = {"group": group, "comm": GroupCommDouble(group), "reversed comm": ReversedCommDouble(group),
              "object": object()}
    kwargs = {k: values.get(v, v) if isinstance(v, str) else v for k, v in kwargs.items()}
    context = mpi4py_importable(mpi4py) if mpi4py is not None else contextlib.nullcontext()
    try:
        with context:
            deep_ep.Buffer(**kwargs)
    except deep_ep.InputError as error:
        comm = kwargs.get("comm")
        calls = comm.calls if isinstance(comm, GroupCommDouble) else []
        return str(error) + (f" [comm calls: {calls}]" if calls else "")
    return ""


def buffer_from_comm(group, ranks: list[int] | None = None):
    """Buffer(None, comm=...) over ``ranks`` of the pool (all by default); others return None."""
    ranks = list(range(group.size())) if ranks is None else ranks
    sub = group if len(ranks) == group.size() else dist.new_group(ranks, backend="gloo")
    if group.rank() not in ranks:
        return None
    comm = GroupCommDouble(sub)
    with mpi4py_importable():
        buffer = deep_ep.Buffer(None, 1 << 20, comm=comm)
    return (buffer.rank, comm.Get_rank(), buffer.group_size, buffer.comm is comm,
            dist.get_process_group_ranks(buffer.group), _round_trip(buffer))


# ----------------------------------------------------------------------------- tests on 3 ranks
@pytest.fixture(scope="module")
def trio():
    with RankPool(3, timeout=120, **pool_options()) as pool:
        yield pool


def test_positional_v1_order(trio: RankPool) -> None:
    for options, ok in trio.run(positional_v1_order):
        assert options == (4096, 8192, False, 1, True, False, False, True, False, None)
        assert ok


def test_the_reported_call(trio: RankPool) -> None:
    assert trio.run(the_reported_call) == [True] * 3


def test_every_keyword(trio: RankPool) -> None:
    for options, ok in trio.run(every_keyword):
        assert options[2:] == (True, 3, False, True, True, True, True, None)
        assert ok


def test_num_qps_per_rank_is_free_outside_low_latency_mode(trio: RankPool) -> None:
    assert trio.run(zero_qps_in_normal_mode) == [True] * 3


ERRORS = {
    "neither group nor comm": ({"group": None}, None, "needs group"),
    "num_qps_per_rank 0 in low-latency mode": (
        {"group": "group", "low_latency_mode": True, "num_qps_per_rank": 0}, None,
        "num_qps_per_rank must be a positive int in low-latency mode, got 0"),
    "num_qps_per_rank negative": (
        {"group": "group", "low_latency_mode": True, "num_qps_per_rank": -4}, None, "got -4"),
    "num_qps_per_rank not an int": (
        {"group": "group", "low_latency_mode": True, "num_qps_per_rank": 2.0}, None, "got 2.0"),
    "num_nvl_bytes float": ({"group": "group", "num_nvl_bytes": 1.5}, None, "num_nvl_bytes must be an int, got 1.5"),
    "num_rdma_bytes negative": ({"group": "group", "num_rdma_bytes": -1}, None, "num_rdma_bytes=-1"),
    "a communicator passed as group": ({"group": "comm"}, None, "pass an mpi4py communicator as comm="),
    "comm without mpi4py": ({"group": None, "comm": "comm"}, False, "needs the mpi4py package"),
    "comm that is not a communicator": (
        {"group": None, "comm": "object"}, True, "lacks Get_rank, Get_size, bcast, allgather"),
    "comm in another rank order": ({"group": None, "comm": "reversed comm"}, True, "ascending world-rank order"),
    # Checked before the communicator is used: the message carries no "[comm calls: ...]".
    "bad option with comm": (
        {"group": None, "comm": "comm", "low_latency_mode": True, "num_qps_per_rank": 0}, True, "num_qps_per_rank"),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_errors_on_every_rank(trio: RankPool, name: str) -> None:
    kwargs, mpi4py, needle = ERRORS[name]
    messages = trio.run(error_of, kwargs, mpi4py)
    assert all(needle in m for m in messages), messages
    if name != "comm in another rank order":
        assert all("[comm calls" not in m for m in messages), messages
    assert trio.run(zero_qps_in_normal_mode) == [True] * 3   # the ranks are in step: nothing hung


def different_arguments(group, name: str) -> str:
    """Rank 1 builds its Buffer with another ``name`` than the others; returns this rank's error."""
    kwargs = {"num_nvl_bytes": 1 << 20, "num_rdma_bytes": 1 << 20, "low_latency_mode": True}
    if group.rank() == 1:
        kwargs[name] = {"num_nvl_bytes": 2 << 20, "num_rdma_bytes": 3 << 20, "low_latency_mode": False,
                        "explicitly_destroy": True, "enable_shrink": True}[name]
    try:
        deep_ep.Buffer(group, **kwargs)
    except deep_ep.InputError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("name", ["num_nvl_bytes", "num_rdma_bytes", "low_latency_mode", "explicitly_destroy",
                                  "enable_shrink"])
def test_ranks_given_different_arguments_all_raise(trio: RankPool, name: str) -> None:
    """Ranks that would lay out shared memory differently (or take different collective paths)
    raise on every rank, naming the argument and each rank's value."""
    messages = trio.run(different_arguments, name)
    assert all(f"Buffer needs the same {name} on every rank" in m for m in messages), messages
    assert all("rank 0 " in m and "rank 1 " in m for m in messages), messages
    assert trio.run(zero_qps_in_normal_mode) == [True] * 3   # the ranks are in step: nothing hung


def test_comm_over_the_whole_world(trio: RankPool) -> None:
    for rank, (buffer_rank, comm_rank, size, keeps_comm, ranks, ok) in enumerate(trio.run(buffer_from_comm)):
        assert (buffer_rank, comm_rank, size, keeps_comm, ranks, ok) == (rank, rank, 3, True, [0, 1, 2], True)


def test_comm_over_some_ranks(trio: RankPool) -> None:
    """A communicator of world ranks 0 and 2: a new group of those two, made by them alone."""
    results = trio.run(buffer_from_comm, [0, 2])
    assert results[1] is None
    assert results[0] == (0, 0, 2, True, [0, 2], True)
    assert results[2] == (1, 1, 2, True, [0, 2], True)


# ----------------------------------------------------------------------------- comm, no torch.distributed yet
def _fresh_process(rank: int, size: int, port: int, queue) -> None:
    """A process that has never initialised torch.distributed: Buffer(None, comm) must do it."""
    try:
        torch.set_num_threads(1)
        assert not dist.is_initialized()
        comm = StoreCommDouble(port, rank, size)
        with mpi4py_importable():
            buffer = deep_ep.Buffer(None, num_nvl_bytes=1 << 20, comm=comm)
        queue.put((rank, (buffer.rank, buffer.group_size, dist.is_initialized(), dist.get_backend(buffer.group),
                          _round_trip(buffer))))
        dist.destroy_process_group()
    except BaseException as error:  # noqa: BLE001 - reported to the test
        queue.put((rank, f"{type(error).__name__}: {error}"))


def test_comm_initialises_torch_distributed() -> None:
    size = 2
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    context = mp.get_context("spawn")
    queue = context.Queue()
    processes = [context.Process(target=_fresh_process, args=(r, size, store.port, queue), daemon=True)
                 for r in range(size)]
    for process in processes:
        process.start()
    try:
        results = dict(queue.get(timeout=120) for _ in range(size))
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    assert results == {r: (r, size, True, backend, True) for r in range(size)}, results


# ----------------------------------------------------------------------------- the NVLink backend
def nvlink_option_errors(group) -> list[str]:
    """On the NVLink backend (interpreter): use_fabric=True and, in low-latency mode,
    allow_nvlink_for_low_latency_mode=False raise; options it ignores build a working Buffer."""
    messages = []
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(4, 128, group.size(), 2 * group.size())
    for kwargs in ({"num_nvl_bytes": 1 << 20, "use_fabric": True},
                   {"num_rdma_bytes": rdma, "low_latency_mode": True, "allow_nvlink_for_low_latency_mode": False}):
        try:
            make_buffer(group, "nvlink", **kwargs)
            messages.append("")
        except deep_ep.InputError as error:
            messages.append(str(error))
    buffer = make_buffer(group, "nvlink", num_nvl_bytes=1 << 20, num_qps_per_rank=1, allow_mnnvl=True,
                         allow_nvlink_for_low_latency_mode=False, explicitly_destroy=True)
    messages.append(type(buffer.backend).__name__)
    buffer.destroy()
    return messages


def test_nvlink_backend_options(nvlink_host_pools) -> None:
    for fabric, nvlink_only, built in nvlink_host_pools(2).run(nvlink_option_errors):
        assert "use_fabric=True" in fabric and "fabric handles" in fabric
        assert "allow_nvlink_for_low_latency_mode=False" in nvlink_only and "no other path" in nvlink_only
        assert built == "NvlinkBackend"


def one_rank_out_of_address_space(group) -> tuple[str, list[str]]:
    """Rank 1 lowers its address-space limit (RLIMIT_AS) below what mapping the ranks' shared
    memory needs, so that step really fails there and only there. Returns (this rank's error, the
    pool's files left in /dev/shm); then, with the limit back, builds and destroys a Buffer, which
    raises if the failure left the ranks out of step."""
    import glob
    import resource

    limits = resource.getrlimit(resource.RLIMIT_AS)
    if group.rank() == 1:
        with open("/proc/self/status") as status:
            used_kb = next(int(line.split()[1]) for line in status if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, ((used_kb << 10) + (256 << 20), limits[1]))
    try:
        make_buffer(group, "nvlink", num_nvl_bytes=1 << 30)
        message = "no error"
    except RuntimeError as error:
        message = str(error)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, limits)
    dist.barrier(group=group)
    leftovers = glob.glob("/dev/shm/tritonep-*")
    buffer = make_buffer(group, "nvlink", num_nvl_bytes=1 << 20, explicitly_destroy=True)
    buffer.destroy()
    return message, leftovers


def test_allocation_failing_on_one_rank_raises_on_every_rank(nvlink_host_pools) -> None:
    """Building a Buffer is collective: a rank whose shared memory cannot be mapped must not leave
    its peers waiting in the next collective. Every rank raises, naming rank 1 and its error."""
    results = nvlink_host_pools(2).run(one_rank_out_of_address_space)
    for message, leftovers in results:
        assert "mapping the ranks' /dev/shm files failed on 1 of 2 rank(s)" in message, results
        assert "rank 1: RuntimeError" in message and "rank 0:" not in message, results
        assert leftovers == [], results


def test_collective_backend_on_nccl_refuses_no_nvlink_in_low_latency_mode() -> None:
    """No NCCL here: the check itself (it runs before the backend is made)."""
    with pytest.raises(deep_ep.InputError, match="lets NCCL choose its transport"):
        backend_choice.check_backend_options("collective", "nccl", True, False, False)
    backend_choice.check_backend_options("collective", "nccl", False, False, True)   # normal mode: ignored
    backend_choice.check_backend_options("collective", "gloo", True, False, True)    # gloo: no NVLink at all


def test_nvlink_backend_refuses_no_nvlink_on_one_node_only() -> None:
    """A group that spans nodes gets the internode backend, which honours
    allow_nvlink_for_low_latency_mode=False on NVSHMEM (and refuses it on plain stores itself:
    test_internode_low_latency.py)."""
    with pytest.raises(deep_ep.InputError, match="no other path"):
        backend_choice.check_backend_options("nvlink", "nccl", True, False, False, num_nodes=1)
    backend_choice.check_backend_options("nvlink", "nccl", True, False, False, num_nodes=2)


def padding_check_after_overwrite(group) -> list[bool]:
    """A num_worst_tokens dispatch leaves its padding check to the next call. If the mailbox
    meanwhile holds a later exchange (a CUDA graph's replay of a captured dispatch writes one),
    the next call must not wait for the lost epoch; with the epoch there, it still raises."""
    import torch as _torch

    from tritonep.backends.nvlink.normal.counts import CountExchange
    from tritonep.backends.nvlink.normal.state import NormalState
    from tritonep.core.checks import InputError

    state = NormalState(_torch.device("cpu"))
    counts = CountExchange(state, 0, 1)
    outcomes = []
    state.unchecked_padding, counts.mailbox_view[0] = (5, 3), 6   # overwritten by exchange 6
    counts.check_padding(timeout_ns=10**9)
    outcomes.append(state.unchecked_padding is None)
    state.unchecked_padding, counts.mailbox_view[0] = (7, 3), 7   # exchange 7 is there: 9 rows > 3
    counts.mailbox_view[1:] = 9
    try:
        counts.check_padding(timeout_ns=10**9)
        outcomes.append(False)
    except InputError as error:
        outcomes.append("num_worst_tokens=3" in str(error))
    return outcomes


def test_padding_check_skips_an_overwritten_mailbox(nvlink_host_pools) -> None:
    assert nvlink_host_pools(1).run(padding_check_after_overwrite) == [[True, True]]
