"""Run a function on R ranks of a local process group: the examples, the benchmark and the tests.

``RankPool(R)`` starts R processes once (gloo on CPU ranks, or NCCL with one GPU each) and
then runs any number of picklable functions on all of them, returning each rank's result.
Keeping the processes alive lets a test suite run hundreds of cases without paying process
start-up and group creation for each one. An exception on any rank is re-raised in the caller
with that rank's traceback, promptly: a rank that raised skips the collectives its peers then wait
in, so after a short grace the pool stops them and starts afresh on the next call, instead of
waiting out its time-out. ``default_dtype`` / ``default_device`` run the ranks under other
torch defaults, as serving stacks and DeepEP's own tests set them before building a Buffer.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable, Collection
from datetime import timedelta
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


SHARED_GPUS_VARIABLE = "TRITONEP_RANKS_SHARE_GPUS"


def gpu_ranks() -> int:
    """Ranks a GPU run uses: ``TRITONEP_GPU_RANKS`` if set (more ranks than GPUs share them,
    round robin), else one per GPU."""
    import torch

    return int(os.environ.get("TRITONEP_GPU_RANKS", torch.cuda.device_count()))


def group_on_gpu(group: Any) -> bool:
    """Whether this rank's process runs on a GPU: an NCCL group, or ranks sharing GPUs (gloo)."""
    import torch.distributed as dist

    return dist.get_backend(group) == "nccl" or os.environ.get(SHARED_GPUS_VARIABLE) == "1"


# The ranks meet at a TCPStore that the parent process serves: it binds port 0 (the system picks a
# free port and the store holds it from then on). Choosing a free port first and binding it later,
# in rank 0, lost races to other processes' sockets (NCCL's own bind ephemeral ports).
STORE_TIMEOUT_S = 300.0


def serve_store() -> Any:
    """A TCPStore served by this process on a port of the system's choice (``.port``)."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=STORE_TIMEOUT_S))


def init_one_rank_gpu_group(device_index: int = 0) -> torch.device:
    """A one-rank NCCL process group on GPU ``device_index``, with the NVLink backend as the
    default: for the scripts that profile one process's calls. Returns the device."""
    import torch
    import torch.distributed as dist

    os.environ.setdefault("TRITONEP_BACKEND", "nvlink")
    device = torch.device("cuda", device_index)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    return device


class RankFailure(RuntimeError):
    """A function failed on one or more ranks; the message holds their tracebacks."""


_leaving = False   # set in a rank by leave_after_this_run


def leave_after_this_run() -> None:
    """Called in a rank's function: this rank's process cannot serve another function (e.g. a
    thread of it is left waiting in a collective after a peer failed), so once its result or
    error is back, the pool stops every rank and the next ``run`` starts new ones."""
    global _leaving
    _leaving = True


def _worker(rank: int, num_ranks: int, port: int, use_gpu: bool, conn: Any, default_dtype: Any = None,
            default_device: Any = None, env: dict[str, str] | None = None) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.update(env or {})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    nccl = False
    if use_gpu:
        num_gpus = torch.cuda.device_count()
        torch.cuda.set_device(rank % num_gpus)
        # NCCL refuses two ranks on one GPU: ranks that share GPUs join a gloo group, and the
        # NVLink backend (which needs no NCCL) is chosen for it explicitly.
        nccl = num_ranks <= num_gpus
        if not nccl:
            os.environ[SHARED_GPUS_VARIABLE] = "1"
            os.environ.setdefault("TRITONEP_BACKEND", "nvlink")
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT_S))
    dist.init_process_group(
        backend="nccl" if nccl else "gloo",
        store=store,
        rank=rank,
        world_size=num_ranks,
        **({"device_id": torch.device("cuda", rank)} if nccl else {}),
    )
    group = dist.group.WORLD
    if default_dtype is not None:
        torch.set_default_dtype(default_dtype)
    if default_device is not None:
        torch.set_default_device(default_device)
    while True:
        message = conn.recv()
        if message is None:
            break
        fn, args, kwargs = message
        try:
            reply = ("ok", fn(group, *args, **kwargs))
        except BaseException as error:  # noqa: BLE001 - every failure goes back to the caller
            reply = ("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}")
        conn.send((*reply, _leaving))
        if _leaving:
            return   # its threads may be stuck: no destroy_process_group, the process just ends
    dist.destroy_process_group()


