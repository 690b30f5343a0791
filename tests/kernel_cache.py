"""The GPU suite's Triton kernels compiled on all the host's cores before the ranks need them.

The GPU cases specialise the kernels on many shapes (hidden size, top-k, SM count, fp8, bias:
constexprs), and each rank compiles each specialisation when it first launches it, one after
another, on the way of its case; the ranks of a pool even compile the same ones side by side.
On a machine with a cold Triton cache that is much of a GPU run. So a GPU session can list
every kernel it compiled (``record``: Triton's own specialisation data, the input of
``JITFunction.preload``), and a later session compiles that list on spare cores in the
background (``warm_in_background``) while the ranks start: Triton's disk cache then holds what
they ask for (the same cache key: same source, signature, constexprs, attributes, options and
target). An entry the current kernels no longer accept fails alone and is counted; a kernel
not listed is compiled by the rank, as without the list.

    TRITONEP_TEST_KERNELS_OUT=file    this session appends what it compiles to ``file`` (each
                                      rank: ``awk '!seen[$0]++'`` keeps the first of each)
    TRITONEP_TEST_KERNELS=file        the list warmed at the start of a GPU session, if present
                                      (default tests/gpu_kernels.jsonl)
    TRITONEP_TEST_WAIT_FOR_KERNELS=1  the session's tests start once the whole list is built (a
                                      rank that still builds a listed kernel then shows that
                                      its cache key differs from the list's build)

With ``TRITONEP_TEST_KERNELS_OUT`` set, the ranks and the warming pool also log every Triton
compile to ``file.builds`` (``log_builds``): the kernel, its cache key, whether Triton's disk
cache held it and how long it took, so that a rank's build of a listed kernel can be told from
a cache hit, and its key compared with the pool's.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import Future, ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

OUT_VARIABLE = "TRITONEP_TEST_KERNELS_OUT"
WAIT_VARIABLE = "TRITONEP_TEST_WAIT_FOR_KERNELS"
KERNEL_LIST = Path(os.environ.get("TRITONEP_TEST_KERNELS", Path(__file__).with_name("gpu_kernels.jsonl")))


def entry(target: Any, specialization_data: str) -> str:
    """One line of a kernel list: the compile target and Triton's specialisation data."""
    return json.dumps({"target": [target.backend, target.arch, target.warp_size],
                       "kernel": json.loads(specialization_data)})


def record(group: Any, path: str) -> None:
    """On a rank: from now on append every kernel this process compiles (or loads from Triton's
    cache) to ``path``, one line each (one write per line: the ranks share the file)."""
    from triton import knobs
    from triton.runtime import driver

    target = driver.active.get_current_target()
    chained = knobs.runtime.jit_post_compile_hook

    def append(**kwargs: Any) -> Any:
        _append_line(path, entry(target, kwargs["compile"]["specialization_data"]))
        return chained(**kwargs) if chained else None

    knobs.runtime.jit_post_compile_hook = append
    log_builds(path + ".builds", "rank")


def log_builds(path: str, who: str) -> None:
    """From now on append one line per ``triton.compile`` in this process to ``path``: ``who``,
    the kernel, its cache key hash, its source hash (function, signature, constants, attributes:
    the key less the options and the environment), whether the disk cache held it, and the
    compile's seconds."""
    from triton import knobs

    def listen(*, src: Any, metadata: dict, metadata_group: dict, times: Any, cache_hit: bool) -> None:
        line = json.dumps({"who": who, "pid": os.getpid(), "name": src.name, "hash": metadata.get("hash"),
                           "source_hash": src.hash(), "cache_hit": cache_hit, "seconds": times.total / 1e6,
                           "extern_libs": str(metadata.get("extern_libs")), "signature": str(src.signature),
                           "constants": str(sorted(src.constants.items())), "attrs": str(src.attrs)})
        _append_line(path, line)

    knobs.compilation.listener = listen


