"""The NVLink kernels compile for Hopper (sm_90) on a machine without a GPU.

The interpreter tests run the kernels' logic on the CPU but skip the compiler, which is
stricter (loop-carried types, both branches of an ``if`` yielding the same pointer type,
inline PTX). Compiling here, with Triton's own ptxas, catches those errors in CI instead of
on the GPU machine. Each compiled kernel's entry must be its C++ name (tests/test_kernel_names.py).
Pointer arguments are given by dtype, integers by an example value.
"""

from __future__ import annotations

import importlib
import os
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from tritonep.backends.nvlink.low_latency.clean_kernel import low_latency_clean_kernel  # noqa: E402
from tritonep.backends.nvlink.low_latency.combine_kernel import low_latency_combine_kernel  # noqa: E402
from tritonep.backends.nvlink.low_latency.dispatch_kernel import low_latency_dispatch_kernel  # noqa: E402
from tritonep.backends.nvlink.normal.combine_copy_engine import combine_piece_signal_kernel, combine_weights_kernel  # noqa: E402
from tritonep.backends.nvlink.normal.combine_kernel import combine_kernel  # noqa: E402
from tritonep.backends.nvlink.normal.dispatch_copy_engine import arrival_wait_kernel  # noqa: E402
from tritonep.backends.nvlink.normal.dispatch_kernel import dispatch_kernel  # noqa: E402
from tritonep.backends.nvlink.normal.expert_layout_kernel import expert_layout_kernel  # noqa: E402
from tritonep.backends.nvlink.normal.layout_kernel import LAYOUT_WARPS, dispatch_layout_kernel, layout_constants  # noqa: E402
from tritonep.backends.nvlink.normal.notify_kernel import notify_dispatch_kernel  # noqa: E402
from tritonep.device.nvshmem import STORES  # noqa: E402
from tritonep.runtime.kernel_names import mangled  # noqa: E402
from tritonep.runtime.launcher import next_power_of_2  # noqa: E402

POINTER_TYPES = {torch.int32: "*i32", torch.int64: "*i64", torch.float32: "*fp32", torch.bfloat16: "*bf16",
                 torch.bool: "*i1", torch.int8: "*i8"}
I32, I64, F32, BF16, BOOL, I8 = torch.int32, torch.int64, torch.float32, torch.bfloat16, torch.bool, torch.int8


def compile_for_hopper(kernel, args: dict, constexprs: dict, num_warps: int = 4, extern_libs: tuple = ()):
    """``extern_libs``: (name, path) of bitcode libraries to link (NVSHMEM's device library)."""
    if "GPU" in kernel.arg_names:
        constexprs = {**constexprs, "GPU": True}
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif isinstance(args[name], torch.dtype):
            signature[name] = POINTER_TYPES[args[name]]
        else:
            signature[name] = "i64" if abs(args[name]) >= 2**31 else "i32"
    source = ASTSource(kernel, signature, constexprs)
    options = {"num_warps": num_warps, **({"extern_libs": extern_libs} if extern_libs else {})}
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    # The kernel's entry is its C++ name (runtime/kernel_names.py), which ptxas has taken.
    entry = mangled(kernel.profiler_name)
    assert compiled.metadata.name == entry and f".entry {entry}(" in compiled.asm["ptx"], compiled.metadata.name
    return compiled


def _compile_ptx(module: str, name: str, args: dict, constexprs: dict, num_warps: int, extern_libs: tuple) -> str:
    """``compile_for_hopper`` of the kernel ``module.name`` (in a worker process): its PTX."""
    kernel = getattr(importlib.import_module(module), name)
    return compile_for_hopper(kernel, args, constexprs, num_warps, extern_libs).asm["ptx"]


def compile_all_for_hopper(jobs: list[tuple]) -> list[str]:
    """The PTX of ``compile_for_hopper`` of each job, (kernel, args, constexprs, num_warps,
    extern_libs), built in processes of their own at once: a kernel that links NVSHMEM's device
    library takes several seconds to build, and a test of several would wait for each in turn."""
    workers = max(1, min(len(jobs), os.cpu_count() or 1))
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
        futures = [pool.submit(_compile_ptx, kernel.fn.__module__, kernel.fn.__name__, *rest)
                   for kernel, *rest in jobs]
        return [future.result() for future in futures]