class RankPool:
    """R worker processes joined in one process group.

    Arguments:
        num_ranks: R.
        use_gpu: rank r on GPU r with NCCL; otherwise CPU ranks with gloo. With more ranks than
            GPUs, rank r runs on GPU r % G in a gloo group with the NVLink backend
            (``TRITONEP_BACKEND=nvlink``): a test of correctness across processes, not of speed,
            since ranks on one GPU time-share it.
        timeout: seconds to wait for a function on all ranks before declaring a hang.
        default_dtype: if given, each rank calls ``torch.set_default_dtype`` with it (a floating
            torch.dtype, e.g. torch.bfloat16) once its process group exists.
        default_device: if given, each rank calls ``torch.set_default_device`` with it (e.g.
            "cuda": the rank's own GPU) once its process group exists.
        env: environment variables set in every rank's process before anything else (e.g.
            ``TRITONEP_GPUS_PER_NODE``), on top of the environment the ranks inherit.
        failure_grace: seconds the other ranks get to finish once one rank has failed. A rank that
            raised skips the collectives left in the function, so its peers may wait in one for
            ever: past this grace the pool stops its processes and raises with the failure, and
            the next ``run`` starts new ones.
    """

    def __init__(self, num_ranks: int, use_gpu: bool = False, timeout: float = 300.0,
                 default_dtype: torch.dtype | None = None, default_device: str | torch.device | None = None,
                 env: dict[str, str] | None = None, failure_grace: float = 30.0) -> None:
        if default_dtype is not None or default_device is not None:
            import torch

            if default_dtype is not None and not (isinstance(default_dtype, torch.dtype)
                                                  and default_dtype.is_floating_point):
                raise ValueError(f"default_dtype must be a floating torch.dtype, got {default_dtype!r}")
            if default_device is not None:
                default_device = torch.device(default_device)
        self.num_ranks = num_ranks
        self.timeout = timeout
        self.failure_grace = failure_grace
        self._options = (use_gpu, default_dtype, default_device, env)
        self._connections: list[Any] = []
        self._processes: list[Any] = []
        self._store: Any = None
        self._start()

    def _start(self) -> None:
        context = mp.get_context("spawn")
        self._store = serve_store()   # a fresh one per group: no keys of an earlier group in it
        port = self._store.port
        for rank in range(self.num_ranks):
            parent_end, child_end = context.Pipe()
            process = context.Process(target=_worker, daemon=True,
                                      args=(rank, self.num_ranks, port, self._options[0], child_end,
                                            *self._options[1:]))
            process.start()
            self._connections.append(parent_end)
            self._processes.append(process)

    @property
    def running(self) -> bool:
        """Whether the ranks' processes are up (False after ``close``, or after a run stopped
        them; the next ``run`` starts new ones)."""
        return bool(self._processes)

    def run(self, fn: Callable[..., Any], *args: Any, may_exit: Collection[int] = (), **kwargs: Any) -> list[Any]:
        """Call ``fn(group, *args, **kwargs)`` on every rank; returns the results by rank.

        Raises RankFailure with every failed rank's traceback. The ranks are awaited together:
        once one has failed the others get ``failure_grace`` seconds, then the pool's processes
        are stopped (and started afresh by the next call, as when any rank's process has ended
        between calls); ranks that never answer within ``timeout`` are a hang, reported by rank.

        ``may_exit``: ranks whose process may die during the call (tests of a killed rank);
        their result is None. The pool's group then has a dead member: the next call starts
        new ranks."""
        if not self._processes or not all(process.is_alive() for process in self._processes):
            # Stopped after a failure, or a rank's process has ended since: a fresh group.
            self.close(force=True)
            self._start()
        name = getattr(fn, "__name__", fn)
        for conn in self._connections:
            conn.send((fn, args, kwargs))
        results: list[Any] = [None] * self.num_ranks
        failures: dict[int, str] = {}
        waiting = {conn: rank for rank, conn in enumerate(self._connections)}
        deadline = time.monotonic() + self.timeout
        exited = False
        while waiting:
            ready = wait(list(waiting), timeout=max(deadline - time.monotonic(), 0))
            if not ready:
                break
            for conn in ready:
                rank = waiting.pop(conn)
                try:
                    status, value, leaving = conn.recv()
                except EOFError:   # the rank's process died (killed, or a crash in native code)
                    if rank not in may_exit:
                        failures[rank] = f"rank {rank} exited while running {name}"
                        exited = True
                    continue
                exited |= leaving
                if status == "error":
                    failures[rank] = f"--- rank {rank} ---\n{value}"
                results[rank] = value
            if failures:
                deadline = min(deadline, time.monotonic() + self.failure_grace)
        if waiting or exited:
            self.close(force=True)
        lines = [failures[rank] for rank in sorted(failures)]
        if waiting:
            late = sorted(waiting.values())
            if not failures:
                raise RankFailure(f"rank(s) {late} did not finish {name} within {self.timeout:.0f} s (hang?)")
            lines.append(f"--- rank(s) {late} had not finished {name} {self.failure_grace:.0f} s after rank(s) "
                         f"{sorted(failures)} failed: the pool stopped its processes (the next run starts new ones)")
        if lines:
            raise RankFailure("\n".join(lines))
        return results

    def close(self, force: bool = False) -> None:
        for conn, process in zip(self._connections, self._processes):
            if not force and process.is_alive():
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        for process in self._processes:
            process.join(timeout=0 if force else 10)
            if process.is_alive():
                process.kill()
                process.join(timeout=10)
        for conn in self._connections:
            conn.close()
        self._processes = []
        self._connections = []
        self._store = None   # (after the ranks left: they no longer need it)

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_on_ranks(fn: Callable[..., Any], num_ranks: int, *args: Any, use_gpu: bool = False, **kwargs: Any) -> list[Any]:
    """One-shot: start R ranks, run ``fn(group, *args, **kwargs)`` on each, stop them."""
    with RankPool(num_ranks, use_gpu=use_gpu) as pool:
        return pool.run(fn, *args, **kwargs)
