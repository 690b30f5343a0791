"""Host microseconds per call of the CUDA calls a combine replay makes, each way there is to make
them, and of the one-rank layout and combine: ``python -m benchmarks.driver_calls [--out FILE]``
on one GPU (about 10-20 s).

Sections, each figure the median over rounds of the mean of back-to-back calls, with the GPU
synchronised between rounds (so that a full launch queue never makes the host wait):

* ``driver``: an event record, a stream wait, and the launch of a one-node graph and of a graph
  like an EP4 combine's side work (6 copies, each followed by a stream write), through
  cuda-bindings (as the side streams called them before) and through ctypes (``DriverCalls``,
  result checked as the package does); torch's ``Event.record`` and ``Stream.wait_event``
  beside them;
* ``fork_join``: a captured graph's fork and join, the five calls as cuda-bindings made them
  against ``PeerStreams.fork_graph`` + ``join`` now;
* ``allocation``: ``torch.empty`` alone, and the layout's three outputs made three ways (three
  allocations; the two int32 counts as one allocation split in two; one byte allocation viewed
  as all three);
* ``buffer``: ``Buffer.get_dispatch_layout`` and a replayed ``Buffer.combine`` (with and without
  top-k weights) at one rank. One rank sends no rows to a peer, so this combine forks no side
  work: it is the replay's own path and its kernel launch.

Every section runs on its own: one that fails prints its error and the others still run. The
run ends itself after ``--deadline`` seconds (default 120) with every thread's stack printed.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import statistics
import time
import traceback
from collections.abc import Callable

import torch

from . import inputs
from .internals import DriverCalls, PeerStreams, driver_result, init_one_rank_gpu_group, raw_current_stream

CALLS, ROUNDS, WARMUP = 200, 25, 20


def per_call_us(fn: Callable[[], object], calls: int = CALLS, rounds: int = ROUNDS) -> float:
    """Median over ``rounds`` of the host microseconds per call of ``calls`` calls of ``fn``."""
    for _ in range(WARMUP):
        fn()
    samples = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        begin = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - begin) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)


def _capture(bindings: object, stream: torch.cuda.Stream, body: Callable[[int], None]) -> object:
    """cuda-bindings' CUgraphExec of what ``body(raw stream)`` issues on ``stream``."""
    mode = bindings.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
    driver_result(bindings.cuStreamBeginCapture(stream.cuda_stream, mode), "capture")
    try:
        body(stream.cuda_stream)
    finally:
        graph = driver_result(bindings.cuStreamEndCapture(stream.cuda_stream), "capture")
    return driver_result(bindings.cuGraphInstantiate(graph, 0), "instantiation")


def _graph_bodies(calls: DriverCalls, scratch: torch.Tensor) -> dict[str, Callable[[int], None]]:
    """What the test graphs hold, in ``scratch`` (8 MB): one stream write, or 6 copies of 64 KB
    each followed by a stream write (an EP4 combine's 3 peers x 2 pieces, in local memory)."""
    base, piece = scratch.data_ptr(), 64 << 10

    def one_write(stream: int) -> None:
        calls.check(calls.cuStreamWriteValue64(stream, base, 1, 0), "write")

    def combine_like(stream: int) -> None:
        for k in range(6):
            calls.check(calls.cuMemcpyDtoDAsync(base + (4 << 20) + k * piece, base + k * piece, piece, stream), "copy")
            calls.check(calls.cuStreamWriteValue64(stream, base + 8 * k, k + 1, 0), "write")
    return {"one write": one_write, "6 copies + 6 writes": combine_like}


