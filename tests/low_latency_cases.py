"""Low-latency cases run on the NVLink backend and on the CPU backend, compared.

Run on every rank of a RankPool, many cases per run (``compare_low_latency_cases``): the NVLink
side on the pool's group (NCCL on GPUs, or gloo under ``TRITON_INTERPRET=1``), the oracle on a
gloo group of its own over CPU copies, a case ahead in a thread (case_batches.py). Both backends
order an expert's rows by source rank, then token, so dispatch outputs must match bit for
bit: counts, src_info (-1 past the count), layout_range, e4m3 bytes and scales of the valid
rows, stats. Combine must match within bf16 rounding (the sums run in another order).

Shrink mode: cases with ``masks`` run on Buffers made with ``enable_shrink=True`` and set each
round's masks on both backends through the public API. Masks here are symmetric (r masks m
exactly when m masks r): with an asymmetric mask the NVLink rank that is not masking waits for
rows that never come (as in DeepEP), while the CPU backend cuts the pair both ways.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import nvlink_cases
import torch
import torch.distributed as dist
from case_batches import oracle_group, run_batch
from nvlink_cases import make_buffer, to_device

import tritonep as deep_ep
from tritonep.core import fp8

_state: dict = {}
# More Buffer options for the Buffers ``buffers`` makes (a caller's choice for this process's
# next Buffers, e.g. allow_nvlink_for_low_latency_mode).
buffer_options: dict = {}


@dataclass
class LowLatencyCase:
    seed: int
    tokens: tuple[int, ...]       # tokens per rank, each <= T
    T: int
    hidden: int
    num_experts: int
    num_topk: int
    use_fp8: bool = True
    round_scale: bool = False
    use_ue8m0: bool = False
    hook: bool = False
    zero_copy: bool = False
    use_out: bool = False
    routing: str = "random"       # random | skewed | one_expert | none
    calls: int = 1                # back-to-back dispatch+combine rounds (slots alternate)
    # Shrink mode, per round (rounds past the end: nothing masked), per rank: the ranks it masks
    # for the dispatch, and (``combine_masks``, None = unchanged) after the dispatch is sent,
    # before its hook and combine.
    masks: tuple | None = None
    combine_masks: tuple = ()


def symmetric_masks(num_ranks: int, dropped: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Every rank masks the ``dropped`` ranks, which mask every other rank."""
    return tuple(tuple(r for r in range(num_ranks) if r != me) if me in dropped else dropped
                 for me in range(num_ranks))


def buffers(group: dist.ProcessGroup, rdma_bytes: int, shrink: bool = False) -> tuple[deep_ep.Buffer, deep_ep.Buffer]:
    """Build (once per pool, again when more memory is needed) the NVLink buffer and a
    CPU-backend buffer on the oracle's gloo group; with ``shrink``, a separate pair made with
    enable_shrink."""
    key = "shrink" if shrink else "plain"
    if _state.get(f"{key} rdma_bytes", 0) < rdma_bytes:
        options = dict(num_rdma_bytes=rdma_bytes, low_latency_mode=True, enable_shrink=shrink)
        _state.pop(f"{key} nvlink", None)   # the old Buffer's memory goes before the new one is made
        _state[f"{key} nvlink"] = make_buffer(group, "nvlink", **options, **buffer_options)
        _state[f"{key} rdma_bytes"] = rdma_bytes
        _state[f"{key} cpu"] = make_buffer(oracle_group(group), "collective", **options)
    return _state[f"{key} nvlink"], _state[f"{key} cpu"]


def release_buffers(group: dist.ProcessGroup) -> None:
    """Drop the Buffers ``buffers`` and ``nvlink_cases`` keep on this rank and give their GPU
    memory back, so that a second pool can start beside this one (with 8 ranks sharing one GPU
    the kept Buffers fill it) and the next test module starts clean. The next calls make new
    ones."""
    import gc

    _state.clear()
    nvlink_cases.release_buffers(group)
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        dist.barrier(group=group)   # every rank dropped its mappings of the others' memory
        torch.cuda.ipc_collect()    # shared GPUs: memory other ranks had mapped (CUDA IPC)
        torch.cuda.empty_cache()


def set_masks(buffer: deep_ep.Buffer, ranks) -> None:
    """Mask exactly ``ranks`` on ``buffer`` (public API, queued on the current stream)."""
    buffer.low_latency_clean_mask_buffer()
    for rank in ranks:
        buffer.low_latency_update_mask_buffer(rank, True)


