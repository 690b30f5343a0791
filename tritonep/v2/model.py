"""The numbers an ElasticBuffer works out from its group and sizes: domains, bytes, SMs, QPs.

DeepEP V2 derives these from the NCCL communicator and the NICs it finds. Here they follow the
node split of :mod:`tritonep.core.topology` and models of this package's own engines, written
so that arithmetic V2 code does with them (``num_qps <= num_allocated_qps``, buffer sizes that
are multiples of 2 MiB, ``scaleout_rank_idx * num_scaleup_ranks + scaleup_rank_idx == rank``)
stays right. Plain Python: no communication, no device.
"""

from __future__ import annotations

import math

from tritonep.backends.internode.layout import heap_bytes_for
from tritonep.backends.nvlink.sizes import nvl_bytes_for
from tritonep.core import topology
from tritonep.core.checks import InputError, is_int, require
from tritonep.core.routing import round_up

# V2 sizes and aligns its buffers in 2 MiB units (its symmetric memory granule); V2 code relies
# on hints and sizes being multiples of it.
BUFFER_ALIGNMENT = 2 << 20

# A V2 buffer sized with num_topk=0 must serve any top-k: V2 sizes for 32 (its kernels' limit).
SIZING_TOPK = 32

# The NVLink engine's link figure when the caller gives none: NVLink 4 (H100, H200) carries
# 18 links x 25 GB/s each way.
DEFAULT_NVLINK_GBS = 450.0
# Headroom over the bandwidth balance: programs do not all run at their ceiling all the time.
SM_HEADROOM = 1.25
# SMs of an H100 SXM: the device size the model assumes when the Buffer has no GPU (CPU backend).
STAND_IN_DEVICE_SMS = 132
# V2's floor for a buffer that does not overlap with compute (it then takes at least this many).
NO_OVERLAP_MIN_SMS = 64


def physical_domain_size(num_ranks: int) -> tuple[int, int]:
    """(num_rdma_ranks, num_nvlink_ranks): nodes, and ranks per node (``core.topology``)."""
    per_node = topology.ranks_per_node(num_ranks)
    return num_ranks // per_node, per_node


def logical_domain_size(num_ranks: int, allow_hybrid_mode: bool) -> tuple[int, int]:
    """(num_scaleout_ranks, num_scaleup_ranks): V2's rule, the physical split in hybrid mode,
    else one scale-out rank of all ranks."""
    nodes, per_node = physical_domain_size(num_ranks)
    return (nodes, per_node) if allow_hybrid_mode else (1, num_ranks)


def allocated_qps(num_allocated_qps: int, allow_hybrid_mode: bool) -> int:
    """``num_allocated_qps``, or for 0 the count V2 allocates when its NIC lacks fast atomics
    (the larger of its two hybrid figures): no engine here uses QPs, so the only job of the
    value is to admit every ``num_qps`` that V2 code computes with ``get_theoretical_num_qps``."""
    if num_allocated_qps:
        return num_allocated_qps
    return 129 if allow_hybrid_mode else 17


def theoretical_num_qps(num_sms: int, allow_hybrid_mode: bool, num_allocated_qps: int) -> int:
    """V2's QP arithmetic (one QP per channel and one for notifications in hybrid mode, at most
    9 in direct mode), capped by ``num_allocated_qps``."""
    num_qps = num_sms * 16 + 1 if allow_hybrid_mode else min(num_sms, 9)
    return min(num_qps, num_allocated_qps)


def buffer_bytes(num_ranks: int, num_max_tokens_per_rank: int, hidden: int, num_topk: int) -> int:
    """Bytes an ElasticBuffer needs so that every rank may receive ``num_max_tokens_per_rank``
    tokens from every rank (the fixed-size outputs of ``do_cpu_sync=False`` need that much):
    the NVLink engine's staging for that many dispatch rows and as many combine rows
    (:func:`tritonep.nvl_bytes_for`, bf16 rows, which also covers fp8 ones), and on a group that
    spans nodes the internode backend's heap for the same, in 2 MiB units."""
    require(is_int(num_max_tokens_per_rank) and num_max_tokens_per_rank > 0,
            f"num_max_tokens_per_rank must be a positive int to size the buffer, got {num_max_tokens_per_rank!r}")
    require(is_int(hidden) and hidden > 0, f"hidden must be a positive int to size the buffer, got {hidden!r}")
    require(is_int(num_topk) and num_topk >= 0, f"num_topk must be an int >= 0, got {num_topk!r}")
    needed = nvl_bytes_for(num_max_tokens_per_rank, hidden, num_ranks, num_topk or SIZING_TOPK)
    if topology.num_nodes(num_ranks) > 1:   # the internode backend's heap (every token to one node)
        needed = max(needed, heap_bytes_for(num_max_tokens_per_rank, hidden, num_topk or SIZING_TOPK, num_ranks,
                                            topology.ranks_per_node(num_ranks)))
    return round_up(needed, BUFFER_ALIGNMENT)


def theoretical_num_sms(num_ranks: int, device_sms: int | None, prefer_overlap_with_compute: bool,
                        nvlink_gbs: float, sm_read_gbs: float, sm_write_gbs: float) -> int:
    """Programs per dispatch/combine launch that keep the NVLink engine's link busy.

    The model (of this package's kernels, not V2's): every row a rank receives from a peer crosses
    NVLink once, pushed by a sender program into the receiver's staging, and every received row
    (this rank's own ones too) is copied once more by a receiver program into the outputs
    (the combine mirrors it). A program moves rows at min(sm_read_gbs, sm_write_gbs) GB/s (V2's
    default 50 is close to the 47 GB/s one program of ours moves on an H100, docs/findings.md).
    With a balanced gate a share (R - 1) / R of the received rows come from peers, so keeping the
    link at ``nvlink_gbs`` takes ``nvlink_gbs / rate`` senders and ``R / (R - 1)`` times as many
    receivers; top-k and the expert count cancel out (each extra row adds link and copy work
    alike). Plus 25% headroom, rounded up to an even count, at least 4; at least 64 when the
    buffer is not meant to overlap with compute; at most the device's SMs (132, an H100's, when
    the buffer has no GPU). One rank has no link traffic and gets the whole device.
    """
    device_sms = device_sms or STAND_IN_DEVICE_SMS
    rate = min(sm_read_gbs, sm_write_gbs)
    require(rate > 0, f"sm_read_gbs and sm_write_gbs must be positive, got {sm_read_gbs}, {sm_write_gbs}")
    if num_ranks == 1:
        num_sms = device_sms
    else:
        link = nvlink_gbs or DEFAULT_NVLINK_GBS
        programs = link / rate * (1 + num_ranks / (num_ranks - 1))
        num_sms = max(4, round_up(math.ceil(programs * SM_HEADROOM), 2))
    if not prefer_overlap_with_compute:
        num_sms = max(num_sms, NO_OVERLAP_MIN_SMS)
    return min(num_sms, device_sms)


def check_model_arguments(num_experts: object, num_topk: object, num_scaleout_topk: object, num_ranks: int) -> None:
    """The arguments of ``get_theoretical_num_sms`` that V2 requires (same rules, our messages)."""
    require(is_int(num_experts) and num_experts > 0 and num_experts % num_ranks == 0,
            f"num_experts must be a positive int divisible by the {num_ranks} ranks, got {num_experts!r}")
    require(is_int(num_topk) and num_topk >= 0, f"num_topk must be an int >= 0, got {num_topk!r}")
    if num_scaleout_topk != 0:
        raise InputError(f"num_scaleout_topk is reserved (0 only, as in DeepEP V2), got {num_scaleout_topk!r}")
