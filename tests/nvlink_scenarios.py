"""GPU and interpreter scenarios of the NVLink backend beyond one case against the CPU backend:
the staging accounting, errors that must reach every rank, fresh dispatches in sequence and in
a CUDA graph, a low-latency-only Buffer, empty inputs (run on every rank of a RankPool)."""

from __future__ import annotations

import random

import torch
import torch.distributed as dist
from deep_ep_user import dispatch_with_layout
from nvlink_cases import Case, compare_cases, make_buffer, round_trip, shared_buffers

import tritonep as deep_ep


def staging_released_exactly(group: dist.ProcessGroup, buffer: deep_ep.Buffer) -> bool:
    """The staging accounting, once the GPUs are idle: on every rank, each peer's receivers
    have added to this rank's dispatch_done word exactly as often as the host counted
    (``dispatch_released``, the same on every rank), less the copy-engine receive's release
    that every rank still owes until its next dispatch (``dispatch_release_due``). More would let
    a sender overwrite staging that a peer still reads; fewer would hang the next dispatch."""
    backend = buffer.backend
    if buffer.device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier(group=group)
    memory = backend.memory
    first = memory.signals.dispatch_done
    done = memory.signal_words()[first: first + group.size()].tolist()
    state = backend.normal.state
    released = state.dispatch_released - state.dispatch_release_due
    return all(count == released for peer, count in enumerate(done) if peer != group.rank())


def copy_engine_dispatch_batch(group: dist.ProcessGroup, cases: list[Case], nvl_bytes: int,
                               tuning: dict | None = None) -> tuple[list[list[str]], list[dict]]:
    """``compare_cases`` with the copy-engine receive of cached dispatches on (and ``tuning``'s
    other changes), then its counters once the GPUs are idle (reported with the last case): the
    staging releases as above, and every peer's arrived word for this rank at the senders the
    host counted (``dispatch_arrived``, the same on every rank), which must have grown (with 2+
    ranks: one rank sends nothing and takes the usual path), and the count this rank's arrival
    waits keep on the GPU (``dispatch_counted``) at it too."""
    nvlink, _ = shared_buffers(group, nvl_bytes)
    state = nvlink.backend.normal.state
    arrived_before = state.dispatch_arrived
    problems, times = compare_cases(group, cases, nvl_bytes, dict(tuning or {}, copy_engine_dispatch=True))
    counters = []
    if not staging_released_exactly(group, nvlink):
        counters.append(f"done words differ from the {state.dispatch_released} receivers counted")
    signals, words = nvlink.backend.memory.signals, nvlink.backend.memory.signal_words()
    arrived = words[signals.dispatch_arrived: signals.dispatch_arrived + group.size()].tolist()
    if any(count != state.dispatch_arrived for peer, count in enumerate(arrived) if peer != group.rank()):
        counters.append(f"arrived words {arrived}, expected {state.dispatch_arrived} from each peer")
    counted = int(words[signals.dispatch_counted])
    if group.size() > 1 and counted != state.dispatch_arrived:
        counters.append(f"the arrival waits counted {counted} senders, the host {state.dispatch_arrived}")
    if group.size() > 1 and state.dispatch_arrived == arrived_before:
        counters.append("no cached dispatch took the copy-engine receive")
    problems[-1] = problems[-1] + counters
    return problems, times


def invalid_expert_id_error(group: dist.ProcessGroup, nvl_bytes: int = 1 << 24) -> tuple[str, bool]:
    """Rank 0 routes to expert E (out of range): every rank's dispatch must raise, none hang.

    On the GPU the front end does not read ids back (that would sync every call); the layout
    kernel counts them and the count exchange stops all ranks. (On CPU tensors the front end
    checks the ids itself, on rank 0 only: GPU runs only.) A dispatch of the same shape goes
    first, so the refused one launches its receive half before the read-back; it must stand
    down, and round trips after it must be exact. Returns (the message, whether they were).
    """
    nvlink, _ = shared_buffers(group, nvl_bytes)
    # Every step runs on every rank whatever an earlier one gave (the steps are collective).
    checks = [round_trip(nvlink, 64, 256, seed=1)[1]]
    topk_idx = torch.randint(0, 4 * group.size(), (64, 2), device=nvlink.device)
    if group.rank() == 0:
        topk_idx[5, 1] = 4 * group.size()
    message = ""
    try:
        round_trip(nvlink, 64, 256, seed=2, topk_idx=topk_idx)
    except deep_ep.InputError as error:
        message = str(error)
    checks += [staging_released_exactly(group, nvlink), round_trip(nvlink, 64, 256, seed=3)[1],
               round_trip(nvlink, 64, 256, seed=4)[1]]
    return message, all(checks)