def test_compiling_at_once_builds_what_one_by_one_builds() -> None:
    jobs = [(low_latency_clean_kernel,
             dict(peer_base_ptrs=I64, mask_ptr=I32, area=1 << 16, rank=1, status_address=1 << 40,
                  timeout_ns=60 * 10**9),
             dict(NUM_RANKS=num_ranks, RANKS_PAD=_pow2(num_ranks), HAS_MASK=True, BLOCK=1024, TRANSPORT=STORES), 4, ())
            for num_ranks in (2, 3)]
    assert compile_all_for_hopper(jobs) == [compile_for_hopper(*job).asm["ptx"] for job in jobs]


@pytest.mark.parametrize("num_topk,num_ranks,num_experts", [(8, 2, 256), (6, 8, 256), (1, 4, 4), (9, 1, 288)])
def test_layout_kernel_compiles(num_topk: int, num_ranks: int, num_experts: int) -> None:
    kernel = compile_for_hopper(dispatch_layout_kernel,
                                dict(topk_idx_ptr=I64, num_tokens=4096, num_tokens_per_rank_ptr=I32,
                                     num_tokens_per_expert_ptr=I32, is_token_in_rank_ptr=BOOL, invalid_ids_ptr=I32,
                                     num_experts=num_experts),
                                layout_constants(num_topk, num_experts, num_ranks), num_warps=LAYOUT_WARPS)
    # The per-expert counts come from the warps' ballots (a histogram), not from global atomics.
    assert "vote.sync.ballot" in kernel.asm["ptx"] and kernel.asm["ptx"].count("atom.global") <= 1


@pytest.mark.parametrize("exchange,from_topk,num_ranks,num_topk", [
    (True, False, 3, 8), (False, False, 3, 8), (True, True, 3, 8), (True, True, 8, 6), (True, True, 2, 1)])
