"""Shared pieces of the V2 (ElasticBuffer) tests: a world of routings, the calls every rank makes,
and brute-force references.

A ``World`` holds every rank's inputs, so each rank picks its own and the pytest process can
build what any rank must receive with plain loops over (source rank, token, k) that share no
code with ``tritonep``. fp8 tensors cannot be pickled, so they travel as uint8 views.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from routed_world import RoutedWorld

FP8 = torch.float8_e4m3fn
STRATEGIES = ("uniform", "skewed", "empty", "all_to_one", "all_minus_one")


@dataclass
class World(RoutedWorld):
    """The V2 tests' world: weights are 7.0 where topk == -1, which every path must ignore."""

    fp8_data: list[torch.Tensor]        # uint8 view of e4m3 [N_r, H]
    fp8_scales: list[torch.Tensor]      # float32 [N_r, H/128] or int32 [N_r, H/512 rounded up]
    biases: list[tuple[torch.Tensor, ...]] = field(default_factory=list)
    alignment: int = 1
    expand_no_sync: bool = True         # the no-sync dispatch is expanded (else not)
    col_major_scales: bool = False

    def options(self) -> str:
        return f"align={self.alignment} biases={len(self.biases[0])} expand_no_sync={self.expand_no_sync}"


def build_world(R: int, seed: int, strategy: str = "uniform", tokens: list[int] | None = None, H: int = 128,
                E_local: int = 2, K: int = 3, T_extra: int = 1, alignment: int = 1, num_biases: int = 1,
                packed_scales: bool = False, expand_no_sync: bool = True, col_major_scales: bool = False) -> World:
    rng = np.random.default_rng(seed)
    E = R * E_local
    if strategy == "empty":
        tokens = [0] * R
    elif tokens is None:
        tokens = [int(n) for n in rng.integers(1, 10, size=R)]
    T = max(max(tokens), 1) + T_extra
    topk, weights, x, x2, data, scales, biases = [], [], [], [], [], [], []
    target, hot = int(rng.integers(R)), int(rng.integers(E))
    for r in range(R):
        idx = np.full((tokens[r], K), -1, dtype=np.int64)
        for t in range(tokens[r]):
            if strategy == "all_minus_one":
                continue
            pool = np.arange(target * E_local, (target + 1) * E_local) if strategy == "all_to_one" else np.arange(E)
            count = min(K, len(pool))
            prob = None
            if strategy == "skewed":
                prob = np.where(pool == hot, 100.0, 1.0)
                prob /= prob.sum()
            chosen = rng.choice(pool, size=count, replace=False, p=prob)
            chosen = chosen[rng.random(count) >= 0.2]
            idx[t, rng.permutation(K)[: len(chosen)]] = chosen
        topk.append(torch.from_numpy(idx))
        w = torch.from_numpy(rng.uniform(0.1, 1.0, size=(tokens[r], K)).astype(np.float32))
        weights.append(torch.where(topk[-1] >= 0, w, torch.full_like(w, 7.0)))
        x.append(torch.from_numpy(rng.standard_normal((tokens[r], H)).astype(np.float32)).to(torch.bfloat16))
        x2.append(torch.from_numpy(3 * rng.standard_normal((tokens[r], H)).astype(np.float32)).to(torch.bfloat16))
        data.append(torch.from_numpy(rng.uniform(-400, 400, size=(tokens[r], H)).astype(np.float32)).to(FP8)
                    .view(torch.uint8))
        if packed_scales:
            scales.append(torch.from_numpy(rng.integers(-2**31, 2**31, size=(tokens[r], math.ceil(H / 512)))
                                           .astype(np.int32)))
        else:
            scales.append(torch.from_numpy(rng.uniform(0.01, 2.0, size=(tokens[r], H // 128)).astype(np.float32)))
        biases.append(tuple(torch.from_numpy(rng.standard_normal((tokens[r], H)).astype(np.float32))
                            .to(torch.bfloat16) for _ in range(num_biases)))
    return World(R, H, E, K, T, strategy, x, x2, topk, weights, data, scales, biases, alignment, expand_no_sync,
                 col_major_scales)


# ----------------------------------------------------------------------------- brute force
def rank_of(world: World, expert: int) -> int:
    return expert // world.E_local


def received(world: World, r: int) -> list[tuple[int, int]]:
    """(source rank, token) of every row rank r receives, in order."""
    return [(s, t) for s in range(world.R) for t in range(world.topk[s].shape[0])
            if any(e >= 0 and rank_of(world, e) == r for e in world.topk[s][t].tolist())]


def local_ids(world: World, s: int, t: int, r: int) -> list[int]:
    return [e - r * world.E_local if e >= 0 and rank_of(world, e) == r else -1 for e in world.topk[s][t].tolist()]


def aligned(count: int, alignment: int) -> int:
    return (count + alignment - 1) // alignment * alignment


def expert_pairs(world: World, r: int) -> list[list[tuple[int, int, int]]]:
    """Per local expert of rank r: its (source rank, token, k) pairs, in receive order."""
    pairs: list[list[tuple[int, int, int]]] = [[] for _ in range(world.E_local)]
    for s, t in received(world, r):
        for k, e in enumerate(local_ids(world, s, t, r)):
            if e >= 0:
                pairs[e].append((s, t, k))
    return pairs


def expanded_layout(world: World, r: int) -> list[tuple[int, int, int] | None]:
    """Each expanded row of rank r: its (source rank, token, k), or None for padding."""
    rows: list[tuple[int, int, int] | None] = []
    for pairs in expert_pairs(world, r):
        rows += pairs + [None] * (aligned(len(pairs), world.alignment) - len(pairs))
    return rows


def worst_expanded(world: World) -> int:
    rows = world.R * world.T * min(world.K, world.E_local) + (world.alignment - 1) * world.E_local
    return aligned(rows, world.alignment)


def expert_factor(expert: int) -> float:
    """The stand-in expert multiplies its rows by (global expert id + 1)."""
    return float(expert + 1)


# ----------------------------------------------------------------------------- on the ranks
def fp8_input(world: World, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    scales = world.fp8_scales[rank]
    if world.col_major_scales:
        scales = scales.t().contiguous().t()
    return world.fp8_data[rank].view(FP8), scales


def expert_rows_expanded(recv_x: torch.Tensor, handle, rank: int, E_local: int) -> torch.Tensor:
    """The stand-in expert on an expanded recv_x: rows of local expert e times its global id + 1,
    found from the handle's prefix sums (expanded: aligned start + count)."""
    psum = handle.psum_num_recv_tokens_per_expert.tolist()
    out = torch.full_like(recv_x, float("nan"))   # padding rows must never be read
    start = 0
    for e in range(E_local):
        end = psum[e]
        out[start:end] = (recv_x[start:end].float() * expert_factor(rank * E_local + e)).to(torch.bfloat16)
        start = aligned(end, handle.expert_alignment)
    return out


def expert_rows_summed(recv_x: torch.Tensor, recv_idx: torch.Tensor, rank: int, E_local: int) -> torch.Tensor:
    """The same expert on a non-expanded recv_x: per row, the float32 sum over its local slots
    (k ascending) of the expert's bf16 output, rounded once: what an expanded combine sums."""
    total = torch.zeros(recv_x.shape, dtype=torch.float32)
    for k in range(recv_idx.shape[1]):
        e = recv_idx[:, k]
        factor = (rank * E_local + e.clamp(min=0) + 1).float().view(-1, 1)
        total += torch.where((e >= 0).view(-1, 1), (recv_x.float() * factor).to(torch.bfloat16).float(), 0.0)
    return total.to(torch.bfloat16)


def handle_fields(handle) -> dict:
    return dict(num_recv=handle.num_recv_tokens, num_expanded=handle.num_expanded_tokens,
                expert_list=list(handle.num_recv_tokens_per_expert_list),
                psum_rank=handle.psum_num_recv_tokens_per_scaleup_rank.clone(),
                psum_expert=handle.psum_num_recv_tokens_per_expert.clone(),
                unaligned=handle.num_unaligned_recv_tokens_per_expert.clone(),
                metadata=handle.recv_src_metadata.clone(), dst=handle.dst_buffer_slot_idx.clone())


def round_trip(group, world: World) -> dict:
    """Every call of one example on this rank, V1's Buffer beside V2's ElasticBuffer; returns
    copies of the outputs."""
    import tritonep as deep_ep

    rank, E, T = group.rank(), world.E, world.T
    x, topk, weights, x2 = world.x[rank], world.topk[rank], world.weights[rank], world.x2[rank]
    biases = world.biases[rank]
    bias = None if not biases else (biases[0] if len(biases) == 1 else tuple(biases))
    out: dict = {}

    # V1 on the same routing: the reference for V2's non-expanded round trip.
    v1 = deep_ep.Buffer(group)
    per_rank, _, per_expert, in_rank, _ = v1.get_dispatch_layout(topk, E)
    v1_x, v1_idx, v1_w, v1_list, v1_handle, _ = v1.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk,
        topk_weights=weights, expert_alignment=world.alignment)
    v1_combined, v1_combined_w, _ = v1.combine(v1_x, v1_handle, topk_weights=v1_w, bias=bias)
    # The expanded round trip's reference: V1 rows through the summed expert.
    y_rows = expert_rows_summed(v1_x, v1_idx, rank, world.E_local)
    v1_expanded_combined, _, _ = v1.combine(y_rows, v1_handle, bias=bias)
    out["v1"] = (v1_x, v1_idx, v1_w, list(v1_list), v1_combined, v1_combined_w, v1_expanded_combined)

    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=T, hidden=world.H, num_topk=world.K)
    stats = torch.zeros(world.E_local, dtype=torch.int32)
    recv_x, recv_idx, recv_w, handle, _ = buffer.dispatch(
        x, topk_idx=topk, topk_weights=weights, num_experts=E, expert_alignment=world.alignment,
        cumulative_local_expert_recv_stats=stats)
    combined, combined_w, _ = buffer.combine(recv_x, handle, topk_weights=recv_w, bias=bias)
    out["plain"] = (recv_x, recv_idx, recv_w, handle_fields(handle), combined, combined_w)
    cached = buffer.dispatch(x2, handle=handle)
    out["cached"] = (cached[0], cached[1], cached[2] is None, cached[3] is handle)

    e_x, e_idx, e_w, e_handle, _ = buffer.dispatch(
        x, topk_idx=topk, topk_weights=weights, num_experts=E, expert_alignment=world.alignment, do_expand=True,
        do_zero_padding=True, cumulative_local_expert_recv_stats=stats)
    y = expert_rows_expanded(e_x, e_handle, rank, world.E_local)
    e_combined, e_combined_w, _ = buffer.combine(y, e_handle, topk_weights=e_w, bias=bias)
    out["expand"] = (e_x, e_idx is None, e_w, handle_fields(e_handle), e_combined, e_combined_w)
    c_x, c_idx, c_w, _, _ = buffer.dispatch(x2, handle=e_handle, topk_weights=weights, do_expand=True,
                                            do_zero_padding=True)
    out["cached_expand"] = (c_x, c_idx is None, c_w)
    out["stats"] = stats

    # No CPU sync, fp8: worst-case sizes, counts on the device.
    expand = world.expand_no_sync
    (n_data, n_scales), n_idx, n_w, n_handle, _ = buffer.dispatch(
        fp8_input(world, rank), topk_idx=topk, topk_weights=weights, num_experts=E, expert_alignment=world.alignment,
        do_cpu_sync=False, do_expand=expand, do_zero_padding=expand)
    n_y = expert_rows_expanded(torch.nan_to_num(n_data.float()).to(torch.bfloat16), n_handle, rank, world.E_local) \
        if expand else None
    n_combined = buffer.combine(n_y, n_handle)[0] if expand else None
    out["no_sync"] = (n_data.view(torch.uint8), n_scales, n_idx, n_w, handle_fields(n_handle), n_combined)
    return out
