"""DeepEP's test helpers (``deep_ep.utils``), so that DeepEP-style tests run unchanged.

The FP8 helpers wrap :mod:`tritonep.core.fp8`, the one place that defines the cast; ``tritonep.core.fp8``
is imported inside them so that ``import tritonep`` never pays for (or depends on) it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def per_token_cast_to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise bf16 ``x`` [N, H] per token and per 128 channels.

    Returns:
        (e4m3 [N, H], float32 scales [N, H/128]) with ``x ~= fp8 * scale`` and
        scale = max(amax, 1e-4) / 448, as DeepEP's helper.
    """
    from tritonep.core.fp8 import cast_to_fp8

    return cast_to_fp8(x)


def per_token_cast_back(x_fp8: torch.Tensor, x_scales: torch.Tensor) -> torch.Tensor:
    """Dequantise to bf16 [N, H].

    ``x_scales`` is float32 [N, H/128] (any strides), or int32 [N, H/512] holding four UE8M0
    exponent bytes per element, the packing of ``low_latency_dispatch(use_ue8m0=True)``.
    """
    if x_fp8.numel() == 0:  # nothing to scale; also spares empty receives a shape check
        return x_fp8.to(torch.bfloat16)
    from tritonep.core.fp8 import cast_back

    return cast_back(x_fp8, x_scales)


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepEP's dissimilarity: ``1 - 2 sum(x y) / sum(x^2 + y^2)`` in float64.

    0 means identical. As in DeepEP, both sides are shifted by +1 first, which keeps the
    measure defined (0) when both tensors are all zeros; DeepEP's test thresholds
    (e.g. ``< 1e-5`` for bf16 round trips) assume that shift.
    """
    x, y = x.double() + 1, y.double() + 1
    denominator = (x * x + y * y).sum()
    similarity = 2 * (x * y).sum() / denominator
    return float(1 - similarity)


def bench(fn: Callable[[], object], num_warmups: int = 50, num_tests: int = 50,
          post_fn: Callable[[], object] | None = None) -> tuple[float, float, float]:
    """Time ``fn`` and return (average, min, max) seconds per call.

    With CUDA in use (available and already initialised by the caller) each call is timed with
    CUDA events, i.e. GPU time of the work it enqueues; otherwise with ``time.perf_counter``.
    ``post_fn`` runs after each timed call, outside the timed region. As in DeepEP, the first
    timed call is dropped when there are at least two, because it often absorbs a late
    allocation or compilation.
    """
    use_cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if use_cuda:
        torch.cuda.synchronize()
    for _ in range(num_warmups):
        fn()
    times: list[float] = []
    if use_cuda:
        # 256 MB zeroed between warm-up and timing flushes L2, so the first timed calls do not
        # read inputs the warm-up left in cache (DeepEP does the same).
        torch.empty(int(256e6 // 4), dtype=torch.int32, device="cuda").zero_()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(num_tests)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(num_tests)]
        for start, end in zip(starts, ends):
            start.record()
            fn()
            end.record()
            if post_fn is not None:
                post_fn()
        torch.cuda.synchronize()
        times = [start.elapsed_time(end) / 1e3 for start, end in zip(starts, ends)]
    else:
        for _ in range(num_tests):
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
            if post_fn is not None:
                post_fn()
    if len(times) >= 2:
        times = times[1:]
    if not times:
        return 0.0, 0.0, 0.0
    return statistics.fmean(times), min(times), max(times)


def inplace_unique(x: torch.Tensor, num_slots: int) -> None:
    """Per row of ``x`` [rows, cols], keep each value in [0, num_slots) once, in place.

    Each row becomes its distinct non-negative values in descending order followed by -1
    padding (DeepEP's semantics; tests use it to turn top-k expert ids into rank ids).
    Negative entries are "nothing" and are dropped.
    """
    assert x.dim() == 2, f"inplace_unique needs a 2-D tensor, got {x.dim()}-D"
    # Count each value per row in a [rows, num_slots + 1] histogram; negatives go to the extra
    # last bin so that one scatter handles them, and that bin is then dropped.
    bins = x.masked_fill(x < 0, num_slots).long()
    counts = torch.zeros((x.size(0), num_slots + 1), dtype=torch.int64, device=x.device)
    counts.scatter_add_(1, bins, torch.ones_like(bins))
    present = counts[:, :num_slots] > 0
    values = torch.arange(num_slots, device=x.device, dtype=x.dtype).expand(x.size(0), num_slots)
    values = values.masked_fill(~present, -1)
    # Descending sort puts present values first (largest first) and the -1s last.
    values = values.sort(dim=1, descending=True).values
    keep = min(num_slots, x.size(1))
    x.fill_(-1)
    x[:, :keep] = values[:, :keep]


def hash_tensor(t: torch.Tensor) -> int:
    """A deterministic int summarising the bytes of ``t``.

    DeepEP's definition: the wrap-around sum of the tensor's bytes read as int64 words (zero
    padded to a multiple of 8 bytes here, so any size works). A sum does not depend on word
    order, which is deliberate: low-latency results may place source blocks in a different
    order between runs and still hash equal.
    """
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    padding = (-raw.numel()) % 8
    if padding:
        raw = torch.cat([raw, raw.new_zeros(padding)])
    return int(raw.view(torch.int64).sum().item())