def _append_line(path: str, line: str) -> None:
    """``line`` appended to ``path`` in one write (the ranks and the pool share the file)."""
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(descriptor, (line + "\n").encode())
    finally:
        os.close(descriptor)


def compile_entry(line: str) -> str:
    """Compile one line of a kernel list into Triton's disk cache, as ``JITFunction.preload``
    would but for the listed target, so that no GPU is needed. Returns the kernel's name."""
    import importlib

    import triton
    import triton.language as tl
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    if os.environ.get(OUT_VARIABLE) and knobs.compilation.listener is None:   # once per pool process
        log_builds(os.environ[OUT_VARIABLE] + ".builds", "pool")
    listed = json.loads(line)
    data = listed["kernel"]
    module, name = data["name"].rsplit(".", 1)
    kernel = getattr(importlib.import_module(module), name)
    # Triton's JSON turned tuples into lists and dtypes and constexprs into strings and dicts.
    constexprs = {tuple(key): tl.dtype(value) if tl.dtype.is_dtype(value) else
                  tl.constexpr(value["constexpr"]) if isinstance(value, dict) and "constexpr" in value else value
                  for key, value in zip(data["constant_keys"], data["constant_vals"])}
    attrs = {tuple(key): value for key, value in zip(data["attrs_keys"], data["attrs_vals"])}
    signature = {key: tuple(value) if isinstance(value, list) else value for key, value in data["signature"].items()}
    target = GPUTarget(*listed["target"])
    options = make_backend(target).parse_options(
        {key: tuple(value) if isinstance(value, list) else value for key, value in data["options"].items()})
    triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)
    return data["name"]


class Warming:
    """The kernels of a list being compiled by a pool of processes (``warm_in_background``)."""

    def __init__(self, lines: list[str], workers: int) -> None:
        self.workers = workers
        self._executor = ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn"))
        self.futures: list[Future] = [self._executor.submit(compile_entry, line) for line in lines]

    def wait(self) -> str:
        """Block until every entry is built (or refused); a line saying how long that took."""
        begin = time.perf_counter()
        for future in self.futures:
            future.exception()
        return f"kernel list: the tests waited {time.perf_counter() - begin:.1f} s for the whole list"

    def stop(self) -> str:
        """Cancel what has not started; a line saying what was compiled."""
        done = [future for future in self.futures if future.done() and not future.cancelled()]
        failed = sum(future.exception() is not None for future in done)
        self._executor.shutdown(wait=False, cancel_futures=True)
        return (f"kernel list: {len(done) - failed} of {len(self.futures)} kernels compiled ahead on "
                f"{self.workers} processes, {failed} no longer accepted")


def listed_ranks(line: str) -> int | None:
    """The ``NUM_RANKS`` constexpr a kernel list line was compiled for, None if it has none."""
    data = json.loads(line)["kernel"]
    names = list(data["signature"])   # in argument order: constant keys are argument indices
    if "NUM_RANKS" not in names:
        return None
    path = [names.index("NUM_RANKS")]
    for key, value in zip(data["constant_keys"], data["constant_vals"]):
        if key == path:
            return value["constexpr"] if isinstance(value, dict) else value
    return None


def warming_order(lines: list[str], num_ranks: int | None) -> list[str]:
    """The distinct ``lines`` in their order (the order the suite first needed them), those
    compiled for another rank count than ``num_ranks`` last: the list holds the kernels of
    every rank count the suite ran at, and a session at one count needs the others' last."""
    lines = list(dict.fromkeys(line for line in lines if line.strip()))
    if num_ranks is None:
        return lines
    return sorted(lines, key=lambda line: listed_ranks(line) not in (None, num_ranks))


def warm_in_background(path: Path, workers: int, num_ranks: int | None = None) -> Warming | None:
    """Start compiling the kernel list at ``path`` in ``warming_order``; None without a list."""
    if not path.exists() or workers < 1:
        return None
    lines = warming_order(path.read_text().splitlines(), num_ranks)
    return Warming(lines, workers) if lines else None
