"""Low-latency (decode) mode of the NVLink backend: the host side of two Triton kernels.

Per call the host checks the call order, allocates the outputs and launches one kernel
(``low_latency_dispatch_kernel`` / ``low_latency_combine_kernel``), or, with
``return_recv_hook``, the send half now and the receive half when the hook runs. Nothing
waits for the GPU, so calls can be captured in a CUDA graph and replayed: the call counters
live on the GPU. The kernels' memory (control words, receive slots, zero-copy buffers) is
one symmetric allocation of ``num_rdma_bytes``, laid out by ``low_latency_layout``.

Shrink mode: the backend's ``rank_mask`` (int32 [R] on the GPU, None without shrink mode) is
passed to both kernels, which skip masked ranks; each dispatch keeps the mask it used in its
handle (``LowLatencyState.dispatch_mask``) for its receive hook and its combine. The kernels'
docstrings say what they skip. ``clean`` is a kernel whose barriers skip masked ranks. A rank
that does not answer within the time-out (dead or stalled) is masked by the kernel that waited
for it, and the call goes on without it (``sync.wait_all_at_least``), as in DeepEP; the next
call or hook warns, naming the rank and the phase.

Calls of a kind alternate between two slots of receive memory (double buffering), so two
calls of each kind may await their receive hooks at once (two micro-batches in flight, as in
DeepEP), and the hooks may run in any order: each half finds its slot's use counter on the
GPU. Rules, each raising InputError instead of hanging or corrupting: a call may not reuse
the slot of a call still awaiting its hook (a third pending call), and a combine needs its
dispatch received.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import triton

from tritonep.backends.base import (
    LowLatencyCombineRequest,
    LowLatencyCombineResult,
    LowLatencyDispatchRequest,
    LowLatencyDispatchResult,
)
from tritonep.backends.nvlink.low_latency.clean_kernel import low_latency_clean_kernel
from tritonep.backends.nvlink.low_latency.combine_kernel import low_latency_combine_kernel
from tritonep.backends.nvlink.low_latency.dispatch_kernel import low_latency_dispatch_kernel
from tritonep.backends.nvlink.low_latency.regions import CONTROL_BYTES, MAX_EXPERTS, MAX_RANKS, LowLatencyRegions
from tritonep.backends.nvlink.low_latency.replay import (
    LowLatencyCombineReplay,
    LowLatencyDispatchReplay,
    LowLatencyState,
    aligned,
)
from tritonep.backends.nvlink.memory import SymmetricBuffer
from tritonep.core import fp8
from tritonep.core.checks import InputError
from tritonep.core.handles import LowLatencyHandle
from tritonep.device.status_codes import MASKED_BIT
from tritonep.runtime.launcher import FastLauncher, resident_programs
from tritonep.runtime.platform import GPU_KERNELS, INTERPRET
from tritonep.runtime.status import masked_after_timeout_message, timeout_error

# The kernels' arguments that may change between two calls of one setup. The others are fixed
# by the engine (its memory, rank, status word) and by the setup key each call passes (shape,
# options and slot: the per-slot outputs, the slot offsets), so each engine has its launchers.
_DISPATCH_CHANGING = ("x_ptr", "x_row_stride", "topk_idx_ptr", "num_tokens", "recv_stats_ptr", "wait_stats_ptr",
                      "mask_ptr")
_COMBINE_CHANGING = ("x_ptr", "expert_stride", "row_stride", "src_info_ptr", "topk_slot_ptr", "layout_range_ptr",
                     "topk_idx_ptr", "topk_weights_ptr", "num_tokens", "out_ptr", "out_row_stride", "wait_stats_ptr",
                     "mask_ptr", "dispatch_mask_ptr")


_pow2 = triton.next_power_of_2


class CallOrder:
    """Host bookkeeping for one kind of call: the slot each call uses (they alternate) and the
    sends still awaiting their receive hook."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.reset()

    def reset(self) -> None:
        self.sent = 0
        self.pending: dict[int, int] = {}   # slot -> call whose receive hook was not run yet

    @property
    def next_slot(self) -> int:
        return self.sent % 2

    def start(self, with_hook: bool) -> tuple[int, int]:
        """(call number, slot) of the next call."""
        slot = self.next_slot
        if slot in self.pending:
            raise InputError(f"{self.kind}: call {self.pending[slot]} still awaits its receive hook and holds receive "
                             f"slot {slot}, which this call would reuse (calls alternate between two slots, so at "
                             f"most two may await their hooks); run that hook first")
        self.sent += 1
        if with_hook:
            self.pending[slot] = self.sent
        return self.sent, slot

    def finish(self, call: int, slot: int) -> None:
        if self.pending.get(slot) != call:
            raise InputError(f"{self.kind}: this receive hook was already called")
        del self.pending[slot]