def driver_rows(bindings: object, calls: DriverCalls, device: torch.device) -> dict[str, float]:
    """Per-call host time of each driver call through cuda-bindings, ctypes and torch."""
    caller, side = torch.cuda.current_stream(), torch.cuda.Stream()
    caller_raw, side_raw = caller.cuda_stream, side.cuda_stream
    event_object = driver_result(bindings.cuEventCreate(2), "event creation")   # CU_EVENT_DISABLE_TIMING
    event_raw = calls.new_event()
    torch_event = torch.cuda.Event()
    check = calls.check
    rows = {
        "event record, cuda-bindings": lambda: driver_result(bindings.cuEventRecord(event_object, caller_raw), ""),
        "event record, ctypes": lambda: check(calls.cuEventRecord(event_raw, caller_raw), ""),
        "event record, torch Event.record(stream)": lambda: torch_event.record(caller),
        "stream wait, cuda-bindings": lambda: driver_result(bindings.cuStreamWaitEvent(side_raw, event_object, 0), ""),
        "stream wait, ctypes": lambda: check(calls.cuStreamWaitEvent(side_raw, event_raw, 0), ""),
        "stream wait, torch Stream.wait_event": lambda: side.wait_event(torch_event),
        "torch.cuda.current_stream()": torch.cuda.current_stream,
    }
    result = {name: per_call_us(fn) for name, fn in rows.items()}
    scratch = torch.zeros(8 << 20, dtype=torch.uint8, device=device)
    for graph_name, body in _graph_bodies(calls, scratch).items():
        graph = _capture(bindings, side, body)
        graph_raw = int(graph)
        result[f"graph launch ({graph_name}), cuda-bindings"] = per_call_us(
            lambda graph=graph: driver_result(bindings.cuGraphLaunch(graph, side_raw), ""), calls=100)
        result[f"graph launch ({graph_name}), ctypes"] = per_call_us(
            lambda graph_raw=graph_raw: check(calls.cuGraphLaunch(graph_raw, side_raw), ""), calls=100)
        torch.cuda.synchronize()
        driver_result(bindings.cuGraphExecDestroy(graph), "graph destruction")
    return result


def fork_join_rows(bindings: object, calls: DriverCalls, device: torch.device) -> dict[str, float]:
    """A combine-like graph's fork and join: the five cuda-bindings calls the side streams made
    before, against ``PeerStreams`` now."""
    scratch = torch.zeros(8 << 20, dtype=torch.uint8, device=device)
    body = _graph_bodies(calls, scratch)["6 copies + 6 writes"]
    streams = PeerStreams(device, calls)
    graph_raw = streams.capture(lambda branch: body(torch.cuda.current_stream().cuda_stream))
    side = torch.cuda.Stream()
    side_raw = side.cuda_stream
    graph = _capture(bindings, side, body)
    start, done = (driver_result(bindings.cuEventCreate(2), "event creation") for _ in range(2))

    def cuda_bindings_fork_join() -> None:
        caller = raw_current_stream()
        driver_result(bindings.cuEventRecord(start, caller), "event record")
        driver_result(bindings.cuStreamWaitEvent(side_raw, start, 0), "stream wait")
        driver_result(bindings.cuGraphLaunch(graph, side_raw), "graph launch")
        driver_result(bindings.cuEventRecord(done, side_raw), "event record")
        driver_result(bindings.cuStreamWaitEvent(caller, done, 0), "stream wait")

    def peer_streams_fork_join() -> None:
        caller = raw_current_stream()
        streams.fork_graph(graph_raw, caller)
        streams.join(caller)

    result = {"fork + join, 5 cuda-bindings calls": per_call_us(cuda_bindings_fork_join, calls=100),
              "fork + join, PeerStreams (ctypes)": per_call_us(peer_streams_fork_join, calls=100)}
    torch.cuda.synchronize()
    streams.drop_graph(graph_raw)
    driver_result(bindings.cuGraphExecDestroy(graph), "graph destruction")
    return result


