"""ElasticBuffer on the NVLink backend (its Triton kernels under Triton's interpreter, gloo, CPU
tensors; or on GPUs) against the same calls on the collective backend: V2's front end needs
nothing of an engine beyond the Backend interface, so the NVLink backend serves it as it is.

Dispatch outputs, every handle field (worked out by the NVLink backend's expert-layout kernel,
by plain torch on the collective backend) and the running stats must match bit for bit; combine
within float32 accumulation order. The interpreter tests are marked ``interpreter`` by conftest
(they use ``interpreter_pools``).
"""

from __future__ import annotations

import pytest
import torch
from nvlink_cases import environment
from v2_world import STRATEGIES, build_world, fp8_input


def _buffer(group, backend: str, world):
    import tritonep as deep_ep

    with environment({"TRITONEP_BACKEND": backend}):
        return deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=world.T, hidden=world.H, num_topk=world.K,
                                     explicitly_destroy=True)


def _fields(handle) -> list:
    return [handle.num_recv_tokens, handle.num_expanded_tokens, list(handle.num_recv_tokens_per_expert_list),
            handle.psum_num_recv_tokens_per_scaleup_rank, handle.psum_num_recv_tokens_per_expert,
            handle.num_unaligned_recv_tokens_per_expert, handle.recv_src_metadata, handle.dst_buffer_slot_idx]


def _calls(group, backend: str, world) -> tuple[list, list]:
    """(exact outputs, combine outputs) of one V2 round trip on ``backend``."""
    rank = group.rank()
    buffer = _buffer(group, backend, world)
    try:
        return _round_trip(buffer, world, rank)
    finally:
        buffer.destroy()


def _round_trip(buffer, world, rank: int) -> tuple[list, list]:
    assert type(buffer.backend).__name__ in ("NvlinkBackend", "InternodeBackend", "CollectiveBackend")
    on = buffer.device
    x, topk, weights, x2 = (tensor.to(on) for tensor in (world.x[rank], world.topk[rank], world.weights[rank],
                                                           world.x2[rank]))
    bias = world.biases[rank][0].to(on) if world.biases[rank] else None
    fp8 = tuple(tensor.to(on) for tensor in fp8_input(world, rank))   # (.to keeps column-major scales)
    kwargs = dict(topk_idx=topk, topk_weights=weights, num_experts=world.E, expert_alignment=world.alignment,
                  num_sms=4)
    exact, combined = [], []
    # Fresh dispatches in each layout: every handle field, and the running stats.
    stats = torch.zeros(world.E_local, dtype=torch.int32, device=on)
    n_x, n_idx, n_w, n_handle, _ = buffer.dispatch(x, do_cpu_sync=False, cumulative_local_expert_recv_stats=stats,
                                                   **kwargs)
    s_x, _, s_w, s_handle, _ = buffer.dispatch(x, do_expand=True, cumulative_local_expert_recv_stats=stats,
                                               **kwargs)
    real = int(n_handle.psum_num_recv_tokens_per_scaleup_rank[-1])   # rows past these are padding, left unset
    exact += [n_x[:real], n_idx, n_w, *_fields(n_handle), s_x, s_w, *_fields(s_handle), stats]
    recv_x, recv_idx, recv_w, handle, _ = buffer.dispatch(x, **kwargs)
    cached = buffer.dispatch(x2, handle=handle)[0]
    exact += [recv_x, recv_idx, recv_w, *_fields(handle), cached]
    combined += list(buffer.combine(recv_x, handle, topk_weights=recv_w, bias=bias)[:2])
    # Weights in every slot: each slot's combined weight is its expert's rank's alone (V2).
    combined += list(buffer.combine(recv_x, handle, topk_weights=recv_w + 1.0)[:2])
    # Repeats with a handle (every layer's backward, every decode step): on a GPU they take the
    # engine's replays (the interpreter compiles no launch to replay, so here the general path).
    for scale in (2.0, 4.0):
        assert torch.equal(buffer.dispatch((x2.float() * scale).to(torch.bfloat16), handle=handle)[0],
                           (cached.float() * scale).to(torch.bfloat16))
        again = buffer.combine(recv_x, handle, topk_weights=recv_w)
        assert torch.equal(again[0], buffer.combine(recv_x, handle, topk_weights=recv_w)[0])
    combined.append(again[0])
    (data, scales), _, e_w, e_handle, _ = buffer.dispatch(fp8, do_expand=True, do_zero_padding=True,
                                                          do_cpu_sync=False, **kwargs)
    exact += [data.view(torch.uint8), scales, e_w, *_fields(e_handle)]
    c_x, _, c_w, _, _ = buffer.dispatch(x2, handle=e_handle, topk_weights=weights, do_expand=True,
                                        do_zero_padding=True)
    exact += [c_x, c_w]
    combined += list(buffer.combine(c_x, e_handle, topk_weights=c_w, bias=bias)[:2])
    return exact, combined


