"""ElasticBuffer.dispatch / combine, argument by argument, V2-style, on a 2-rank collective pool.

The routing and layouts themselves are checked against brute force in test_v2_properties.py;
here each argument is checked for what it changes, mostly against the plain call of the same
routing. The last case follows DeepEP V2's README (training and decoding) as a user would.
"""

from __future__ import annotations

import pytest
import torch
from torch_defaults import pool_options, torch_defaults
from v2_world import FP8, build_world, fp8_input

import tritonep as deep_ep
from tritonep.rank_pool import RankPool

R, H, E_LOCAL, K = 2, 256, 3, 3
E = R * E_LOCAL


@pytest.fixture(scope="module")
def pool():
    with RankPool(R, timeout=60, **pool_options()) as ranks:
        yield ranks


def _inputs(group, seed: int = 7, **knobs):
    world = build_world(group.size(), seed, H=H, E_local=E_LOCAL, K=K, **knobs)
    rank = group.rank()
    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=world.T, hidden=H, num_topk=K)
    return world, rank, buffer, world.x[rank], world.topk[rank], world.weights[rank]


def _dispatch(buffer, x, topk, weights=None, **kwargs):
    return buffer.dispatch(x, topk_idx=topk, topk_weights=weights, num_experts=E, **kwargs)


# ----------------------------------------------------------------------------- rank functions
def case_optional_weights_and_bias(group) -> None:
    world, rank, buffer, x, topk, weights = _inputs(group, num_biases=2)
    recv_x, recv_idx, recv_w, handle, _ = _dispatch(buffer, x, topk)
    assert recv_w is None and recv_idx is not None
    combined, combined_w, _ = buffer.combine(recv_x, handle)
    assert combined_w is None
    b0, b1 = world.biases[rank]
    for bias, extra in ((b0, b0.float()), ((b0, None), b0.float()), ((None, b1), b1.float()),
                        ((b0, b1), b0.float() + b1.float())):
        with_bias, _, _ = buffer.combine(recv_x, handle, bias=bias)
        assert torch.allclose(with_bias.float(), combined.float() + extra, atol=3e-2, rtol=2e-2)
    e_x, e_idx, e_w, e_handle, _ = _dispatch(buffer, x, topk, do_expand=True)
    assert e_idx is None and e_w is None
    assert buffer.combine(e_x, e_handle)[1] is None


def case_handle_copy_and_num_sms(group) -> None:
    _, _, buffer, x, topk, weights = _inputs(group)
    handle = _dispatch(buffer, x, topk, weights)[3]
    assert handle.topk_idx is not topk and torch.equal(handle.topk_idx, topk)
    assert handle.num_sms == buffer.get_theoretical_num_sms(E, K)
    shared = _dispatch(buffer, x, topk, weights, do_handle_copy=False, num_sms=6,
                       num_qps=buffer.get_theoretical_num_qps(6))[3]
    assert shared.topk_idx is topk and shared.num_sms == 6
    assert shared.token_metadata_at_forward is None and shared.channel_linked_list is None
    recv_x = buffer.dispatch(x, handle=shared)[0]
    assert torch.equal(buffer.combine(recv_x, shared)[0], buffer.combine(recv_x, shared, num_sms=8)[0])


def case_col_major_scales(group) -> None:
    world, rank, buffer, _, topk, weights = _inputs(group)
    data, scales = fp8_input(world, rank)
    for expand in (False, True):
        (ref_data, ref_scales), *_ = _dispatch(buffer, (data, scales), topk, weights, do_expand=expand,
                                               do_zero_padding=expand)
        (got_data, got_scales), *_ = _dispatch(buffer, (data, scales), topk, weights, do_expand=expand,
                                               do_zero_padding=expand, use_tma_aligned_col_major_sf=True)
        rows = got_scales.shape[0]
        assert got_scales.stride() == (1, max((rows + 3) // 4 * 4, 1))
        assert torch.equal(got_scales, ref_scales) and torch.equal(got_data.view(torch.uint8),
                                                                   ref_data.view(torch.uint8))


def case_events(group) -> None:
    _, _, buffer, x, topk, weights = _inputs(group)
    ref = _dispatch(buffer, x, topk, weights)
    recv_x, recv_idx, recv_w, handle, event = _dispatch(
        buffer, x, topk, weights, previous_event=buffer.capture(), allocate_on_comm_stream=True,
        async_with_compute_stream=True, previous_event_before_epilogue=buffer.capture())
    assert isinstance(event, deep_ep.EventOverlap)
    ran = []
    event.register_hook_after_wait(lambda: ran.append(True))
    with pytest.raises(RuntimeError, match="already has a hook"):
        event.register_hook_after_wait(lambda: None)
    event.current_stream_wait()
    assert ran == [True]
    event.current_stream_wait()   # the hook runs once
    assert ran == [True]
    assert torch.equal(recv_x, ref[0]) and torch.equal(recv_idx, ref[1]) and torch.equal(recv_w, ref[2])
    combined, _, event = buffer.combine(recv_x, handle, async_with_compute_stream=True,
                                        previous_event_before_epilogue=buffer.capture())
    with event(release_handle=True):
        pass
    assert event.event is None and torch.equal(combined, buffer.combine(ref[0], ref[3])[0])


def case_stats(group) -> list[int]:
    _, _, buffer, x, topk, weights = _inputs(group)
    stats = torch.zeros(E_LOCAL, dtype=torch.int32)
    handle = _dispatch(buffer, x, topk, weights, cumulative_local_expert_recv_stats=stats)[3]
    first = stats.clone()
    assert torch.equal(first, handle.num_unaligned_recv_tokens_per_expert)
    buffer.dispatch(x, handle=handle, cumulative_local_expert_recv_stats=stats)   # cached: not counted (as V2)
    assert torch.equal(stats, first)
    _dispatch(buffer, x, topk, weights, cumulative_local_expert_recv_stats=stats, do_cpu_sync=False, do_expand=True)
    assert torch.equal(stats, 2 * first)
    return first.tolist()


def case_deterministic(group) -> None:
    world, rank, _, x, topk, weights = _inputs(group)
    outputs = []
    for deterministic in (False, True, True):
        buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=world.T, hidden=H, num_topk=K,
                                       deterministic=deterministic)
        e_x, _, e_w, handle, _ = _dispatch(buffer, x, topk, weights, do_expand=True, expert_alignment=4,
                                           do_zero_padding=True)
        outputs.append((e_x, e_w, handle.recv_src_metadata))
    for other in outputs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outputs[0], other))