class LowLatencyEngine:
    def __init__(self, group: dist.ProcessGroup, buffer_id: int, num_rdma_bytes: int, device: torch.device) -> None:
        self.group = group
        self.rank, self.num_ranks = group.rank(), group.size()
        self.buffer_id = buffer_id
        self.device = device
        self.memory = SymmetricBuffer(group, num_rdma_bytes, device, interpret=INTERPRET)
        self.area = self.memory.data_offset
        self.my_area = self.memory.local.data_ptr() + self.area   # the kernels' my_area (peer_base_ptrs[rank] + area)
        self.memory.local[self.area: self.area + CONTROL_BYTES].zero_()
        # Kernels that time out write (phase, peer) straight into this pinned host word, so
        # checking it costs no copy and no sync.
        self.status = torch.zeros(1, dtype=torch.int64, device="cpu", pin_memory=not INTERPRET)
        self.status_address = self.status.data_ptr()
        self.status_view = self.status.numpy()   # reading it costs no torch dispatch
        self._dispatch_plans: dict[tuple, tuple] = {}
        # (setup, DO_SEND, DO_RECV) -> (constexprs, grid); dispatch and combine setups differ in form.
        self._variants: dict[tuple, tuple[dict, int]] = {}
        self._regions_cache: dict[tuple, LowLatencyRegions] = {}
        self.timeout_ns = int(float(os.environ.get("TRITONEP_TIMEOUT_S", "60")) * 1e9)
        # (programs, warps) per launch of each kernel, measured on an H200
        # (docs/benchmarks/2026-11-24-h200x1 and -s2): the dispatch is fastest with two 8-warp
        # programs per SM, the combine with four 4-warp programs per SM moving 4 rows per step
        # (CUDA-graph replay 20.3 against 23.9 us with the dispatch's shape, two rounds each in one
        # run). The variables are for such sweeps; a single launch gets no more programs than can
        # be resident at once (_run).
        self.dispatch_shape = self._kernel_shape("", 2, 8)
        self.combine_shape = self._kernel_shape("COMBINE_", 4, 4)
        self.rows = int(os.environ.get("TRITONEP_LL_ROWS", "4"))   # the combine's rows per step
        self.recv_rows = int(os.environ.get("TRITONEP_LL_RECV_ROWS", "4"))
        self.dispatch_order = CallOrder("low_latency_dispatch")
        self.combine_order = CallOrder("low_latency_combine")
        self._dispatch_launcher = FastLauncher(low_latency_dispatch_kernel, _DISPATCH_CHANGING)
        self._combine_launcher = FastLauncher(low_latency_combine_kernel, _COMBINE_CHANGING)
        self.combine_buffer_index = 0
        self._combine_outputs: dict[tuple[int, int, int], torch.Tensor] = {}   # (slot, T, H) -> [T, H]
        # Shrink mode: the ranks each combine slot's call skips, saved by its send half for its
        # receive half.
        self.combine_masks = torch.zeros(2, self.num_ranks, dtype=torch.int32, device=device)
        self._combine_mask_rows = (self.combine_masks[0], self.combine_masks[1])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier(group=group)

    def _kernel_shape(self, kind: str, programs_per_sm: int, warps: int) -> tuple[int, int]:
        """(programs, warps) of one kernel's launches, ``TRITONEP_LL_{kind}PROGRAMS_PER_SM`` and
        ``TRITONEP_LL_{kind}WARPS`` overriding the defaults."""
        if INTERPRET:
            return 3, 4
        programs_per_sm = int(os.environ.get(f"TRITONEP_LL_{kind}PROGRAMS_PER_SM", programs_per_sm))
        multiprocessors = torch.cuda.get_device_properties(self.device).multi_processor_count
        return multiprocessors * programs_per_sm, int(os.environ.get(f"TRITONEP_LL_{kind}WARPS", warps))

    # ------------------------------------------------------------------ status
    def check_status(self) -> None:
        code = int(self.status_view[0])
        if code:
            if code & MASKED_BIT.value:   # shrink mode: a peer was masked after a time-out, calls went on
                self.status_view[0] = 0
                warnings.warn(masked_after_timeout_message(code, self.rank, self.timeout_ns), RuntimeWarning,
                              stacklevel=4)
                return
            raise timeout_error(code, self.rank, self.timeout_ns, "low-latency calls")

    def _regions(self, T: int, hidden: int, num_experts: int) -> LowLatencyRegions:
        cached = self._regions_cache.get((T, hidden, num_experts))
        if cached is not None:
            return cached
        if num_experts > MAX_EXPERTS or self.num_ranks > MAX_RANKS:
            raise InputError(f"the NVLink low-latency mode supports up to {MAX_EXPERTS} experts and {MAX_RANKS} "
                             f"ranks, got {num_experts} experts on {self.num_ranks} ranks")
        regions = LowLatencyRegions(T, hidden, self.num_ranks, num_experts)
        if regions.total_bytes > self.memory.data_bytes:
            raise InputError(f"low-latency calls with T={T}, hidden={hidden}, num_experts={num_experts} need "
                             f"num_rdma_bytes >= {regions.total_bytes} (get_low_latency_rdma_size_hint)")
        self._regions_cache[(T, hidden, num_experts)] = regions
        return regions

    def _launch(self, launcher: FastLauncher, shape: tuple[int, int], setup: tuple, args: tuple,
                constants: Callable[[], dict], with_hook: bool) -> tuple[Any, Callable[[], Any] | None]:
        """Launch send and receive as one kernel, or the send now and return the receive.
        ``setup`` stands for everything but the launcher's changing arguments (see FastLauncher)
        and ``constants`` makes the constexprs, needed only the first time a setup is seen.
        Returns (the compiled launch made, the receive or None); the receive returns its
        compiled launch (both None under the interpreter; low_latency_fast learns them)."""
        if with_hook:
            first = self._run(launcher, shape, setup, args, constants, True, False)
            return first, lambda: self._run(launcher, shape, setup, args, constants, False, True)
        if INTERPRET:   # the interpreter runs programs one after another: send before receiving
            self._run(launcher, shape, setup, args, constants, True, False)
            self._run(launcher, shape, setup, args, constants, False, True)
            return None, None
        return self._run(launcher, shape, setup, args, constants, True, True), None

    def _run(self, launcher: FastLauncher, shape: tuple[int, int], setup: tuple, args: tuple,
             constants: Callable[[], dict], do_send: bool, do_recv: bool) -> Any:
        variant = (setup, do_send, do_recv)
        known = self._variants.get(variant)
        programs, warps = shape
        if known is None:
            variant_constants = {**constants(), "DO_SEND": do_send, "DO_RECV": do_recv, "GPU": GPU_KERNELS}
            # A single launch (send and receive) needs every program resident at once: no more
            # programs than the compiled kernel's registers and warps let the GPU hold.
            grid = programs if INTERPRET or not (do_send and do_recv) else resident_programs(
                launcher.kernel, args, variant_constants, warps, self.device, programs)
            known = self._variants[variant] = (variant_constants, grid)
        variant_constants, grid = known
        return launcher(grid, variant, args, variant_constants, warps)

    # ------------------------------------------------------------------ dispatch
    def _dispatch_plan(self, request: LowLatencyDispatchRequest, hidden: int, num_topk: int, slot: int) -> tuple:
        """(key, constants, regions, outputs) of a dispatch shape; outputs are made once per slot
        and reused by every second call: SPEC allows two low-latency results alive, no more, and
        allocating five tensors costs more host time than the kernel."""
        T, num_experts = request.num_max_dispatch_tokens_per_rank, request.num_experts
        key = (T, hidden, num_experts, num_topk, request.use_fp8, request.round_scale, request.use_ue8m0, slot)
        cached = self._dispatch_plans.get(key)
        if cached is not None:
            return cached
        R, device = self.num_ranks, self.device
        regions = self._regions(T, hidden, num_experts)
        experts_local, slots = num_experts // R, R * T
        if request.use_fp8:
            packed_x = torch.empty(experts_local, slots, hidden, dtype=fp8.FP8_DTYPE, device=device)
            scale_columns = hidden // 512 if request.use_ue8m0 else hidden // 128
            scale_dtype = torch.int32 if request.use_ue8m0 else torch.float32
            # Column-major in the last two dims, as DeepEP's kernels write them.
            scales_storage = torch.empty(experts_local, scale_columns, slots, dtype=scale_dtype, device=device)
            packed: torch.Tensor | tuple[torch.Tensor, torch.Tensor] = (packed_x, scales_storage.transpose(1, 2))
        else:
            packed_x = torch.empty(experts_local, slots, hidden, dtype=torch.bfloat16, device=device)
            scales_storage = packed_x
            packed = packed_x
        outputs = (packed, packed_x.view(torch.int32), scales_storage,
                   torch.empty(experts_local, dtype=torch.int32, device=device),          # packed_count
                   torch.empty(experts_local, slots, dtype=torch.int32, device=device),   # src_info
                   torch.empty(experts_local, R, dtype=torch.int64, device=device),       # layout_range
                   torch.empty(experts_local, slots, dtype=torch.int8, device=device),    # topk_slot
                   torch.zeros(R, dtype=torch.int32, device=device))                      # dispatch mask
        constants = dict(
            NUM_RANKS=R, HIDDEN=hidden, HIDDEN_PAD=_pow2(max(hidden, 128)), NUM_TOPK=num_topk,
            PAIRS_PAD=_pow2(max(T * num_topk, 16)), USE_FP8=request.use_fp8, ROUND_SCALE=request.round_scale,
            USE_UE8M0=request.use_ue8m0, GROUPS_PAD=_pow2(max(hidden // 128, 4)), RANKS_PAD=_pow2(R),
            TOPK_PAD=_pow2(num_topk), RECV_ROWS=self.recv_rows, BLOCK=2048)
        self._dispatch_plans[key] = (key, constants, regions, outputs)
        return self._dispatch_plans[key]

    def dispatch(self, request: LowLatencyDispatchRequest, rank_mask: torch.Tensor | None = None,
                 replay: LowLatencyDispatchReplay | None = None) -> LowLatencyDispatchResult:
        """``rank_mask``: shrink mode's int32 [R] (1 = skip that rank), or None. ``replay``: the
        front end's replay of this call shape, which learns this call's launches (a new one when
        None); handed back with the result."""
        self.check_status()
        x, topk_idx = request.x, request.topk_idx
        if not topk_idx.is_contiguous():
            topk_idx = topk_idx.contiguous()
        num_tokens, hidden = x.shape
        x_row_stride, x_column_stride = x.stride()
        if hidden % 2 or x_column_stride != 1 or x_row_stride % 2:   # bf16 rows move as int32 words
            raise InputError(f"the NVLink low-latency dispatch needs x with unit column stride, an even row stride "
                             f"and an even hidden, got hidden={hidden}, strides {tuple(x.stride())}")
        recv_stats = request.cumulative_local_expert_recv_stats
        wait_stats = request.dispatch_wait_recv_cost_stats
        key, constants, regions, outputs = self._dispatch_plan(request, hidden, topk_idx.shape[1],
                                                               self.dispatch_order.next_slot)
        packed, packed_words, scales_storage, packed_count, src_info, layout_range, topk_slot, dispatch_mask = outputs
        call, slot = self.dispatch_order.start(request.return_recv_hook)
        state = LowLatencyState(src_info, layout_range, topk_slot, dispatch_mask)
        # The launcher's changing arguments (_DISPATCH_CHANGING) come first; the rest is fixed by `key`.
        args = (x, x_row_stride, topk_idx, num_tokens, packed_words, scales_storage,
                src_info, topk_slot, layout_range, packed_count,
                recv_stats if recv_stats is not None else packed_count,
                wait_stats if wait_stats is not None else layout_range,
                rank_mask if rank_mask is not None else dispatch_mask, dispatch_mask,
                self.memory.peer_base_ptrs, self.area, self.my_area, slot, regions.dispatch_slot_bytes, self.rank,
                self.status_address, self.timeout_ns, request.num_max_dispatch_tokens_per_rank,
                request.num_experts // self.num_ranks)
        flags = (recv_stats is not None, wait_stats is not None, rank_mask is not None)
        first, receive = self._launch(self._dispatch_launcher, self.dispatch_shape, (key, flags), args, lambda: {
            **constants, "HAS_RECV_STATS": flags[0], "HAS_WAIT_STATS": flags[1], "HAS_MASK": flags[2]},
            request.return_recv_hook)
        fast = None
        # A repeat of this call shape may be replayed with these launches: they were made for
        # contiguous, 16-byte aligned tensors (what the replay checks).
        if (first is not None and x_row_stride == hidden and topk_idx is request.topk_idx
                and aligned(x.data_ptr(), topk_idx.data_ptr(), *[stats.data_ptr() for stats in (recv_stats, wait_stats)
                                                                   if stats is not None])):
            fast = replay if replay is not None else LowLatencyDispatchReplay(
                self, request.return_recv_hook, request.num_max_dispatch_tokens_per_rank, hidden,
                request.num_experts, self._dispatch_launcher.names)
            fast.slots.learn(slot, first, outputs)
        handle = LowLatencyHandle(src_info, layout_range, request.num_max_dispatch_tokens_per_rank, hidden,
                                  request.num_experts, self.buffer_id, state)
        if receive is None:
            state.received = True
            return LowLatencyDispatchResult(packed, packed_count, handle, None, fast or replay)

        def hook() -> None:
            self.check_status()
            self.dispatch_order.finish(call, slot)
            launched = receive()
            state.received = True
            if fast is not None:
                fast.slots.learn_receive(slot, launched)

        return LowLatencyDispatchResult(packed, packed_count, handle, hook, fast or replay)

    # ------------------------------------------------------------------ combine
    def combine(self, request: LowLatencyCombineRequest, rank_mask: torch.Tensor | None = None,
                replay: LowLatencyCombineReplay | None = None) -> LowLatencyCombineResult:
        """``rank_mask`` and ``replay`` as in dispatch."""
        x, topk_idx, topk_weights, handle = request.x, request.topk_idx, request.topk_weights, request.handle
        zero_copy, return_recv_hook, out, wait_stats = request.zero_copy, request.return_recv_hook, request.out, \
            request.wait_stats
        self.check_status()
        state: LowLatencyState = handle.backend_state
        if not state.received:
            raise InputError("low_latency_combine: the dispatch of this handle was not received yet; call its "
                             "recv hook first")
        src_info, layout_range, T, hidden, num_experts = handle
        source = self.get_next_low_latency_combine_buffer(handle) if zero_copy else x
        self.combine_buffer_index ^= 1
        expert_stride, row_stride, column_stride = source.stride()
        # The fast path's launches assume every tensor as the user gave it, contiguous.
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
        # This slot's output for calls without ``out``, which the fast path learns either way.
        slot_output = self.combine_output(self.combine_order.next_slot, T, hidden, num_tokens)
        if out is None:
            out = slot_output
        target = out if out.stride(1) == 1 else torch.empty_like(out, memory_format=torch.contiguous_format)
        call, slot = self.combine_order.start(return_recv_hook)
        combine_mask = self._combine_mask_rows[slot]
        regions = self._regions(T, hidden, num_experts)
        # The launcher's changing arguments (_COMBINE_CHANGING) come first; the rest is fixed by `key`.
        args = (source, expert_stride, row_stride, src_info, state.topk_slot, layout_range, topk_idx, topk_weights,
                num_tokens, target, target.stride(0),
                wait_stats if wait_stats is not None else layout_range,
                rank_mask if rank_mask is not None else combine_mask, state.dispatch_mask, combine_mask,
                self.memory.peer_base_ptrs, self.area, self.my_area, slot, regions.combine_offset,
                regions.combine_slot_bytes, self.rank, self.status_address, self.timeout_ns, T,
                num_experts // self.num_ranks)
        key = (T, hidden, num_experts, num_topk, wait_stats is not None, rank_mask is not None, slot)

        def constants() -> dict:
            return dict(NUM_RANKS=self.num_ranks, RANKS_PAD=_pow2(self.num_ranks), HIDDEN=hidden, NUM_TOPK=num_topk,
                        TOPK_PAD=_pow2(num_topk), HAS_WAIT_STATS=wait_stats is not None,
                        HAS_MASK=rank_mask is not None, ROWS=self.rows, BLOCK=2048,
                        REDUCE_BLOCK=min(_pow2(hidden), 2048))

        first, receive = self._launch(self._combine_launcher, self.combine_shape, key, args, constants,
                                      return_recv_hook)
        fast = None
        if (learnable and first is not None and target is out
                and aligned(*[tensor.data_ptr() for tensor in (source, topk_idx, topk_weights, out, wait_stats)
                              if tensor is not None])):
            fast = replay if replay is not None else LowLatencyCombineReplay(self, return_recv_hook, zero_copy, T, hidden,
                                                                 num_experts, self._combine_launcher.names)
            fast.slots.learn(slot, first, slot_output)

        def copy_back() -> None:
            if target is not out:
                out.copy_(target)

        if receive is None:
            copy_back()
            return LowLatencyCombineResult(out, None, fast or replay)

        def hook() -> None:
            self.check_status()
            self.combine_order.finish(call, slot)
            launched = receive()
            copy_back()
            if fast is not None:
                fast.slots.learn_receive(slot, launched)

        return LowLatencyCombineResult(out, hook, fast or replay)

    # ------------------------------------------------------------------ memory
    def combine_output(self, slot: int, T: int, hidden: int, num_tokens: int) -> torch.Tensor:
        """The first ``num_tokens`` rows of the bf16 [T, H] output of combines in ``slot`` made
        without ``out``: like the dispatch's outputs, made once per slot and reused by every
        second call (SPEC allows two low-latency results alive; allocating costs about 4 us of
        host time on an H200 host, a third of a decode-time call)."""
        output = self._combine_outputs.get((slot, T, hidden))
        if output is None:
            output = self._combine_outputs[(slot, T, hidden)] = torch.empty(T, hidden, dtype=torch.bfloat16,
                                                                             device=self.device)
        return output[:num_tokens]

    def _zero_copy_starts(self, T: int, hidden: int, num_experts: int) -> tuple[int, int, int]:
        """(byte offset in the local memory of each of the two zero-copy buffers, their bytes)."""
        regions = self._regions(T, hidden, num_experts)
        start = self.area + regions.zero_copy_offset
        return start, start + regions.zero_copy_bytes, regions.zero_copy_bytes

    def zero_copy_addresses(self, T: int, hidden: int, num_experts: int) -> tuple[int, int]:
        """Device addresses of the two buffers ``get_next_low_latency_combine_buffer`` returns in turn."""
        first, second, _ = self._zero_copy_starts(T, hidden, num_experts)
        base = self.memory.local.data_ptr()
        return base + first, base + second

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        _, _, T, hidden, num_experts = handle
        *starts, size = self._zero_copy_starts(T, hidden, num_experts)
        start = starts[self.combine_buffer_index]
        view = self.memory.local[start: start + size].view(torch.bfloat16)
        return view.view(num_experts // self.num_ranks, self.num_ranks * T, hidden)

    def local_bytes(self) -> torch.Tensor:
        return self.memory.local[self.area:]

    def clean(self, rank_mask: torch.Tensor | None = None) -> None:
        """Zero the control words on every rank not masked (collective over those ranks): call
        counters and the slot choice restart at 0. A kernel with two barriers over symmetric memory
        (``low_latency_clean_kernel``), which skip the ranks in ``rank_mask``."""
        self.check_status()
        if self.dispatch_order.pending or self.combine_order.pending:
            raise InputError("clean_low_latency_buffer: receive hooks of earlier calls are still pending")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)   # this rank's earlier calls, on any stream, are done
        low_latency_clean_kernel[(1,)](
            self.memory.peer_base_ptrs, rank_mask if rank_mask is not None else self.combine_masks, self.area,
            self.rank, self.status_address, self.timeout_ns, NUM_RANKS=self.num_ranks,
            RANKS_PAD=_pow2(self.num_ranks), HAS_MASK=rank_mask is not None, BLOCK=1024, GPU=GPU_KERNELS,
            num_warps=4)
        # Slots restart too, so ranks that made different numbers of calls before (one that was
        # masked and idle, say) agree on them again.
        self.dispatch_order.reset()
        self.combine_order.reset()

    def release(self) -> None:
        self._dispatch_plans.clear()   # and the outputs they keep (a destroyed Buffer holds no GPU memory)
        self._combine_outputs.clear()
        self.memory.release()
