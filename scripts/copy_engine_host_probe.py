"""Host cost of the copy-engine combine's operations, one by one: what an EP8 combine's host
path will cost before an 8-GPU machine is lent.

The copy-engine combine (``combine_copy_engine.py``) enqueues, per peer and piece, a row copy and
a tail-word write on the peer's side stream, plus one event pair per peer (until 2026-11-24 also
a weights copy per piece: at EP8 with 2 pieces 42 driver calls and 7 forks). Four ranks sharing
one GPU measured 513-604 us of host per combine; this probe separates the cost of each operation
from the contention of ranks sharing a GPU: rank 0 times, the other ranks wait in a barrier
(they only export their memory).

    PYTHONPATH=. python scripts/copy_engine_host_probe.py [--ranks 2] [--json out.json]

Rows: microseconds of CPU per operation (median round of 20, GPU synchronised between rounds),
for copies into plain memory, into this rank's symmetric memory and into a peer's (ranks >= 2);
the EP8 combine's issue (7 peers' worth of copies, all aimed at the one real peer) through
``push_combine_weights`` and ``combine_copy_jobs`` as the backend runs them; and
``cuMemcpyBatchAsync``, which enqueues many copies in one call, where the driver has it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os

import torch
import torch.distributed as dist

import tritonep as deep_ep
from tritonep import nvl_bytes_for
from tritonep.backends.nvlink.normal.combine_copy_engine import (
    combine_copy_jobs,
    driver_memory_operations,
    push_combine_weights,
)
from tritonep.bench_timing import back_to_back_host_us
from tritonep.rank_pool import RankPool
from tritonep.runtime.side_streams import PeerStreams

ROW_BYTES = 7168 * 2      # a bf16 row of hidden 7168
ROWS_PER_PEER = 1170      # EP8, 4096 tokens x top-8 of 256: about 8172 rows received, 1/8 from each source
TOPK = 8


def _libcuda() -> ctypes.CDLL:
    """The driver's entry points the combine uses, called through ctypes with declared types."""
    lib = ctypes.CDLL("libcuda.so.1")
    u64, ptr = ctypes.c_uint64, ctypes.c_void_p
    for name, argtypes in (("cuMemcpyDtoDAsync_v2", (u64, u64, ctypes.c_size_t, ptr)),
                           ("cuStreamWriteValue64_v2", (ptr, u64, u64, ctypes.c_uint)),
                           ("cuEventRecord", (ptr, ptr)), ("cuStreamWaitEvent", (ptr, ptr, ctypes.c_uint))):
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, ctypes.c_int
    return lib


def _batch_copy(driver):
    """A function that enqueues ``count`` copies with one ``cuMemcpyBatchAsync``, or an error text."""
    if not hasattr(driver, "cuMemcpyBatchAsync"):
        return "cuda-bindings has no cuMemcpyBatchAsync"
    attributes = driver.CUmemcpyAttributes()
    attributes.srcAccessOrder = driver.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    location = driver.CUmemLocation()
    location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    location.id = torch.cuda.current_device()
    attributes.srcLocHint = location
    attributes.dstLocHint = location
    attributes.flags = 0

    def run(dsts: list[int], srcs: list[int], sizes: list[int], stream: int):
        result = driver.cuMemcpyBatchAsync([driver.CUdeviceptr(d) for d in dsts], [driver.CUdeviceptr(s) for s in srcs],
                                           sizes, len(dsts), [attributes], [0], 1, stream)
        if result[0] != 0:
            raise RuntimeError(f"cuMemcpyBatchAsync: {result[0]!r}")
    return run