def case_backends_agree(group, world) -> None:
    nvlink = _calls(group, "nvlink", world)
    # Ranks sharing GPUs make a gloo group, on which the collective backend's outputs are on the CPU.
    oracle = [[value.to(got.device) if isinstance(value, torch.Tensor) else value for got, value in zip(ours, theirs)]
              for ours, theirs in zip(nvlink, _calls(group, "collective", world))]
    for index, (got, expected) in enumerate(zip(nvlink[0], oracle[0])):
        same = torch.equal(got, expected) if isinstance(got, torch.Tensor) else got == expected
        assert same, f"rank {group.rank()}: exact output {index} differs between the NVLink and collective backends"
    for index, (got, expected) in enumerate(zip(nvlink[1], oracle[1])):
        assert torch.allclose(got.float(), expected.float(), rtol=1e-2, atol=1e-2), \
            f"rank {group.rank()}: combine output {index} differs beyond accumulation order"


def case_backends_agree_on_nodes(group, world, ranks_per_node: int) -> None:
    """The same with the group split into nodes of ``ranks_per_node``: the internode backend
    against the collective one, which serves a split group with the one-node results."""
    from tritonep.core.topology import GPUS_PER_NODE_VARIABLE

    with environment({GPUS_PER_NODE_VARIABLE: str(ranks_per_node)}):
        case_backends_agree(group, world)


@pytest.mark.parametrize("alignment", [1, 16])
def test_nvlink_backend_serves_elastic_buffer(interpreter_pools, alignment):
    world = build_world(2, seed=alignment, H=128, E_local=2, K=3, alignment=alignment, num_biases=1,
                        col_major_scales=True)
    interpreter_pools(2).run(case_backends_agree, world)


def test_internode_backend_serves_elastic_buffer(interpreter_pools):
    """2 nodes of 2 ranks (plain stores under the interpreter)."""
    world = build_world(4, seed=7, H=128, E_local=2, K=3, alignment=16, num_biases=1, col_major_scales=True)
    interpreter_pools(4).run(case_backends_agree_on_nodes, world, 2)


@pytest.mark.gpu(min_gpus=1)
@pytest.mark.parametrize("alignment", [1, 128])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gpu_nvlink_backend_serves_elastic_buffer(gpu_pool, strategy, alignment):
    """The same on GPUs: the NVLink kernels against the collective backend on NCCL, every routing
    (alignment 16 is among the expert-layout kernel's own GPU cases)."""
    world = build_world(gpu_pool.num_ranks, seed=100 * STRATEGIES.index(strategy) + alignment, strategy=strategy,
                        H=256, E_local=3, K=4, alignment=alignment, num_biases=1, col_major_scales=alignment > 1)
    gpu_pool.run(case_backends_agree, world)


def captured_dispatch_matches_eager(group) -> list[str]:
    """A dispatch without CPU sync (expanded or not) captured in a CUDA graph: the capture must
    not sync with the host, and one replay gives what the same call gave eagerly (outputs and
    every handle field, which the expert-layout kernel makes inside the graph)."""
    import tritonep as deep_ep

    device = torch.device("cuda", torch.cuda.current_device())
    cpu = dict(generator=torch.Generator().manual_seed(group.rank()), dtype=torch.float32, device="cpu")
    T, H, K, E = 64, 256, 4, 4 * group.size()
    x = torch.randn(T, H, **cpu).to(torch.bfloat16).to(device)
    topk_idx = torch.rand(T, E, **cpu).topk(K, dim=1).indices.to(device)
    weights = torch.rand(T, K, **cpu).to(device)
    problems = []
    for expand in (False, True):
        # A buffer per capture: a call after the replay would check the eager call's padding
        # against an exchange the replay has overwritten (the engine leaves that check to the
        # next call, and skips it during capture).
        buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=T, hidden=H, num_topk=K,
                                       explicitly_destroy=True)

        def dispatch(buffer: deep_ep.ElasticBuffer = buffer, expand: bool = expand) -> list:
            recv_x, recv_idx, recv_w, handle, _ = buffer.dispatch(
                x, topk_idx=topk_idx, topk_weights=weights, num_experts=E, expert_alignment=16, do_cpu_sync=False,
                do_expand=expand, do_zero_padding=expand)
            return [recv_x, recv_idx, recv_w, *_fields(handle)]

        try:
            eager = dispatch()   # (also compiles every kernel outside the capture)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = dispatch()
            graph.replay()
            torch.cuda.synchronize()
        finally:
            buffer.destroy()
        if not expand:   # rows past the received ones are padding, left unset
            real = int(eager[6][-1])   # psum_num_recv_tokens_per_scaleup_rank
            eager[0], captured[0] = eager[0][:real], captured[0][:real]
        for index, (a, b) in enumerate(zip(eager, captured)):
            if not (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b):
                problems.append(f"rank {group.rank()} expand={expand}: output {index} differs after the replay")
    return problems


