"""DeepEP V1 beside tritonep (``--vs-deepep``): its ``deep_ep`` module when it imports and is
DeepEP itself (built from ../shared/deepep by ``scripts/gpu_check.sh bench``), else why not.
tritonep stays imported as ``tritonep`` and DeepEP as ``deep_ep``, so neither shadows the other."""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist


def load_deepep() -> tuple[object | None, str]:
    """(DeepEP's ``deep_ep`` module, "") when it imports and is DeepEP itself, else (None, why)."""
    try:
        import deep_ep as module
    except ImportError as error:
        return None, f"DeepEP not found (import deep_ep: {error})"
    if getattr(module, "__name__", "") != "deep_ep" or hasattr(module, "InputError"):
        return None, "import deep_ep gave tritonep, not DeepEP"
    return module, ""


def deepep_buffer(group: dist.ProcessGroup, gpu: bool, num_nvl_bytes: int = 0,
                  low_latency_shape: tuple[int, int, int, int] | None = None) -> tuple | dict:
    """``(deep_ep, its Buffer)``: in normal mode with ``num_nvl_bytes``, or in low-latency mode
    sized by DeepEP's own hint for ``low_latency_shape`` = (tokens, hidden, ranks, experts) as its
    test sizes it; or ``{"missing": why}`` / ``{"error": ...}`` so that the rest of the run still
    reports."""
    module, why = load_deepep()
    if module is None or not gpu:
        return {"missing": why or "DeepEP runs on GPUs only"}
    try:
        if low_latency_shape is None:
            return module, module.Buffer(group, num_nvl_bytes, 0, low_latency_mode=False, num_qps_per_rank=1,
                                         explicitly_destroy=True)
        tokens, hidden, num_ranks, num_experts = low_latency_shape
        num_rdma_bytes = module.Buffer.get_low_latency_rdma_size_hint(tokens, hidden, num_ranks, num_experts)
        return module, module.Buffer(group, 0, num_rdma_bytes, low_latency_mode=True,
                                     num_qps_per_rank=num_experts // num_ranks,
                                     allow_nvlink_for_low_latency_mode=True, explicitly_destroy=True)
    except Exception as error:  # noqa: BLE001 - report it, keep the run's other figures
        return {"error": f"{type(error).__name__}: {error}"}


def guarded(measure: Callable[[], dict]) -> dict:
    """``measure()``, or ``{"error": ...}`` when DeepEP fails inside it."""
    try:
        return measure()
    except Exception as error:  # noqa: BLE001 - report it, keep the run's other figures
        return {"error": f"{type(error).__name__}: {error}"}