def case_no_sync_handles(group) -> None:
    """do_cpu_sync=False: fixed sizes; the handle's cached dispatch (with or without weights) and
    combine; the first rows are the synced call's."""
    world, rank, buffer, x, topk, weights = _inputs(group, num_biases=1)
    ref_x, ref_idx, ref_w, ref_handle, _ = _dispatch(buffer, x, topk, weights)
    M, rows = ref_x.shape[0], R * world.T
    recv_x, recv_idx, recv_w, handle, _ = _dispatch(buffer, x, topk, weights, do_cpu_sync=False)
    assert recv_x.shape == (rows, H) and handle.num_recv_tokens == rows and handle.num_recv_tokens_per_expert_list == []
    assert torch.equal(recv_x[:M], ref_x) and torch.equal(recv_idx[:M], ref_idx) and torch.equal(recv_w[:M], ref_w)
    assert torch.equal(handle.psum_num_recv_tokens_per_expert, ref_handle.psum_num_recv_tokens_per_expert)
    x2 = world.x2[rank]
    c_x, c_idx, c_w, same, _ = buffer.dispatch(x2, handle=handle, topk_weights=weights)
    assert same is handle and c_x.shape == (rows, H) and torch.equal(c_idx, recv_idx) and torch.equal(c_w, recv_w)
    assert torch.equal(c_x[:M], buffer.dispatch(x2, handle=ref_handle)[0])
    bias = world.biases[rank][0]
    garbage = recv_x.clone()
    garbage[M:] = float("nan")   # rows past the received ones are never read
    assert torch.equal(buffer.combine(garbage, handle, bias=bias)[0], buffer.combine(ref_x, ref_handle, bias=bias)[0])
    # Expanded without zero padding: the real rows are the zero-padded call's.
    e_x, _, e_w, e_handle, _ = _dispatch(buffer, x, topk, weights, do_expand=True, do_cpu_sync=False,
                                         expert_alignment=16)
    z_x, _, z_w, _, _ = _dispatch(buffer, x, topk, weights, do_expand=True, do_cpu_sync=False, expert_alignment=16,
                                  do_zero_padding=True)
    real = e_handle.recv_src_metadata[:, 2:]
    real = real[real >= 0].long()
    assert torch.equal(e_x[real], z_x[real]) and torch.equal(e_w, z_w)


def case_cached_fp8_expanded(group) -> None:
    world, rank, buffer, x, topk, weights = _inputs(group, packed_scales=True)
    fresh = _dispatch(buffer, fp8_input(world, rank), topk, weights, do_expand=True, expert_alignment=2,
                      do_zero_padding=True)
    plain = _dispatch(buffer, x, topk, weights, do_expand=True, expert_alignment=2, do_zero_padding=True)
    (data, scales), idx, w, _, _ = buffer.dispatch(fp8_input(world, rank), handle=plain[3], do_expand=True,
                                                   do_zero_padding=True)
    assert idx is None and w is None
    assert torch.equal(data.view(torch.uint8), fresh[0][0].view(torch.uint8)) and torch.equal(scales, fresh[0][1])
    assert scales.dtype == torch.int32 and data.dtype == FP8
    # A cached non-expanded dispatch from an expanded handle gives the rows layout, as in V2.
    rows = buffer.dispatch(x, handle=plain[3])
    assert torch.equal(rows[0], _dispatch(buffer, x, topk, weights)[0]) and rows[1] is not None