def staging_overflow_error(group: dist.ProcessGroup) -> tuple[str, bool]:
    """A fresh dispatch that would put more rows on rank 0 than its staging holds (a 2 MB
    Buffer: 496 rows of hidden 1024) raises on every rank. Its receive halves were launched
    before the read-back (earlier calls of the shape give a guess), and rank 0's alone needs
    more rows than guessed: the others must stand down on the staging check. Round trips
    before and after must be exact. Returns (the message, whether they were)."""
    buffer = make_buffer(group, "nvlink", num_nvl_bytes=1 << 21, explicitly_destroy=True)
    # Every step runs on every rank whatever an earlier one gave (the steps are collective).
    checks = [round_trip(buffer, 100, 1024, seed=5)[1], round_trip(buffer, 60, 1024, seed=6)[1]]
    message = ""
    try:
        round_trip(buffer, 600, 1024, seed=7, routing="one_rank")
    except deep_ep.InputError as error:
        message = str(error)
    checks += [staging_released_exactly(group, buffer), round_trip(buffer, 100, 1024, seed=8)[1],
               round_trip(buffer, 90, 1024, seed=9)[1]]
    buffer.destroy()
    return message, all(checks)


def fresh_dispatch_sequence(group: dist.ProcessGroup, seed: int, calls: int, nvl_bytes: int = 1 << 24) -> list[str]:
    """Fresh dispatches of one shape back to back, each rank with its own random token count
    and the routing random, skewed or all to rank 0 per call: the outputs' guess from the
    previous call fits, overflows or is far too large in turn. Returns the calls whose round
    trip was not exact or whose staging accounting was off (empty: all good)."""
    nvlink, _ = shared_buffers(group, nvl_bytes)
    failures = []
    for call in range(calls):
        rng = random.Random(seed * 1000 + call)   # the same choices on every rank
        counts = [rng.choice([0, 1, 17, 64, 200, 333]) for _ in range(group.size())]
        routing = rng.choice(["random", "skewed", "one_rank"])
        recv_x, exact = round_trip(nvlink, counts[group.rank()], 128, seed=seed + call, routing=routing)
        released = staging_released_exactly(group, nvlink)   # collective: on every rank, whatever exact is
        if not (exact and released):
            failures.append(f"call {call} ({counts}, {routing}): exact={exact}, released={released}")
    return failures


def fresh_dispatch_storage_rows(group: dist.ProcessGroup, token_counts: tuple[int, ...],
                                nvl_bytes: int = 1 << 24) -> list[tuple[int, int]]:
    """Fresh dispatches of one shape with these token counts (every rank alike), each followed
    by a combine. Returns, per call, (rows received, rows of the storage behind recv_x, whether
    the combine restored the input, whether staging was released exactly): larger storage
    means the outputs were allocated before the counts came back, from a guess."""
    nvlink, _ = shared_buffers(group, nvl_bytes)
    rows = []
    for call, num_tokens in enumerate(token_counts):
        recv_x, exact = round_trip(nvlink, num_tokens, 128, seed=50 + call)
        released = staging_released_exactly(group, nvlink)
        rows.append((recv_x.shape[0], recv_x.untyped_storage().nbytes() // (128 * 2), exact, released))
    return rows


def fresh_dispatch_in_graph_error(group: dist.ProcessGroup, nvl_bytes: int = 1 << 22) -> tuple[str, bool]:
    """A fresh dispatch inside CUDA-graph capture must raise at once (it would wait for counts
    the capture never produces); the Buffer then still dispatches outside the capture.
    Returns (the message, whether the dispatch after it received what the CPU backend receives
    from the same inputs)."""
    nvlink, cpu = shared_buffers(group, nvl_bytes)
    num_experts = 4 * group.size()
    topk_idx = torch.randint(0, num_experts, (32, 2), device=nvlink.device)
    x = torch.randn(32, 128, device=nvlink.device, dtype=torch.float32).to(torch.bfloat16)
    weights = torch.rand(32, 2, device=nvlink.device, dtype=torch.float32)
    per_rank, _, per_expert, in_rank, _ = nvlink.get_dispatch_layout(topk_idx, num_experts)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                  topk_idx=topk_idx, topk_weights=weights)
    message = ""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            nvlink.dispatch(x, **layout)
    except deep_ep.InputError as error:
        message = str(error)
    except RuntimeError:   # the capture aborted around the error: only the message matters
        pass
    torch.cuda.synchronize()
    recv_x = nvlink.dispatch(x, **layout)[0]
    expected = dispatch_with_layout(cpu, x.cpu(), topk_idx.cpu(), weights.cpu(), num_experts)[0]
    return message, torch.equal(recv_x.cpu(), expected)


def padding_overflow_error(group: dist.ProcessGroup, nvl_bytes: int = 1 << 22) -> str:
    """num_worst_tokens smaller than what arrives: that dispatch cannot raise (it never syncs),
    so the next call must raise on every rank, before any communication."""
    nvlink, _ = shared_buffers(group, nvl_bytes)
    num_experts = 4 * group.size()
    topk_idx = torch.tensor([[0, 1]] * 8, device=nvlink.device)   # every rank sends 8 tokens to rank 0
    x = torch.randn(8, 128, device=nvlink.device, dtype=torch.float32).to(torch.bfloat16)
    per_rank, _, per_expert, in_rank, _ = nvlink.get_dispatch_layout(topk_idx, num_experts)
    recv_x, _, _, _, handle, _ = nvlink.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=topk_idx, topk_weights=torch.rand(8, 2, device=nvlink.device, dtype=torch.float32), num_worst_tokens=4)
    try:
        nvlink.combine(recv_x, handle)
    except deep_ep.InputError as error:
        return str(error)
    return ""