def no_sync_dispatch_outcomes(group) -> tuple[bool, str]:
    """(whether a dispatch without CPU sync left its engine a padding check, which waits for the
    GPU at the next call; the error every rank meets after ranks passed different T)."""
    import tritonep as deep_ep

    T, H, K, E = 8, 128, 2, 4 * group.size()
    # Ranks that meet the disagreement after a peer raised it wait for that peer until the
    # time-out: a short one on GPUs keeps the case short (the interpreter's waits count spins,
    # which its slow calls need many of).
    on_gpus = torch.distributed.get_backend(group) == "nccl"
    with environment({"TRITONEP_BACKEND": "nvlink", **({"TRITONEP_TIMEOUT_S": "5"} if on_gpus else {})}):
        buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=2 * T, hidden=H, num_topk=K,
                                       explicitly_destroy=True)
    cpu = dict(generator=torch.Generator().manual_seed(group.rank()), dtype=torch.float32, device="cpu")
    x = torch.randn(T, H, **cpu).to(torch.bfloat16).to(buffer.device)
    kwargs = dict(topk_idx=torch.rand(T, E, **cpu).topk(K, dim=1).indices.to(buffer.device),
                  topk_weights=torch.rand(T, K, **cpu).to(buffer.device), num_experts=E, do_cpu_sync=False)
    try:
        recv_x, _, _, handle, _ = buffer.dispatch(x, **kwargs)
        left_a_check = buffer.backend.normal.state.unchecked_padding is not None
        buffer.combine(recv_x, handle)
        try:
            # The exchange reports the disagreement in the status word, which the host reads
            # without waiting: a call that starts once the exchange has finished raises.
            recv_x, _, _, handle, _ = buffer.dispatch(x, num_max_tokens_per_rank=T + group.rank(), **kwargs)
            buffer.combine(recv_x, handle)
            if buffer.device.type == "cuda":
                torch.cuda.synchronize(buffer.device)
            buffer.dispatch(x, **kwargs)
        except deep_ep.InputError as error:
            return left_a_check, str(error)
        return left_a_check, ""
    finally:
        buffer.destroy()


def check_no_sync_outcomes(outcomes: list[tuple[bool, str]]) -> None:
    for rank, (left_a_check, message) in enumerate(outcomes):
        assert not left_a_check, f"rank {rank}: the no-sync dispatch left a host-waiting padding check"
        assert "num_max_tokens_per_rank" in message and "cannot be used any more" in message, (rank, message)


def test_interpreter_dispatch_without_cpu_sync_leaves_no_host_wait_and_catches_other_t(interpreter_pools):
    """Every rank passes the same T, which the count exchange compares, so padding to R x T
    needs no check that waits for the GPU; ranks that pass different T all raise, naming T."""
    check_no_sync_outcomes(interpreter_pools(2).run(no_sync_dispatch_outcomes))


@pytest.mark.gpu(min_gpus=2)
def test_gpu_dispatch_without_cpu_sync_leaves_no_host_wait_and_catches_other_t(gpu_pool):
    check_no_sync_outcomes(gpu_pool.run(no_sync_dispatch_outcomes))


@pytest.mark.gpu(min_gpus=1)
def test_gpu_dispatch_without_cpu_sync_in_a_cuda_graph(gpu_pool):
    assert gpu_pool.run(captured_dispatch_matches_eager) == [[]] * gpu_pool.num_ranks


# Last in the module, as in the other internode modules: its NVSHMEM ranks (``transport_pool``)
# live until the module ends, so no case on the session's ranks runs beside them.
@pytest.mark.gpu(min_gpus=2)
def test_gpu_internode_backend_serves_elastic_buffer(transport_pool):
    """Every split of the machine's ranks into nodes (NVSHMEM with one GPU per rank)."""
    R = transport_pool.num_ranks
    world = build_world(R, seed=8, strategy="skewed", H=256, E_local=3, K=4, alignment=128, num_biases=1)
    for ranks_per_node in [g for g in range(1, R) if R % g == 0]:
        transport_pool.run(case_backends_agree_on_nodes, world, ranks_per_node)