def test_notify_kernel_compiles(exchange: bool, from_topk: bool, num_ranks: int, num_topk: int) -> None:
    topk_pad = next_power_of_2(num_topk) if from_topk else 1
    kernel = compile_for_hopper(
        notify_dispatch_kernel,
        dict(is_token_in_rank_ptr=BOOL, topk_idx_ptr=I64 if from_topk else I32, num_tokens=4096,
             num_tokens_per_expert_ptr=I32, hidden_words=3584, scale_words=56, num_topk=num_topk, num_experts=256,
             max_tokens_per_rank=4096, report_to_status=1, invalid_ids_ptr=I32,
             token_list_ptr=I32, token_list_stride=4096, send_pos_ptr=I32,
             result_ptr=I32, host_result_ptr=I64, peer_base_ptrs=I64, rank=1, notify_epoch=3,
             experts_per_rank=256 // num_ranks, status_ptr=I64, timeout_ns=60 * 10**9, layout_done_ptr=I64),
        dict(NOTIFY_FLAG_WORD=0, PAYLOAD_BYTE_OFFSET=8192, PAYLOAD_WORDS=1035, EXPERT_WORDS=1024,
             SIGNATURE=8, NUM_RANKS=num_ranks, RANKS_PAD=next_power_of_2(num_ranks),
             EXPERTS_PAD=next_power_of_2(256 // num_ranks), BLOCK_T=1024, EXCHANGE=exchange, FROM_TOPK=from_topk,
             LAYOUT_T=4096 // topk_pad if from_topk else 1, TOPK_PAD=topk_pad,
             ALL_EXPERTS_PAD=256 if from_topk else 1))
    # From topk_idx the per-expert counts come from the warps' ballots (a histogram).
    assert not from_topk or "vote.sync.ballot" in kernel.asm["ptx"]


@pytest.mark.parametrize("expand,has_stats,copy_topk,num_ranks,num_topk,experts_per_rank", [
    (False, False, True, 8, 8, 32), (True, True, False, 3, 8, 32), (True, False, True, 1, 6, 256),
    (True, True, True, 2, 1, 1)])
def test_expert_layout_kernel_compiles(expand: bool, has_stats: bool, copy_topk: bool, num_ranks: int, num_topk: int,
                                       experts_per_rank: int) -> None:
    compile_for_hopper(
        expert_layout_kernel,
        dict(exchange_ptr=I32, send_pos_ptr=I32, recv_src_ptr=I32, recv_idx_ptr=I64, recv_weights_ptr=F32,
             topk_idx_ptr=I64, stats_ptr=I32, fields_ptr=I32, topk_copy_ptr=I64, num_rows=12345, num_tokens=4000,
             num_expanded=98765, alignment=128,
             has_stats=int(has_stats), copy_topk=int(copy_topk), rank=1,
             experts_per_rank=experts_per_rank, num_max_tokens=4096, row_programs=128, token_programs=16,
             source_expert_word=num_ranks * num_ranks + experts_per_rank + 2),
        dict(NUM_RANKS=num_ranks, RANKS_PAD=_pow2(num_ranks), SCALEUP_RANKS=num_ranks, SCALEUP_PAD=_pow2(num_ranks),
             NUM_TOPK=num_topk, TOPK_PAD=_pow2(num_topk), EXPERTS_PAD=_pow2(experts_per_rank),
             EXPERT_GROUP=min(8, _pow2(experts_per_rank)), BLOCK_ROWS=256, BLOCK_TOKENS=256,
             BLOCK_SLOTS=256, EXPAND=expand))


# (send, receive): the send half, the receive half, or both in one launch.
# copy_receive: senders only, which also count themselves in the peers' arrived words and copy
# our own rows (the copy engines receive: dispatch_copy_engine.py).
@pytest.mark.parametrize("has_scales,has_topk,send,receive,copy_receive,layout", [
    (False, True, True, False, False, False), (True, True, True, False, False, False),
    (False, False, True, False, False, False), (False, True, False, True, False, False),
    (True, True, False, True, False, False), (False, True, True, True, False, False),
    (True, False, True, True, False, False), (True, False, True, False, True, False),
    (False, True, True, False, True, False), (True, True, False, True, False, True),
    (False, True, True, True, False, True)])
def test_dispatch_kernel_compiles(has_scales: bool, has_topk: bool, send: bool, receive: bool,
                                  copy_receive: bool, layout: bool) -> None:
    kernel = compile_for_hopper(
        dispatch_kernel,
        dict(x_ptr=I32, x_words=3584, scales_ptr=I32, scale_words=56, scale_token_stride=56, scale_col_stride=1,
             topk_idx_ptr=I64 if has_topk else I32, topk_weights_ptr=F32 if has_topk else I32, token_list_ptr=I32,
             token_list_stride=4096, prefix_ptr=I32, out_x_ptr=I32, out_scales_ptr=I32, out_idx_ptr=I64,
             out_weights_ptr=F32, out_src_ptr=I32, num_out_rows=8192, guard_word=6, fields_ptr=I32,
             topk_copy_ptr=I64, stats_ptr=I32, send_pos_ptr=I32, num_tokens=4096, num_max_tokens=4096, alignment=3,
             has_stats=1, copy_topk=1, peer_base_ptrs=I64,
             staging_x=1 << 20,
             staging_scales=1 << 28, staging_idx=1 << 29, staging_weights=1 << 30, staging_src=(1 << 30) + 4096,
             capacity=8192, rank=0, epoch=5, released_target=48, release_due=1, experts_per_rank=128, status_ptr=I64,
             timeout_ns=60 * 10**9),
        dict(TAIL_WORD=2, DONE_WORD=322, ARRIVED_WORD=1300, MAX_CHANNELS=160, NUM_RANKS=2, NUM_SENDERS=12,
             NUM_RECEIVERS=12, SEND=send, RECEIVE=receive, COPY_RECEIVE=copy_receive, HAS_SCALES=has_scales,
             HAS_TOPK=has_topk, NUM_TOPK=8, TOPK_PAD=8, SCALE_PAD=64, ROWS=8, BLOCK=2048, SIGNAL_EVERY=4,
             LAYOUT=layout, PAD_ROWS=layout and send, RANKS_PAD=2, SCALEUP_RANKS=2, SCALEUP_PAD=2, EXPERTS_PAD=128,
             META_PAD=16),
        num_warps=16)
    # The waits use acquire loads and the timer: check the inline PTX made it into the kernel.
    assert "ld.acquire.sys.global.b64" in kernel.asm["ptx"]
    assert "%globaltimer" in kernel.asm["ptx"]
    # Receivers release the sources' staging with a release add, and so do senders for a
    # copy-engine receive's release still owed; senders publish per-channel tails with a release
    # exchange, or with copy_receive count themselves with a release add.
    ptx = kernel.asm["ptx"]
    assert "sys.release.add" in ptx
    assert ("sys.release.exch" in ptx) == (send and not copy_receive)


def test_arrival_wait_kernel_compiles() -> None:
    kernel = compile_for_hopper(arrival_wait_kernel,
                                dict(peer_base_ptrs=I64, rank=1, first_word=1300, counted_word=1304, senders=24,
                                     status_ptr=I64, timeout_ns=60 * 10**9), dict(NUM_RANKS=4))
    ptx = kernel.asm["ptx"]
    assert "ld.acquire.sys.global.b64" in ptx and "st.global.b64" in ptx


# (senders, ranks): SM senders, or none (the rows come from the copy engines in pieces);
# own_slots: V2's weights, each slot's from its expert's rank.
@pytest.mark.parametrize("has_weights,own_slots,has_bias,senders,num_ranks", [
    (True, False, True, 12, 2), (False, False, False, 12, 2), (True, True, False, 0, 2), (True, True, True, 12, 3),
    (False, False, True, 0, 3)])
def test_combine_kernel_compiles(has_weights: bool, own_slots: bool, has_bias: bool, senders: int,
                                 num_ranks: int) -> None:
    compile_for_hopper(
        combine_kernel,
        dict(x_ptr=BF16, x_words_ptr=I32, weights_ptr=F32 if has_weights else BF16,
             topk_idx_ptr=I64 if own_slots else BF16, experts_per_rank=32 if own_slots else 1, prefix_ptr=I32,
             is_token_in_rank_ptr=BOOL,
             send_pos_ptr=I32, bias0_ptr=BF16, bias1_ptr=BF16, out_ptr=BF16, out_weights_ptr=F32 if has_weights
             else BF16, num_tokens=4096, hidden=7168, peer_base_ptrs=I64, staging_x=1 << 30,
             staging_weights=(1 << 30) + (1 << 27), capacity=8192, rank=1, epoch=7, released_target=72, status_ptr=I64,
             timeout_ns=60 * 10**9),
        dict(TAIL_WORD=2 + 2 * 160 + 2 if senders else 2 + 4 * 160 + 4, TAIL_STRIDE=160 if senders else 1,
             DONE_WORD=2 + 4 * 160 + 2, FINISHED_WORD=2 + 4 * 160 + 6, NUM_RANKS=num_ranks,
             RANKS_PAD=_pow2(num_ranks), NUM_SENDERS=senders, NUM_REDUCERS=24 - senders, HAS_WEIGHTS=has_weights,
             OWN_SLOTS=own_slots, NUM_TOPK=8, TOPK_PAD=8, HAS_BIAS0=has_bias, HAS_BIAS1=has_bias,
             NUM_CHANNELS=senders or 8, ROWS=8, COPY_BLOCK=2048, BLOCK=2048, TOKENS=4, STAGE=32, SIGNAL_EVERY=4),
        num_warps=16)


def test_combine_piece_signal_kernel_compiles() -> None:
    compile_for_hopper(combine_piece_signal_kernel,
                       dict(peer_base_ptrs=I64, peer=1, tail_index=420, value=250), {})


@pytest.mark.parametrize("num_ranks", [2, 3, 8])
def test_combine_weights_kernel_compiles(num_ranks: int) -> None:
    compile_for_hopper(
        combine_weights_kernel,
        dict(weights_ptr=F32, prefix_ptr=I32, peer_base_ptrs=I64, staging_weights=(1 << 30) + (1 << 27), rank=1),
        dict(NUM_RANKS=num_ranks, NUM_TOPK=8, SPLIT=8, BLOCK=512))


# The low-latency kernels in each mode: fused (one launch), send half, receive half.
LOW_LATENCY_MODES = [(True, True), (True, False), (False, True)]


@pytest.mark.parametrize("do_send,do_recv", LOW_LATENCY_MODES)
@pytest.mark.parametrize("use_fp8,use_ue8m0,has_mask", [(True, False, False), (True, True, True),
                                                        (False, False, False), (True, False, True)])
def test_low_latency_dispatch_kernel_compiles(do_send: bool, do_recv: bool, use_fp8: bool, use_ue8m0: bool,
                                              has_mask: bool) -> None:
    """``has_mask``: shrink mode (the masked variants skip ranks, with 3 ranks padded to 4 lanes)."""
    scales = I32 if use_ue8m0 else F32
    num_ranks = 3 if has_mask else 2
    kernel = compile_for_hopper(
        low_latency_dispatch_kernel,
        dict(x_ptr=BF16 if use_fp8 else I32, x_row_stride=7168, topk_idx_ptr=I64, num_tokens=128, out_x_ptr=I32,
             out_scales_ptr=scales if use_fp8 else BF16, out_src_info_ptr=I32, out_topk_slot_ptr=I8,
             out_layout_range_ptr=I64, out_count_ptr=I32, recv_stats_ptr=I32, wait_stats_ptr=I64, mask_ptr=I32,
             saved_mask_ptr=I32, peer_base_ptrs=I64, area=1 << 16, my_area=1 << 36, slot=1, slot_bytes=1 << 30,
             rank=1, status_address=1 << 40, timeout_ns=60 * 10**9, num_max_tokens=128, experts_per_rank=96),
        dict(NUM_RANKS=num_ranks, HIDDEN=7168, HIDDEN_PAD=8192, NUM_TOPK=8, PAIRS_PAD=1024, USE_FP8=use_fp8,
             ROUND_SCALE=use_ue8m0, USE_UE8M0=use_ue8m0, HAS_RECV_STATS=True, HAS_WAIT_STATS=True,
             HAS_MASK=has_mask, DO_SEND=do_send, DO_RECV=do_recv, GROUPS_PAD=64, RANKS_PAD=_pow2(num_ranks),
             TOPK_PAD=8, RECV_ROWS=4, BLOCK=2048, send_area=None, TRANSPORT=STORES),
        num_warps=16)
    if use_fp8 and do_send:
        assert "cvt.rn.satfinite.e4m3x2.f32" in kernel.asm["ptx"]
    if do_recv:   # received rows are copied in 16-byte loads (the messages' alignment is declared)
        assert "ld.global.cg.v4" in kernel.asm["ptx"]


@pytest.mark.parametrize("do_send,do_recv", LOW_LATENCY_MODES)
@pytest.mark.parametrize("has_mask,has_wait_stats", [(False, False), (True, True), (False, True)])
def test_low_latency_combine_kernel_compiles(do_send: bool, do_recv: bool, has_mask: bool,
                                             has_wait_stats: bool) -> None:
    num_ranks = 3 if has_mask else 2
    compile_for_hopper(
        low_latency_combine_kernel,
        dict(x_ptr=I32, expert_stride=256 * 3584, row_stride=3584, src_info_ptr=I32, topk_slot_ptr=I8,
             layout_range_ptr=I64, topk_idx_ptr=I64, topk_weights_ptr=F32, num_tokens=128, out_ptr=BF16,
             out_row_stride=7168, wait_stats_ptr=I64, mask_ptr=I32, dispatch_mask_ptr=I32, combine_mask_ptr=I32,
             peer_base_ptrs=I64, area=1 << 16, my_area=1 << 36, slot=0, combine_offset=1 << 31, slot_bytes=1 << 25,
             rank=0, status_address=1 << 40, timeout_ns=60 * 10**9, num_max_tokens=128, experts_per_rank=96),
        dict(NUM_RANKS=num_ranks, RANKS_PAD=_pow2(num_ranks), HIDDEN=7168, NUM_TOPK=8, TOPK_PAD=8,
             HAS_WAIT_STATS=has_wait_stats, HAS_MASK=has_mask, DO_SEND=do_send, DO_RECV=do_recv, ROWS=2, BLOCK=2048,
             REDUCE_BLOCK=2048, send_area=None, TRANSPORT=STORES),
        num_warps=16)


@pytest.mark.parametrize("num_ranks,has_mask", [(2, False), (3, True), (8, True)])
def test_low_latency_clean_kernel_compiles(num_ranks: int, has_mask: bool) -> None:
    kernel = compile_for_hopper(
        low_latency_clean_kernel,
        dict(peer_base_ptrs=I64, mask_ptr=I32, area=1 << 16, rank=1, status_address=1 << 40, timeout_ns=60 * 10**9),
        dict(NUM_RANKS=num_ranks, RANKS_PAD=_pow2(num_ranks), HAS_MASK=has_mask, BLOCK=1024, TRANSPORT=STORES))
    assert "st.relaxed.sys.global.b64" in kernel.asm["ptx"] and "fence.acq_rel.sys" in kernel.asm["ptx"]


_pow2 = triton.next_power_of_2