def allocation_rows(device: torch.device, tokens: int, ranks: int = 4, experts: int = 256) -> dict[str, float]:
    """``torch.empty`` and the layout's three outputs ([R] and [E] int32, [N, R] bool) made three
    ways."""
    int32, count_bytes = torch.int32, 4 * (ranks + experts)

    def three() -> object:
        return (torch.empty(ranks, dtype=int32, device=device), torch.empty(experts, dtype=int32, device=device),
                torch.empty(tokens, ranks, dtype=torch.bool, device=device))

    def split_counts() -> object:
        counts = torch.empty(ranks + experts, dtype=int32, device=device)
        return (*counts.split_with_sizes((ranks, experts)), torch.empty(tokens, ranks, dtype=torch.bool, device=device))

    def one_block() -> object:
        block = torch.empty(count_bytes + tokens * ranks, dtype=torch.uint8, device=device)
        return (block[: 4 * ranks].view(int32), block[4 * ranks: count_bytes].view(int32),
                block[count_bytes:].view(torch.bool).view(tokens, ranks))

    return {"torch.empty, one tensor": per_call_us(lambda: torch.empty(tokens, dtype=torch.bool, device=device)),
            "layout outputs, 3 x torch.empty": per_call_us(three),
            "layout outputs, counts split_with_sizes + torch.empty": per_call_us(split_counts),
            "layout outputs, one uint8 block and views": per_call_us(one_block)}


def buffer_rows(device: torch.device, tokens: int, hidden: int, experts: int, topk: int) -> dict[str, float]:
    """Host time per call of the public calls at one rank (NCCL group of one)."""
    import torch.distributed as dist

    import tritonep

    x, topk_idx, topk_weights = inputs.routing(tokens, hidden, experts, topk, 0, device)
    buffer = tritonep.Buffer(dist.group.WORLD, num_nvl_bytes=inputs.nvl_bytes(tokens, hidden, 1))
    tritonep.Buffer.set_num_sms(24)
    config = tritonep.Buffer.get_dispatch_config(1)
    combine_config = tritonep.Buffer.get_combine_config(1)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, experts)
    recv_x, _, recv_weights, _, handle, _ = buffer.dispatch(
        x, topk_idx=topk_idx, topk_weights=topk_weights, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, config=config)
    return {
        "Buffer.get_dispatch_layout": per_call_us(lambda: buffer.get_dispatch_layout(topk_idx, experts), calls=50),
        "Buffer.combine, replayed": per_call_us(lambda: buffer.combine(recv_x, handle, config=combine_config),
                                                calls=20),
        "Buffer.combine with top-k weights, replayed": per_call_us(
            lambda: buffer.combine(recv_x, handle, topk_weights=recv_weights, config=combine_config), calls=20),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.driver_calls", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the figures as JSON to this file")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--deadline", type=float, default=120.0, help="seconds before the run ends itself")
    args = parser.parse_args(argv)
    faulthandler.dump_traceback_later(args.deadline, exit=True)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.driver_calls needs a GPU")
    device = init_one_rank_gpu_group()
    from cuda.bindings import driver as bindings

    calls = DriverCalls(bindings)
    sections = {
        "driver": lambda: driver_rows(bindings, calls, device),
        "fork_join": lambda: fork_join_rows(bindings, calls, device),
        "allocation": lambda: allocation_rows(device, args.tokens),
        "buffer": lambda: buffer_rows(device, args.tokens, args.hidden, args.experts, args.topk),
    }
    report: dict[str, object] = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__}
    print(f"host us per call, median of {ROUNDS} rounds of back-to-back calls; {report['device']}")
    for name, section in sections.items():
        try:
            rows = section()
        except Exception as error:   # one section failing leaves the others to run
            traceback.print_exc()
            report[name] = {"error": f"{type(error).__name__}: {error}"}
            print(f"\n[{name}] FAILED: {error}")
            continue
        report[name] = rows
        print(f"\n[{name}]")
        for row, value in rows.items():
            print(f"  {row:<58} {value:8.2f}")
    if args.out:
        with open(args.out, "w") as file:
            json.dump(report, file, indent=1)
        print(f"\nwrote {args.out}")
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main()
