"""Low-latency (decode) mode of the NVLink backend: the general path of its calls.

Per call the host checks the call order, takes the outputs of the call's shape and slot and
launches one kernel (``low_latency_dispatch_kernel`` / ``low_latency_combine_kernel``), or,
with ``return_recv_hook``, the send half now and the receive half when the hook runs
(``launch.py``). Nothing waits for the GPU, so calls can be captured in a CUDA graph and
replayed: the call counters live on the GPU. The kernels' memory (control words, receive
slots, zero-copy buffers) is one symmetric allocation of ``num_rdma_bytes`` (``area.py``, laid
out by ``regions.py``). The host's call order and status word (``call_order.py``) are shared
with the replays this path makes for calls that repeat (``replay.py``).

Shrink mode: the backend's ``rank_mask`` (int32 [R] on the GPU, None without shrink mode) is
passed to both kernels, which skip masked ranks; each dispatch keeps the mask it used in its
handle (``HandleState.dispatch_mask``) for its receive hook and its combine. The kernels'
docstrings say what they skip. ``clean`` is a kernel whose barriers skip masked ranks. A rank
that does not answer within the time-out (dead or stalled) is masked by the kernel that waited
for it, and the call goes on without it (``signals.wait_all_at_least``), as in DeepEP; the next
call or hook warns, naming the rank and the phase.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton

from tritonep.backends.base import (
    LowLatencyCombineRequest,
    LowLatencyCombineResult,
    LowLatencyDispatchRequest,
    LowLatencyDispatchResult,
)
from tritonep.backends.nvlink.low_latency.area import LowLatencyArea
from tritonep.backends.nvlink.low_latency.call_order import LowLatencyCalls
from tritonep.backends.nvlink.low_latency.clean_kernel import low_latency_clean_kernel
from tritonep.backends.nvlink.low_latency.combine_kernel import low_latency_combine_kernel
from tritonep.backends.nvlink.low_latency.dispatch_kernel import low_latency_dispatch_kernel
from tritonep.backends.nvlink.low_latency.launch import SendReceiveLauncher
from tritonep.backends.nvlink.low_latency.outputs import CombineOutputs, DispatchOutputs, HandleState
from tritonep.backends.nvlink.low_latency.regions import LowLatencyRegions
from tritonep.backends.nvlink.low_latency.replay import LowLatencyCombineReplay, LowLatencyDispatchReplay
from tritonep.backends.nvlink.memory import SymmetricBuffer
from tritonep.backends.nvlink.tuning import Tuning
from tritonep.core.checks import InputError
from tritonep.core.handles import LowLatencyHandle
from tritonep.device.nvshmem import NVSHMEM, STORES, nvshmem_kernel
from tritonep.runtime.launcher import aligned
from tritonep.runtime.platform import GPU_KERNELS

# The kernels' arguments that may change between two calls of one setup. The others are fixed
# by the engine (its memory, rank, status word) and by the setup key each call passes (shape,
# options and slot: the per-slot outputs, the slot offsets), so each engine has its launchers.
_DISPATCH_CHANGING = ("x_ptr", "x_row_stride", "topk_idx_ptr", "num_tokens", "recv_stats_ptr", "wait_stats_ptr",
                      "mask_ptr")
_COMBINE_CHANGING = ("x_ptr", "expert_stride", "row_stride", "src_info_ptr", "topk_slot_ptr", "layout_range_ptr",
                     "topk_idx_ptr", "topk_weights_ptr", "num_tokens", "out_ptr", "out_row_stride", "wait_stats_ptr",
                     "mask_ptr", "dispatch_mask_ptr")


_pow2 = triton.next_power_of_2


class LowLatencyEngine:
    """The NVLink backend's low-latency calls on one Buffer: ``dispatch``, ``combine``, ``clean``
    and the zero-copy buffers, over an allocation of ``num_rdma_bytes``. Its kernels' launch
    shapes and rows per step, and the time-out, come from ``tuning``. ``memory``: an allocation
    to run over instead of a new one, ``peer_table`` how the kernels reach its peers and
    ``transport`` by what (``LowLatencyArea``); ``ranks_per_node``: a group split into nodes,
    whose time-out errors name the nodes. Collective to make."""

    def __init__(self, group: dist.ProcessGroup, buffer_id: int, num_rdma_bytes: int, device: torch.device,
                 tuning: Tuning, memory: SymmetricBuffer | None = None, ranks_per_node: int | None = None,
                 peer_table: torch.Tensor | None = None, transport: int = STORES.value) -> None:
        self.group = group
        self.rank, self.num_ranks = group.rank(), group.size()
        self.buffer_id = buffer_id
        self.device = device
        self.tuning = tuning
        self.area = LowLatencyArea(group, num_rdma_bytes, device, memory, peer_table)
        self.calls = LowLatencyCalls(buffer_id, self.rank, device, tuning.timeout_ns, ranks_per_node)
        self.transport = transport
        # Kernels that call NVSHMEM launch through torch's requires_nvshmem (device/nvshmem.py).
        kernels = (low_latency_dispatch_kernel, low_latency_combine_kernel, low_latency_clean_kernel)
        self._dispatch_kernel, self._combine_kernel, self._clean_kernel = \
            [nvshmem_kernel(kernel) for kernel in kernels] if transport == NVSHMEM.value else kernels
        self.dispatch_launcher = SendReceiveLauncher(self._dispatch_kernel, _DISPATCH_CHANGING,
                                                     tuning.low_latency_programs_per_sm, tuning.low_latency_warps,
                                                     device)
        self.combine_launcher = SendReceiveLauncher(self._combine_kernel, _COMBINE_CHANGING,
                                                    tuning.low_latency_combine_programs_per_sm,
                                                    tuning.low_latency_combine_warps, device)
        # (T, H, E, K, fp8 options, slot) -> (that key, constexprs, regions, outputs)
        self._dispatch_plans: dict[tuple, tuple[tuple, dict, LowLatencyRegions, DispatchOutputs]] = {}
        self._combine_outputs = CombineOutputs(device)
        # Shrink mode: the ranks each combine slot's call skips, saved by its send half for its
        # receive half.
        # Rows padded to 16 bytes: Triton specialises a pointer on 16-byte alignment, and a second
        # slot's row at an odd offset would compile a second variant on its first call, possibly
        # inside a CUDA graph capture, where NVSHMEM's module set-up fails.
        row_words = -(-self.num_ranks // 4) * 4
        self.combine_masks = torch.zeros(2, row_words, dtype=torch.int32, device=device)[:, :self.num_ranks]
        self._combine_mask_rows = (self.combine_masks[0], self.combine_masks[1])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier(group=group)

    @property
    def memory(self) -> SymmetricBuffer:
        return self.area.memory

    # ------------------------------------------------------------------ dispatch
    def _dispatch_plan(self, request: LowLatencyDispatchRequest, hidden: int, num_topk: int,
                       slot: int) -> tuple[tuple, dict, LowLatencyRegions, DispatchOutputs]:
        """(key, constexprs, regions, outputs) of a dispatch shape in ``slot``, made on its first
        call (the outputs are reused by every second call: outputs.py says why)."""
        T, num_experts = request.num_max_dispatch_tokens_per_rank, request.num_experts
        key = (T, hidden, num_experts, num_topk, request.use_fp8, request.round_scale, request.use_ue8m0, slot)
        cached = self._dispatch_plans.get(key)
        if cached is not None:
            return cached
        R = self.num_ranks
        regions = self.area.regions(T, hidden, num_experts)
        outputs = DispatchOutputs(T, hidden, R, num_experts, request.use_fp8, request.use_ue8m0, self.device)
        constants = dict(
            NUM_RANKS=R, HIDDEN=hidden, HIDDEN_PAD=_pow2(max(hidden, 128)), NUM_TOPK=num_topk,
            PAIRS_PAD=_pow2(max(T * num_topk, 16)), USE_FP8=request.use_fp8, ROUND_SCALE=request.round_scale,
            USE_UE8M0=request.use_ue8m0, GROUPS_PAD=_pow2(max(hidden // 128, 4)), RANKS_PAD=_pow2(R),
            TOPK_PAD=_pow2(num_topk), RECV_ROWS=self.tuning.low_latency_recv_rows, BLOCK=2048,
            TRANSPORT=self.transport)
        self._dispatch_plans[key] = (key, constants, regions, outputs)
        return self._dispatch_plans[key]

    def _dispatch_send_area(self, regions: LowLatencyRegions, slot: int) -> int | None:
        """Where NVSHMEM's dispatch stages the messages it puts (None: plain stores put none)."""
        if self.transport != NVSHMEM.value:
            return None
        return self.area.my_area + regions.dispatch_send_offset + slot * regions.dispatch_send_bytes

    def dispatch(self, request: LowLatencyDispatchRequest, rank_mask: torch.Tensor | None = None,
                 replay: LowLatencyDispatchReplay | None = None) -> LowLatencyDispatchResult:
        """``rank_mask``: shrink mode's int32 [R] (1 = skip that rank), or None. ``replay``: the
        front end's replay of this call shape, which learns this call's launches (a new one when
        None); handed back with the result."""
        calls = self.calls
        calls.check_status()
        x, topk_idx = request.x, request.topk_idx
        if not topk_idx.is_contiguous():
            topk_idx = topk_idx.contiguous()
        num_tokens, hidden = x.shape
        x_row_stride, x_column_stride = x.stride()
        if hidden % 2 or x_column_stride != 1 or x_row_stride % 2:   # bf16 rows move as int32 words
            raise InputError(f"the NVLink low-latency dispatch needs x with unit column stride, an even row stride "
                             f"and an even hidden, got hidden={hidden}, strides {tuple(x.stride())}")
        T, num_experts = request.num_max_dispatch_tokens_per_rank, request.num_experts
        recv_stats = request.cumulative_local_expert_recv_stats
        wait_stats = request.dispatch_wait_recv_cost_stats
        key, constants, regions, outputs = self._dispatch_plan(request, hidden, topk_idx.shape[1],
                                                               calls.dispatch_order.next_slot)
        call, slot = calls.dispatch_order.start(request.return_recv_hook)
        handle = outputs.handle(T, hidden, num_experts, self.buffer_id, received=False)
        state: HandleState = handle.backend_state
        # The launcher's changing arguments (_DISPATCH_CHANGING) come first; the rest is fixed by `key`.
        args = (x, x_row_stride, topk_idx, num_tokens, outputs.packed_words, outputs.scales_storage,
                outputs.src_info, outputs.topk_slot, outputs.layout_range, outputs.packed_count,
                recv_stats if recv_stats is not None else outputs.packed_count,
                wait_stats if wait_stats is not None else outputs.layout_range,
                rank_mask if rank_mask is not None else outputs.dispatch_mask, outputs.dispatch_mask,
                self.area.peer_base_ptrs, self.area.offset, self.area.my_area, slot, regions.dispatch_slot_bytes,
                self.rank, calls.status.address, calls.timeout_ns, T, num_experts // self.num_ranks,
                self._dispatch_send_area(regions, slot))
        flags = (recv_stats is not None, wait_stats is not None, rank_mask is not None)
        first, receive = self.dispatch_launcher.launch((key, flags), args, lambda: {
            **constants, "HAS_RECV_STATS": flags[0], "HAS_WAIT_STATS": flags[1], "HAS_MASK": flags[2]},
            request.return_recv_hook)
        learner = None   # the replay this call teaches its launches to
        # A repeat of this call shape may be replayed with these launches: they were made for
        # contiguous, 16-byte aligned tensors (what the replay checks).
        if (first is not None and x_row_stride == hidden and topk_idx is request.topk_idx
                and aligned(x.data_ptr(), topk_idx.data_ptr(), *[stats.data_ptr() for stats in (recv_stats, wait_stats)
                                                                   if stats is not None])):
            if replay is None:
                replay = LowLatencyDispatchReplay(calls, request.return_recv_hook, T, hidden, num_experts,
                                                  self.num_ranks)
            learner = replay
            learner.slots.learn(slot, first, outputs)
        if receive is None:
            state.received = True
            return LowLatencyDispatchResult(outputs.packed, outputs.packed_count, handle, None, replay)

        def hook() -> None:
            calls.check_status()
            calls.dispatch_order.finish(call, slot)
            launched = receive()
            state.received = True
            if learner is not None:
                learner.slots.learn_receive(slot, launched)

        return LowLatencyDispatchResult(outputs.packed, outputs.packed_count, handle, hook, replay)

    # ------------------------------------------------------------------ combine
    def combine(self, request: LowLatencyCombineRequest, rank_mask: torch.Tensor | None = None,
                replay: LowLatencyCombineReplay | None = None) -> LowLatencyCombineResult:
        """``rank_mask`` and ``replay`` as in dispatch."""
        x, topk_idx, topk_weights, handle = request.x, request.topk_idx, request.topk_weights, request.handle
        zero_copy, return_recv_hook, out, wait_stats = request.zero_copy, request.return_recv_hook, request.out, \
            request.wait_stats
        calls = self.calls
        calls.check_status()
        state: HandleState = handle.backend_state
        if not state.received:   # its rows are not in this rank's receive slot yet
            raise InputError("low_latency_combine: the dispatch of this handle was not received yet; call its "
                             "recv hook first")
        T, hidden, num_experts = handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts
        source = self.get_next_low_latency_combine_buffer(handle) if zero_copy else x
        # NVSHMEM puts rows from this call's zero-copy buffer (staged there unless it is the source).
        send_area = self.area.zero_copy_addresses(T, hidden, num_experts)[calls.combine_buffer_index] \
            if self.transport == NVSHMEM.value else None
        calls.combine_buffer_index ^= 1
        expert_stride, row_stride, column_stride = source.stride()
        # The replay's launches assume every tensor as the user gave it, contiguous.
        learnable = source.is_contiguous() and x.is_contiguous() \
            and topk_idx.is_contiguous() and topk_weights.is_contiguous()
        if column_stride != 1 or expert_stride % 2 or row_stride % 2:   # rows move as int32 words
            source = source.contiguous()
            expert_stride, row_stride, _ = source.stride()
        if not topk_idx.is_contiguous():
            topk_idx = topk_idx.contiguous()
        if not topk_weights.is_contiguous():
            topk_weights = topk_weights.contiguous()
        num_tokens, num_topk = topk_idx.shape
        # This slot's output for calls without ``out``, which the replay learns either way.
        slot_output = self._combine_outputs.rows(calls.combine_order.next_slot, T, hidden, num_tokens)
        if out is None:
            out = slot_output
        target = out if out.stride(1) == 1 else torch.empty_like(out, memory_format=torch.contiguous_format)
        call, slot = calls.combine_order.start(return_recv_hook)
        combine_mask = self._combine_mask_rows[slot]
        regions = self.area.regions(T, hidden, num_experts)
        # The launcher's changing arguments (_COMBINE_CHANGING) come first; the rest is fixed by `key`.
        args = (source, expert_stride, row_stride, handle.src_info, state.topk_slot, handle.layout_range, topk_idx,
                topk_weights, num_tokens, target, target.stride(0),
                wait_stats if wait_stats is not None else handle.layout_range,
                rank_mask if rank_mask is not None else combine_mask, state.dispatch_mask, combine_mask,
                self.area.peer_base_ptrs, self.area.offset, self.area.my_area, slot, regions.combine_offset,
                regions.combine_slot_bytes, self.rank, calls.status.address, calls.timeout_ns, T,
                num_experts // self.num_ranks, send_area)
        key = (T, hidden, num_experts, num_topk, wait_stats is not None, rank_mask is not None, slot, send_area)

        def constants() -> dict:
            return dict(NUM_RANKS=self.num_ranks, RANKS_PAD=_pow2(self.num_ranks), HIDDEN=hidden, NUM_TOPK=num_topk,
                        TOPK_PAD=_pow2(num_topk), HAS_WAIT_STATS=wait_stats is not None,
                        HAS_MASK=rank_mask is not None, ROWS=self.tuning.low_latency_rows, BLOCK=2048,
                        REDUCE_BLOCK=min(_pow2(hidden), 2048), TRANSPORT=self.transport)

        first, receive = self.combine_launcher.launch(key, args, constants, return_recv_hook)
        learner = None   # as in dispatch
        if (learnable and first is not None and target is out
                and aligned(*[tensor.data_ptr() for tensor in (source, topk_idx, topk_weights, out, wait_stats)
                              if tensor is not None])):
            if replay is None:
                replay = LowLatencyCombineReplay(calls, return_recv_hook, zero_copy, T, hidden, num_experts,
                                                 self.num_ranks, self.area.zero_copy_addresses(T, hidden, num_experts))
            learner = replay
            learner.slots.learn(slot, first, slot_output)

        def copy_back() -> None:
            if target is not out:
                out.copy_(target)

        if receive is None:
            copy_back()
            return LowLatencyCombineResult(out, None, replay)

        def hook() -> None:
            calls.check_status()
            calls.combine_order.finish(call, slot)
            launched = receive()
            copy_back()
            if learner is not None:
                learner.slots.learn_receive(slot, launched)

        return LowLatencyCombineResult(out, hook, replay)

    # ------------------------------------------------------------------ memory
    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """The zero-copy buffer the next combine sends from, bf16 [E/R, R*T, H]."""
        return self.area.zero_copy_buffer(self.calls.combine_buffer_index, handle.num_max_dispatch_tokens_per_rank,
                                          handle.hidden, handle.num_experts)

    def local_bytes(self) -> torch.Tensor:
        return self.area.local_bytes()

    def clean(self, rank_mask: torch.Tensor | None = None) -> None:
        """Zero the control words on every rank not masked (collective over those ranks): call
        counters and the slot choice restart at 0. A kernel with two barriers over symmetric memory
        (``low_latency_clean_kernel``), which skip the ranks in ``rank_mask``."""
        calls = self.calls
        calls.check_status()
        if calls.hooks_pending:
            raise InputError("clean_low_latency_buffer: receive hooks of earlier calls are still pending")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)   # this rank's earlier calls, on any stream, are done
        self._clean_kernel[(1,)](
            self.area.peer_base_ptrs, rank_mask if rank_mask is not None else self.combine_masks, self.area.offset,
            self.rank, calls.status.address, calls.timeout_ns, NUM_RANKS=self.num_ranks,
            RANKS_PAD=_pow2(self.num_ranks), HAS_MASK=rank_mask is not None, BLOCK=1024, GPU=GPU_KERNELS,
            TRANSPORT=self.transport, num_warps=4)
        # Slots restart too, so ranks that made different numbers of calls before (one that was
        # masked and idle, say) agree on them again.
        calls.reset()

    def release(self) -> None:
        self._dispatch_plans.clear()   # and the outputs they keep (a destroyed Buffer holds no GPU memory)
        self._combine_outputs.clear()
        self.area.release()