def low_latency_only_buffer(group: dist.ProcessGroup) -> tuple[bool, str]:
    """A decode-style Buffer (num_nvl_bytes=0, low_latency_mode) on the NVLink backend: the
    low-latency round trip works, normal-mode dispatch raises a clear error."""
    T, hidden, num_experts = 8, 128, 4 * group.size()
    buffer = make_buffer(group, "nvlink", num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(
        T, hidden, group.size(), num_experts), low_latency_mode=True)
    device = buffer.device
    x = torch.randn(T, hidden, device=device, dtype=torch.float32).to(torch.bfloat16)
    topk_idx = torch.stack([torch.randperm(num_experts, device=device)[:2] for _ in range(T)])
    weights = torch.rand(T, 2, device=device, dtype=torch.float32)
    recv_x, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, T, num_experts, use_fp8=False)
    combined, _, _ = buffer.low_latency_combine(recv_x, topk_idx, weights, handle)   # identity experts
    expected = (x.float() * weights.sum(1, keepdim=True)).to(torch.bfloat16)
    round_trip_ok = torch.allclose(combined.float(), expected.float(), rtol=2e-2, atol=2e-2)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    try:
        buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    except deep_ep.InputError as error:
        return round_trip_ok, str(error)
    return round_trip_ok, ""


def empty_rows_from_numpy(group: dist.ProcessGroup, env: dict[str, str] | None = None,
                          **buffer_sizes: int) -> list[tuple[int, ...]]:
    """Rank 0 has no tokens and builds its empty inputs with ``torch.from_numpy``, whose zero
    strides torch's ``view`` refuses; the others send it nothing either (every row goes to the
    last rank). Dispatch and combine must take them like any empty tensor. The Buffer is made
    under ``env`` with ``buffer_sizes`` (default: an NVLink one, num_nvl_bytes=4 MiB). Returns
    the shapes of the received rows and the combined ones."""
    import numpy as np

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() and \
        dist.get_backend(group) == "nccl" else torch.device("cpu")
    buffer = make_buffer(group, "nvlink", env, **(buffer_sizes or dict(num_nvl_bytes=1 << 22)),
                         explicitly_destroy=True)
    tokens, hidden, experts = 0 if group.rank() == 0 else 5, 64, 4 * group.size()
    x = torch.from_numpy(np.ones((tokens, hidden), np.float32)).to(torch.bfloat16).to(device)
    topk_idx = torch.from_numpy(np.full((tokens, 2), experts - 1, np.int64)).to(device)   # all to the last rank
    weights = torch.from_numpy(np.ones((tokens, 2), np.float32)).to(device)
    per_rank, per_node, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, experts)
    recv_x, _, recv_weights, _, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=weights)
    expert_out = torch.from_numpy(np.ones(tuple(recv_x.shape), np.float32)).to(torch.bfloat16).to(device)
    combined, _, _ = buffer.combine(expert_out, handle, topk_weights=recv_weights)
    buffer.destroy()
    return [tuple(recv_x.shape), tuple(combined.shape)]