def make_inputs(case: LowLatencyCase, rank: int, round_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(case.seed * 7919 + round_index * 101 + rank)
    n, k, e = case.tokens[rank], case.num_topk, case.num_experts
    x = (torch.randn(n, case.hidden, generator=generator, dtype=torch.float32, device="cpu")
         * torch.exp(torch.randn(n, 1, generator=generator, dtype=torch.float32, device="cpu"))).to(torch.bfloat16)
    scores = torch.rand(n, e, generator=generator, dtype=torch.float32, device="cpu")
    if case.routing == "skewed":
        scores[:, : max(1, e // 8)] += 2.0
    elif case.routing == "one_expert":
        scores[:, 0] += 10.0
    topk_idx = scores.topk(k, dim=1).indices
    if case.routing == "none":
        topk_idx.fill_(-1)
    else:
        topk_idx[torch.rand(n, k, generator=generator, dtype=torch.float32, device="cpu") < 0.1] = -1
    return x, topk_idx, torch.rand(n, k, generator=generator, dtype=torch.float32, device="cpu")


def expert_outputs(packed, use_fp8: bool, rank: int) -> torch.Tensor:
    """A stand-in expert per local expert e: rows * (global id + 1) / 8, from the (dequantised)
    dispatch output, so a row sent to the wrong expert or token shows."""
    if use_fp8:
        data, scales = packed
        if scales.dtype == torch.int32:
            factors = fp8.unpack_ue8m0(scales)[..., : data.shape[-1] // 128]
        else:
            factors = scales
        rows = data.float().view(*data.shape[:2], -1, 128) * factors.float().unsqueeze(-1)
        rows = rows.view(data.shape)
    else:
        rows = packed.float()
    experts = rows.shape[0]
    factor = (torch.arange(experts, dtype=torch.float32, device=rows.device) + rank * experts + 1) / 8
    return (rows * factor.view(-1, 1, 1)).to(torch.bfloat16)


def _round(buffer: deep_ep.Buffer, case: LowLatencyCase, inputs, device: torch.device, stats: dict,
           masks=None, combine_masks=None) -> dict:
    x, topk_idx, weights = (t.to(device) for t in inputs)
    if masks is not None:
        set_masks(buffer, masks)
    packed, count, handle, _, hook = buffer.low_latency_dispatch(
        x, topk_idx, case.T, case.num_experts, cumulative_local_expert_recv_stats=stats["recv"],
        dispatch_wait_recv_cost_stats=stats.get("dispatch_wait"), use_fp8=case.use_fp8,
        round_scale=case.round_scale, use_ue8m0=case.use_ue8m0, return_recv_hook=case.hook)
    if combine_masks is not None:   # after the send: changes the combine, not this dispatch
        set_masks(buffer, combine_masks)
    if hook is not None:
        hook()
    expert_out = expert_outputs(packed, case.use_fp8, buffer.rank)
    source = expert_out
    if case.zero_copy:
        source = buffer.get_next_low_latency_combine_buffer(handle)
        source.copy_(expert_out)
    out = torch.full((x.shape[0], case.hidden), 3.0, dtype=torch.bfloat16, device=device) if case.use_out else None
    combined, _, hook = buffer.low_latency_combine(source, topk_idx, weights, handle, zero_copy=case.zero_copy,
                                                   return_recv_hook=case.hook, out=out,
                                                   combine_wait_recv_cost_stats=stats.get("combine_wait"))
    if hook is not None:
        hook()
    if out is not None:
        assert combined.data_ptr() == out.data_ptr()
    src_info, layout_range = handle[0], handle[1]
    valid = count.tolist()
    result = {"count": count, "src_info": src_info, "layout_range": layout_range, "combined": combined}
    data = packed[0] if case.use_fp8 else packed
    result["rows"] = [data[e, :valid[e]] for e in range(len(valid))]
    if case.use_fp8:
        result["scales"] = [packed[1][e, :valid[e]] for e in range(len(valid))]
    return result


def _differences(name: str, got, expected) -> list[str]:
    if isinstance(expected, list):
        return [m for i, (g, e) in enumerate(zip(got, expected)) for m in _differences(f"{name}[{i}]", g, e)]
    if got.shape != expected.shape:
        return [f"{name}: shape {tuple(got.shape)} != {tuple(expected.shape)}"]
    if name.endswith("combined"):
        ok = torch.allclose(got.float(), expected.float(), rtol=2 ** -7, atol=1e-3)
    elif got.dtype.itemsize == 1:
        ok = torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    else:
        ok = torch.equal(got, expected)
    if ok:
        return []
    return [f"{name}: differs ({(got.float() != expected.float()).sum().item()} elements)"]


def _round_masks(case: LowLatencyCase, rank: int, round_index: int) -> tuple:
    """(dispatch masks, combine masks or None) of this rank in this round; (None, None) without shrink."""
    if case.masks is None:
        return None, None
    masks = case.masks[round_index][rank] if round_index < len(case.masks) else ()
    combine = case.combine_masks[round_index] if round_index < len(case.combine_masks) else None
    return masks, (combine[rank] if combine is not None else None)


def _expected_rounds(cpu: deep_ep.Buffer, case: LowLatencyCase, rank: int, num_ranks: int) -> dict:
    """The oracle of a case on this rank: each round's inputs and the CPU backend's results and
    wait stats (shrink mode), and its cumulative receive stats."""
    stats = {"recv": torch.zeros(case.num_experts // num_ranks, dtype=torch.int32, device="cpu")}
    rounds = []
    for round_index in range(case.calls):
        inputs = make_inputs(case, rank, round_index)
        masks, combine_masks = _round_masks(case, rank, round_index)
        if masks is not None:   # fresh wait stats per round: the ranks skipped must get nothing
            stats["dispatch_wait"] = torch.zeros(num_ranks, dtype=torch.int64, device="cpu")
            stats["combine_wait"] = torch.zeros(num_ranks, dtype=torch.int64, device="cpu")
        expected = _round(cpu, case, inputs, torch.device("cpu"), stats, masks, combine_masks)
        waits = {kind: stats[kind].tolist() for kind in ("dispatch_wait", "combine_wait") if masks is not None}
        rounds.append((inputs, expected, waits))
    return {"rounds": rounds, "recv": stats["recv"]}


def _masked_waits(name: str, round_index: int, waits: dict, masks, combine_masks) -> list[str]:
    """Shrink mode: the waits recorded for the ranks masked in this round (there must be none)."""
    skipped = set(masks)
    return ([f"call {round_index}: {name} dispatch waited {waits['dispatch_wait'][r]} ns for masked rank {r}"
             for r in skipped if waits["dispatch_wait"][r]]
            + [f"call {round_index}: {name} combine waited {waits['combine_wait'][r]} ns for masked rank {r}"
               for r in skipped | set(combine_masks or ()) if waits["combine_wait"][r]])


def as_it_is() -> str:
    """The setting ``compare_low_latency_cases`` uses by default: Buffers made as ``buffers``
    makes them. A setting returns its name (for the mismatches; "" here)."""
    return ""


def compare_low_latency_cases(group: dist.ProcessGroup, cases: list[LowLatencyCase], skip_rank: int | None = None,
                              settings: Sequence[Callable[[], str]] = (as_it_is,)
                              ) -> tuple[list[list[str]], list[dict]]:
    """The mismatches on this rank of each case (empty when the NVLink and CPU backends agree),
    and each case's timings (``case_batches.run_batch``).

    ``skip_rank`` (shrink mode): that rank makes no NVLink call at all, as if it had died; the
    others must mask it. It still takes part in the CPU oracle, whose collectives need it.

    ``settings``: each sets up where the next Buffers are made (the environment, ``_state``,
    ``buffer_options``: a node split, a transport) and returns its name. Every case runs on each
    setting's NVLink Buffers, compared with one oracle: the CPU backend's results do not depend
    on them.
    """
    rank, num_ranks = group.rank(), group.size()
    # The Buffers first, each sized for the largest case of the batch that uses it: the CPU
    # Buffers are made on the oracle's group, which its thread then has to itself.
    needed: dict[bool, int] = {}
    for case in cases:
        shrink = case.masks is not None
        needed[shrink] = max(needed.get(shrink, 0), deep_ep.Buffer.get_low_latency_rdma_size_hint(
            case.T, case.hidden, num_ranks, case.num_experts))
    sides = [(setting(), {shrink: buffers(group, rdma_bytes, shrink) for shrink, rdma_bytes in sorted(needed.items())})
             for setting in settings]

    def oracle(case: LowLatencyCase) -> dict:
        return _expected_rounds(sides[0][1][case.masks is not None][1], case, rank, num_ranks)

    def compare(case: LowLatencyCase, expected: dict) -> list[str]:
        if rank == skip_rank:
            return []
        return [f"{name}: {problem}" if name else problem for name, pairs in sides
                for problem in _compare_rounds(pairs[case.masks is not None][0], case, expected, rank, num_ranks)]

    return run_batch(group, cases, oracle, compare)


def _compare_rounds(nvlink: deep_ep.Buffer, case: LowLatencyCase, expected: dict, rank: int,
                    num_ranks: int) -> list[str]:
    """The case's rounds on ``nvlink`` with the oracle's inputs, against its results (``expected``,
    ``_expected_rounds``): the mismatches."""
    device = nvlink.device
    stats = {"recv": torch.zeros(case.num_experts // num_ranks, dtype=torch.int32, device=device)}
    problems: list[str] = []
    for round_index, (inputs, expected_round, cpu_waits) in enumerate(expected["rounds"]):
        masks, combine_masks = _round_masks(case, rank, round_index)
        if masks is not None:
            stats["dispatch_wait"] = torch.zeros(num_ranks, dtype=torch.int64, device=device)
            stats["combine_wait"] = torch.zeros(num_ranks, dtype=torch.int64, device=device)
        got = _round(nvlink, case, inputs, device, stats, masks, combine_masks)
        expected_round = to_device(expected_round, device)
        for key in expected_round:
            problems += [f"call {round_index}: {m}" for m in _differences(key, got[key], expected_round[key])]
        if masks is not None:
            waits = {kind: stats[kind].tolist() for kind in ("dispatch_wait", "combine_wait")}
            problems += _masked_waits("nvlink", round_index, waits, masks, combine_masks)
            problems += _masked_waits("cpu", round_index, cpu_waits, masks, combine_masks)
    return problems + _differences("recv_stats", stats["recv"], expected["recv"].to(device))


def compare_low_latency(group: dist.ProcessGroup, case: LowLatencyCase, skip_rank: int | None = None) -> list[str]:
    """``compare_low_latency_cases`` for one case: its mismatches on this rank."""
    return compare_low_latency_cases(group, [case], skip_rank)[0][0]


def rejoin_after_clean(group: dist.ProcessGroup, case: LowLatencyCase) -> list[str]:
    """After ``compare_low_latency(..., skip_rank=...)``: every rank unmasks everyone and calls
    clean_low_latency_buffer (which resets the call counters the idle rank missed), then one
    unmasked round on all ranks must match the CPU backend again."""
    rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(case.T, case.hidden, group.size(), case.num_experts)
    nvlink, _ = buffers(group, rdma_bytes, shrink=True)
    nvlink.low_latency_clean_mask_buffer()
    status = torch.ones(group.size(), dtype=torch.int32, device=nvlink.device)
    nvlink.low_latency_query_mask_buffer(status)
    problems = [f"mask after clean: {status.tolist()}"] if status.cpu().tolist() != [0] * group.size() else []
    nvlink.clean_low_latency_buffer(case.T, case.hidden, case.num_experts)
    rejoined = LowLatencyCase(**{**case.__dict__, "masks": (), "calls": 2})
    return problems + compare_low_latency(group, rejoined)


def graph_replay(group: dist.ProcessGroup, seed: int, replays: int = 3, masked: bool = False) -> list[str]:
    """Capture dispatch -> stand-in expert -> combine in one CUDA graph, replay it on new inputs
    copied into the captured tensors, and compare each replay with the CPU backend.

    ``masked`` (shrink mode): the capture also sets this rank's masks (the last rank dropped; a
    single rank masks itself) before the dispatch and clears them after the combine; the CPU
    backend uses the same masks."""
    size = group.size()
    case = LowLatencyCase(seed=seed, tokens=tuple(32 for _ in range(size)), T=32, hidden=1024,
                          num_experts=8 * size, num_topk=4, masks=() if masked else None)
    masks = (symmetric_masks(size, (size - 1,))[group.rank()] if size > 1 else (0,)) if masked else ()
    rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(case.T, case.hidden, size, case.num_experts)
    nvlink, cpu = buffers(group, rdma_bytes, shrink=masked)
    device = nvlink.device
    static = [t.to(device) for t in make_inputs(case, group.rank(), 0)]

    def step():
        if masked:
            set_masks(nvlink, masks)
        packed, count, handle, _, _ = nvlink.low_latency_dispatch(static[0], static[1], case.T, case.num_experts)
        combined, _, _ = nvlink.low_latency_combine(expert_outputs(packed, True, nvlink.rank), static[1], static[2],
                                                    handle)
        if masked:
            nvlink.low_latency_clean_mask_buffer()
        return count, combined

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()                                  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        count, combined = step()
    problems = []
    if masked:
        set_masks(cpu, masks)
    for replay in range(1, replays + 1):
        inputs = make_inputs(case, group.rank(), replay)
        for target, value in zip(static, inputs):
            target.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        x, topk_idx, weights = inputs
        packed, expected_count, handle, _, _ = cpu.low_latency_dispatch(x, topk_idx, case.T, case.num_experts)
        expected, _, _ = cpu.low_latency_combine(expert_outputs(packed, True, cpu.rank), topk_idx, weights, handle)
        problems += _differences(f"replay {replay} count", count.cpu(), expected_count)
        problems += _differences(f"replay {replay} combined", combined.cpu(), expected)
    if masked:
        status = torch.ones(size, dtype=torch.int32, device=device)
        nvlink.low_latency_query_mask_buffer(status)
        if status.cpu().tolist() != [0] * size:
            problems.append(f"masks after the graph: {status.tolist()}")
        cpu.low_latency_clean_mask_buffer()
    return problems


def stalled_peer_error(group: dist.ProcessGroup) -> str:
    """Rank 0 dispatches alone: its receive must give up after TRITONEP_TIMEOUT_S and its next
    call must raise, naming the phase and the rank it waited for."""
    T, hidden, num_experts = 4, 256, 2 * group.size()
    buffer = make_buffer(group, "nvlink", {"TRITONEP_TIMEOUT_S": "2"}, low_latency_mode=True,
                         num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(T, hidden, group.size(),
                                                                                       num_experts))
    message = ""
    if group.rank() == 0:
        x = torch.randn(T, hidden, device=buffer.device, dtype=torch.float32).to(torch.bfloat16)
        topk_idx = torch.zeros(T, 1, dtype=torch.int64, device=buffer.device)
        buffer.low_latency_dispatch(x, topk_idx, T, num_experts)
        if buffer.device.type == "cuda":
            torch.cuda.synchronize()
        try:
            buffer.low_latency_dispatch(x, topk_idx, T, num_experts)
        except RuntimeError as error:
            message = str(error)
    dist.barrier(group=group)
    return message


# Two micro-batches in flight, as serving stacks overlap them: every send with a receive hook,
# the eight steps in different orders. "D0" sends batch 0's dispatch, "d0" runs its hook; "C0"
# and "c0" the same for its combine. A combine needs its dispatch received (d before C).
SCHEDULES = {
    "forward": "D0 D1 d0 d1 C0 C1 c0 c1",
    "reverse": "D0 D1 d1 d0 C0 C1 c1 c0",
    "interleaved": "D0 D1 d0 C0 d1 C1 c1 c0",
    "pipelined": "D0 d0 D1 C0 d1 c0 C1 c1",
}


def two_micro_batches(group: dist.ProcessGroup, case: LowLatencyCase, schedule: str) -> list[str]:
    """Run two micro-batches on the NVLink backend in the order ``SCHEDULES[schedule]``, then
    each one alone on the CPU backend: dispatch outputs and combined rows must agree."""
    rank = group.rank()
    rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(case.T, case.hidden, group.size(), case.num_experts)
    nvlink, cpu = buffers(group, rdma_bytes)
    device = nvlink.device
    batches = [make_inputs(case, rank, index) for index in range(2)]
    options = dict(use_fp8=case.use_fp8, round_scale=case.round_scale, use_ue8m0=case.use_ue8m0)
    dispatched: dict = {}
    combined: dict = {}
    hooks: dict = {}
    for step in SCHEDULES[schedule].split():
        kind, index = step[0], int(step[1])
        x, topk_idx, weights = (t.to(device) for t in batches[index])
        if kind == "D":
            packed, count, handle, _, hooks[step] = nvlink.low_latency_dispatch(
                x, topk_idx, case.T, case.num_experts, return_recv_hook=True, **options)
            dispatched[index] = (packed, count, handle)
        elif kind == "C":
            packed, _, handle = dispatched[index]
            combined[index], _, hooks[step] = nvlink.low_latency_combine(
                expert_outputs(packed, case.use_fp8, rank), topk_idx, weights, handle, return_recv_hook=True)
        else:
            hooks.pop(step.upper())()
    problems = []
    for index, (x, topk_idx, weights) in enumerate(batches):
        packed, count, handle, _, _ = cpu.low_latency_dispatch(x, topk_idx, case.T, case.num_experts, **options)
        expected, _, _ = cpu.low_latency_combine(expert_outputs(packed, case.use_fp8, rank), topk_idx, weights,
                                                 handle)
        got_packed, got_count, got_handle = dispatched[index]
        valid = [int(c) for c in count]
        data, got_data = (packed[0], got_packed[0]) if case.use_fp8 else (packed, got_packed)
        problems += [f"{schedule}: batch {index} {m}" for m in
                     _differences("count", got_count.cpu(), count)
                     + _differences("src_info", got_handle[0].cpu(), handle[0])
                     + _differences("rows", [got_data[e, :v].cpu() for e, v in enumerate(valid)],
                                    [data[e, :v] for e, v in enumerate(valid)])
                     + _differences("combined", combined[index].cpu(), expected)]
    return problems


def survivors_mask_dead_rank(group: dist.ProcessGroup, case: LowLatencyCase, victim: int, kill: bool,
                             timeout_s: float) -> list[str] | None:
    """Shrink mode with a rank that dies (``kill``: SIGKILL) or stalls (makes no more calls)
    after round 0, and no mask set by hand: the survivors' calls must complete, the waits on
    the victim masking it (``low_latency_query_mask_buffer`` shows it, a warning names it), and
    every later round must equal the CPU backend's with the victim masked by everyone.
    Needs a pool of its own: the victim never makes another call on the pool's group. A
    stalled victim waits for the survivors on the gloo group at the end (no Buffer call), so
    that its memory outlives their calls and the pool's processes stay in step for a next run;
    after a kill the pool has a dead member."""
    import os
    import signal
    import warnings

    rank, size = group.rank(), group.size()
    rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(case.T, case.hidden, size, case.num_experts)
    options = dict(num_rdma_bytes=rdma_bytes, low_latency_mode=True, enable_shrink=True)
    nvlink = make_buffer(group, "nvlink", {"TRITONEP_TIMEOUT_S": str(timeout_s)}, **options)
    gloo = group if dist.get_backend(group) == "gloo" else dist.new_group(backend="gloo")
    cpu = make_buffer(gloo, "collective", **options)
    experts_local = case.num_experts // size
    stats = {name: {"recv": torch.zeros(experts_local, dtype=torch.int32, device=device)}
             for name, device in (("nvlink", nvlink.device), ("cpu", torch.device("cpu")))}
    # The oracle first, while every rank is alive: round 0 unmasked, then the victim masked.
    dropped = symmetric_masks(size, (victim,))[rank]
    expected = [to_device(_round(cpu, case, make_inputs(case, rank, index), torch.device("cpu"), stats["cpu"],
                                 dropped if index else None), nvlink.device) for index in range(case.calls)]
    problems = []
    got = _round(nvlink, case, make_inputs(case, rank, 0), nvlink.device, stats["nvlink"])
    for key in expected[0]:
        problems += [f"round 0: {m}" for m in _differences(key, got[key], expected[0][key])]
    dist.barrier(group=gloo)
    if rank == victim:
        if kill:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier(group=gloo)
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for index in range(1, case.calls):
            got = _round(nvlink, case, make_inputs(case, rank, index), nvlink.device, stats["nvlink"])
            for key in expected[index]:
                problems += [f"round {index}: {m}" for m in _differences(key, got[key], expected[index][key])]
    status = torch.zeros(size, dtype=torch.int32, device=nvlink.device)
    nvlink.low_latency_query_mask_buffer(status)
    if status.cpu().tolist() != [int(r == victim) for r in range(size)]:
        problems.append(f"mask after the victim stopped: {status.cpu().tolist()}")
    notices = [str(w.message) for w in caught if f"waiting for rank {victim}, and masked it" in str(w.message)]
    if not notices:
        problems.append(f"no warning named rank {victim}: {[str(w.message) for w in caught]}")
    problems += _differences("recv_stats", stats["nvlink"]["recv"].cpu(), stats["cpu"]["recv"][:])
    if not kill:
        dist.barrier(group=gloo)
    return problems