def case_readme(group) -> None:
    """DeepEP V2's README: get_buffer, dispatch/combine forward and backward, decoding with a
    cached handle, all asynchronous with the communication stream."""
    world, rank, _, x, topk, weights = _inputs(group)
    T = world.T
    required = deep_ep.ElasticBuffer.get_buffer_size_hint(group, T, H, num_topk=K, use_fp8_dispatch=False)
    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=T, hidden=H, num_topk=K)
    assert buffer.group == group and buffer.num_bytes >= required
    num_sms = buffer.get_theoretical_num_sms(E, K)

    # Training: dispatch forward, expert, combine forward; then the backward passes.
    recv_x, recv_idx, recv_w, handle, event = buffer.dispatch(
        x, topk_idx=topk, topk_weights=weights, num_experts=E, num_max_tokens_per_rank=T, expert_alignment=1,
        num_sms=num_sms, async_with_compute_stream=True)
    event.current_stream_wait()
    assert sum(handle.num_recv_tokens_per_expert_list) == int((recv_idx >= 0).sum())
    y = (recv_x.float() * 2).to(torch.bfloat16)
    combined, _, event = buffer.combine(y, handle=handle, num_sms=num_sms, async_with_compute_stream=True)
    event.current_stream_wait()
    grad_x, _, _, _, event = buffer.dispatch(combined, handle=handle, num_sms=num_sms, async_with_compute_stream=True)
    event.current_stream_wait()
    assert torch.equal(grad_x, buffer.dispatch(combined, handle=handle)[0])
    grad_w = torch.ones_like(recv_w)
    grad_combined_x, grad_combined_w, event = buffer.combine(grad_x, handle=handle, topk_weights=grad_w,
                                                             num_sms=num_sms, async_with_compute_stream=True)
    event.current_stream_wait()
    assert torch.equal(grad_combined_w, (topk >= 0).float())   # each slot's weight comes from one rank

    # Decoding: a cached handle reuses the layout (no CPU sync), fixed sizes without one.
    decode_x, _, _, decode_handle, _ = buffer.dispatch(x, topk_idx=topk, topk_weights=weights, num_experts=E,
                                                       num_max_tokens_per_rank=T, num_sms=num_sms, do_cpu_sync=False)
    again, _, _, same, event = buffer.dispatch(x, handle=decode_handle, num_sms=num_sms, async_with_compute_stream=True)
    event.current_stream_wait()
    assert same is decode_handle and torch.equal(again[:recv_x.shape[0]], recv_x)
    decoded, _, _ = buffer.combine(again, handle=decode_handle, num_sms=num_sms)
    assert torch.equal(decoded, buffer.combine(recv_x, handle)[0])


def _flow(group, world) -> list[torch.Tensor]:
    """Most of ElasticBuffer's calls; every tensor the test makes names its device."""
    rank = group.rank()
    x, topk, weights = world.x[rank], world.topk[rank], world.weights[rank]
    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=world.T, hidden=H, num_topk=K)
    stats = torch.zeros(E_LOCAL, dtype=torch.int32, device="cpu")
    recv_x, recv_idx, recv_w, handle, _ = _dispatch(buffer, x, topk, weights, expert_alignment=4,
                                                    cumulative_local_expert_recv_stats=stats)
    combined = buffer.combine(recv_x, handle, topk_weights=recv_w, bias=(x, x))[:2]
    (data, scales), _, e_w, e_handle, _ = _dispatch(buffer, fp8_input(world, rank), topk, weights, do_expand=True,
                                                    do_cpu_sync=False, do_zero_padding=True, expert_alignment=4)
    e_combined = buffer.combine(buffer.dispatch(x, handle=e_handle, do_expand=True)[0], e_handle)[0]
    return [recv_x, recv_idx, recv_w, *combined, stats, data.view(torch.uint8), scales, e_w, e_combined,
            handle.psum_num_recv_tokens_per_expert, e_handle.recv_src_metadata, e_handle.dst_buffer_slot_idx]


def case_torch_defaults(group) -> None:
    """Nothing may follow torch's default dtype or device (DeepEP's users set bf16 and cuda):
    under bf16 and the meta device, whose tensors cannot be mixed with CPU ones or read, the
    flow gives the same results."""
    world = build_world(group.size(), 3, H=H, E_local=E_LOCAL, K=K)
    plain = _flow(group, world)
    with torch_defaults(torch.bfloat16, "meta"):
        changed = _flow(group, world)
    assert all(torch.equal(a, b) for a, b in zip(plain, changed))


# ----------------------------------------------------------------------------- the tests
CASES = [case_optional_weights_and_bias, case_handle_copy_and_num_sms, case_col_major_scales, case_events,
         case_deterministic, case_no_sync_handles, case_cached_fp8_expanded, case_readme, case_torch_defaults]


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.__name__.removeprefix("case_"))
def test_argument(pool, case):
    pool.run(case)


def test_cumulative_stats(pool):
    counts = pool.run(case_stats)
    assert all(len(c) == E_LOCAL for c in counts)