def probe(group: dist.ProcessGroup) -> dict:
    os.environ["TRITONEP_BACKEND"] = "nvlink"
    R, rank = group.size(), group.rank()
    device = torch.device("cuda", torch.cuda.current_device())
    driver = driver_memory_operations(device)
    buffer = deep_ep.Buffer(group, nvl_bytes_for(4096, 7168, 8), 0, explicitly_destroy=True)
    memory = buffer.backend.memory
    report: dict = {"ranks": R, "driver": driver is not None}
    dist.barrier(group=group)
    if rank == 0 and driver is not None:
        side = torch.cuda.Stream()
        stream = side.cuda_stream
        piece = ROWS_PER_PEER // 2 * ROW_BYTES
        source = torch.randn(ROWS_PER_PEER * ROW_BYTES // 4, device=device)
        plain = torch.empty_like(source)
        src = source.data_ptr()
        targets = {"plain": plain.data_ptr(), "own_symmetric": memory.local.data_ptr() + memory.data_offset}
        if R > 1:
            targets["peer_symmetric"] = memory.peers[1].data_ptr() + memory.data_offset
        for name, dst in targets.items():
            def copy(dst=dst):
                driver.cuMemcpyDtoDAsync(dst, src, piece, stream)
            report[f"copy_{name}_us"] = round(back_to_back_host_us(copy), 2)
        signal = memory.peers[R - 1].data_ptr()
        report["write_value_us"] = round(back_to_back_host_us(
            lambda: driver.cuStreamWriteValue64(stream, signal, 1, 0)), 2)
        # The same operations through ctypes: how much of their cost is the Python binding.
        lib = _libcuda()
        copy_c, write_c = lib.cuMemcpyDtoDAsync_v2, lib.cuStreamWriteValue64_v2
        record_c, wait_c = lib.cuEventRecord, lib.cuStreamWaitEvent
        for name, dst in targets.items():
            report[f"ctypes_copy_{name}_us"] = round(back_to_back_host_us(
                lambda dst=dst: copy_c(dst, src, piece, stream)), 2)
        report["ctypes_write_value_us"] = round(back_to_back_host_us(lambda: write_c(stream, signal, 1, 0)), 2)
        event = torch.cuda.Event()
        event_handle, main_stream = event.cuda_event, torch.cuda.current_stream().cuda_stream
        report["ctypes_record_wait_us"] = round(back_to_back_host_us(
            lambda: (record_c(event_handle, main_stream), wait_c(stream, event_handle, 0))), 2)
        report["driver_record_wait_us"] = round(back_to_back_host_us(lambda: (
            driver.cuEventRecord(event_handle, main_stream), driver.cuStreamWaitEvent(stream, event_handle, 0))), 2)
        report["torch_record_wait_us"] = round(back_to_back_host_us(
            lambda: (event.record(), side.wait_event(event))), 2)
        report["torch_add_us"] = round(back_to_back_host_us(lambda: source.add_(0)), 2)
        streams = PeerStreams(device)
        for jobs in (1, 7):
            def fork_join(jobs=jobs):
                streams.fork([lambda: None] * jobs)
                streams.join()
            report[f"fork_join_{jobs}_jobs_us"] = round(back_to_back_host_us(fork_join), 2)
        # An EP8 combine's issue as the backend does it: the weights kernel on the current
        # stream, then 7 peers' blocks (all aimed at the one real peer, at distinct offsets).
        x = torch.randn(8 * ROWS_PER_PEER, 7168, device=device).to(torch.bfloat16)
        weights = torch.rand(8 * ROWS_PER_PEER, TOPK, device=device)
        target = 1 % R
        copies = [(target, step * ROWS_PER_PEER, ROWS_PER_PEER, step * ROWS_PER_PEER) for step in range(7)]
        staging_weights = memory.data_offset + 7 * ROWS_PER_PEER * ROW_BYTES
        owner = buffer.backend._launch_key
        if R > 1:   # (the kernel's programs are the R - 1 peers)
            prefix = torch.full((R, R), ROWS_PER_PEER, dtype=torch.int32, device=device).cumsum(0).to(torch.int32)
            report["weights_kernel_launch_us"] = round(back_to_back_host_us(lambda: push_combine_weights(
                weights, prefix, memory.peer_base_ptrs, staging_weights, rank, R, owner)), 2)
        for pieces in (1, 2, 4):
            def combine_host(pieces=pieces):
                streams.fork(combine_copy_jobs(x, copies, memory.peers, memory.peer_base_ptrs, memory.data_offset,
                                               memory.signals.combine_tail, rank, 1, pieces, owner, driver))
                streams.join()
            report[f"ep8_combine_jobs_{pieces}_pieces_us"] = round(
                back_to_back_host_us(combine_host, calls=5, rounds=11), 1)
        batch = _batch_copy(driver)
        if isinstance(batch, str):
            report["batch_copy"] = batch
        else:
            dst = targets.get("peer_symmetric", targets["own_symmetric"])
            step = ROWS_PER_PEER // 2 * ROW_BYTES
            for count in (1, 14):
                dsts = [dst + i * step for i in range(count)]
                srcs = [src] * count
                sizes = [step] * count
                try:
                    report[f"batch_copy_{count}_us"] = round(back_to_back_host_us(
                        lambda dsts=dsts, srcs=srcs, sizes=sizes: batch(dsts, srcs, sizes, stream)), 2)
                except Exception as error:   # the probe reports, it does not stop
                    report[f"batch_copy_{count}"] = f"{type(error).__name__}: {error}"
        torch.cuda.synchronize()
    dist.barrier(group=group)
    buffer.destroy()
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()
    with RankPool(args.ranks, use_gpu=True, timeout=300) as pool:
        reports = pool.run(probe)
    print(json.dumps(reports[0], indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports[0], f, indent=1)


if __name__ == "__main__":
    main()
