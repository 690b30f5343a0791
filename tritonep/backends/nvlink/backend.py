"""The NVLink backend: ranks of one node, Triton kernels over torch symmetric memory.

Two engines, one per mode, each with its own symmetric allocation: normal mode
(``normal/engine.py``) over ``num_nvl_bytes`` of staging, and low-latency mode
(``low_latency/engine.py``) over ``num_rdma_bytes``. This class makes them, hands each call to
its engine, and gives the memory back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tritonep.backends import base
from tritonep.backends.nvlink.low_latency.backend_calls import LowLatencyBackendCalls
from tritonep.backends.nvlink.low_latency.engine import LowLatencyEngine
from tritonep.backends.nvlink.memory import SymmetricBuffer, give_back_released
from tritonep.backends.nvlink.normal.engine import NormalEngine
from tritonep.backends.nvlink.normal.notify_kernel import MAX_FROM_TOPK_RANKS
from tritonep.backends.nvlink.tuning import Tuning
from tritonep.core.checks import InputError
from tritonep.core.expert_layout import ExpertLayout, ExpertLayoutRequest
from tritonep.runtime.platform import INTERPRET


class NvlinkBackend(LowLatencyBackendCalls, base.Backend):
    def __init__(self, group: dist.ProcessGroup, buffer_id: int, num_nvl_bytes: int, num_rdma_bytes: int,
                 low_latency_mode: bool) -> None:
        super().__init__(group, buffer_id)
        self._device = torch.device("cpu") if INTERPRET else torch.device("cuda", torch.cuda.current_device())
        # A low-latency-only Buffer (num_nvl_bytes=0, as decode servers make them) has no staging
        # area; normal-mode calls then raise (NormalEngine.memory).
        self._memory = SymmetricBuffer(group, num_nvl_bytes, self._device, interpret=INTERPRET) \
            if num_nvl_bytes > 0 else None
        tuning = Tuning.from_environment()
        self.normal = NormalEngine(self._memory, self.rank, self.num_ranks, buffer_id, self._device, tuning)
        self._stream = None if INTERPRET else torch.cuda.Stream(self._device)
        # Low-latency mode has its own allocation (the front end checks its size per call).
        self._low_latency = LowLatencyEngine(group, buffer_id, num_rdma_bytes, self._device, tuning) \
            if low_latency_mode and num_rdma_bytes > 0 else None

    @property
    def tuning(self) -> Tuning:
        """The normal mode's kernel shapes and tunables; scripts and tests swap them per Buffer
        (the low-latency engine keeps the ones it was made with)."""
        return self.normal.tuning

    @tuning.setter
    def tuning(self, tuning: Tuning) -> None:
        self.normal.tuning = tuning

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def memory(self) -> SymmetricBuffer:
        """The normal mode's staging memory (raises InputError for a low-latency-only Buffer)."""
        return self.normal.memory

    @property
    def low_latency(self) -> LowLatencyEngine:
        if self._low_latency is None:
            raise InputError("low-latency calls on the NVLink backend need a Buffer made with low_latency_mode=True "
                             "and num_rdma_bytes from Buffer.get_low_latency_rdma_size_hint(...)")
        return self._low_latency

    def comm_stream(self) -> torch.cuda.Stream | None:
        return self._stream

    def low_latency_stream(self, async_finish: bool) -> torch.cuda.Stream | None:
        """Low-latency calls run on the caller's stream (one launch, nothing to overlap with)
        unless the caller asked for an event to wait on."""
        return self._stream if async_finish else None

    # ------------------------------------------------------------------ normal mode
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.normal.get_dispatch_layout(topk_idx, num_experts)

    @property
    def layout_in_dispatch(self) -> bool:
        """The count exchange works the layout out itself (``notify_kernel``'s ``FROM_TOPK``)."""
        return self.num_ranks <= MAX_FROM_TOPK_RANKS

    def dispatch(self, request: base.DispatchRequest) -> base.DispatchResult:
        return self.normal.dispatch(request)

    def combine(self, request: base.CombineRequest) -> base.CombineResult:
        return self.normal.combine(request)

    def expert_layout(self, request: ExpertLayoutRequest) -> ExpertLayout:
        return self.normal.expert_layout(request)

    # ------------------------------------------------------------------ low-latency mode
    # The calls themselves: LowLatencyBackendCalls, handing them to ``low_latency``.

    # ------------------------------------------------------------------ memory
    def get_local_buffer_tensor(self, dtype: torch.dtype, size: torch.Size | None, offset: int,
                                use_rdma_buffer: bool) -> torch.Tensor:
        data = self.low_latency.local_bytes() if use_rdma_buffer else self.memory.local[self.memory.data_offset:]
        data = data[offset:]
        element = dtype.itemsize
        view = data[: data.numel() // element * element].view(dtype)
        return view if size is None else view[: torch.Size(size).numel()].view(size)

    def destroy(self) -> None:
        if self._stream is not None:
            torch.cuda.synchronize(self._device)
        dist.barrier(group=self.group)
        if self._memory is not None:
            self._memory.release()
        if self._low_latency is not None:
            self._low_latency.release()
        give_back_released(self.group, [self._memory, self._low_latency.memory if self._low_latency else None])
