"""The internode normal mode's host side: count exchange, packing, launches, handles.

A fresh dispatch: the payloads of the count exchange are made with torch ops in the heap, the
notify kernel exchanges them, the host reads them back (the one sync) and checks them (every
rank holds the same table, so every rank raises alike); then this rank's rows are packed once
per destination node into its send area (torch ops), the network stage puts them to the nodes
and the node stage places them. A cached dispatch repacks x with the handle's plan and skips
the exchange. A combine stages its input, reduces inside the node and sends the sums back.
Routing comes from ``core/routing.py``; handles are ``NodeDispatchHandle``s (DeepEP's internode tuple).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from tritonep.backends.base import CombineRequest, CombineResult, DispatchRequest, DispatchResult
from tritonep.backends.internode import combine_kernel, dispatch_kernel
from tritonep.backends.internode.layout import (
    CHANNELS,
    NODE_BLOCK,
    PUT_WARPS,
    RECEIVE_WARPS,
    HeapLayout,
    RowPacking,
    weights_pad,
)
from tritonep.backends.internode.memory import TransportHeap
from tritonep.backends.internode.transport import launch
from tritonep.backends.nvlink.tuning import Tuning
from tritonep.core import routing
from tritonep.core.checks import InputError
from tritonep.core.handles import NodeDispatchHandle
from tritonep.runtime.launcher import as_words
from tritonep.runtime.platform import GPU_KERNELS
from tritonep.runtime.status import StatusWord, timeout_error

ROWS = 8


@dataclass
class NodePlan:
    """What a handle carries from its fresh dispatch for the cached dispatch and the combine."""

    send_tokens: torch.Tensor     # int64 [S]: the token of each packed row, by node then token
    send_nodes: torch.Tensor      # int64 [S]: its destination node
    send_rows: torch.Tensor       # int64 [S]: its row in that node's list
    send_positions: torch.Tensor  # int32 [S, G]: its row in each destination rank's block, or -1
    node_rows: torch.Tensor       # int32 [nodes]: rows this rank sends each node
    node_pos: torch.Tensor        # int32 [N, nodes]: each token's row in its node's list, or -1
    landing_rows: torch.Tensor    # int32 [G, nodes]: rows each rank of this node got from each node
    kept_pos: torch.Tensor        # int32 [nodes, worst, G]: the rows that landed here, by rank of the node
    worst: int                    # most rows any rank sends any node (every rank knows the same)


class InternodeNormal:
    """Dispatch and combine of a group that spans nodes, over ``heap``."""

    def __init__(self, heap: TransportHeap, rank: int, num_ranks: int, ranks_per_node: int, buffer_id: int,
                 device: torch.device) -> None:
        self.heap, self.rank, self.num_ranks, self.buffer_id, self.device = heap, rank, num_ranks, buffer_id, device
        self.per_node = ranks_per_node
        self.num_nodes = num_ranks // ranks_per_node
        self.layout = HeapLayout(num_ranks, ranks_per_node, heap.local.numel())
        self.status = StatusWord()
        self.timeout_ns = Tuning.from_environment().timeout_ns   # TRITONEP_TIMEOUT_S, as on NVLink
        self.notify_epoch = self.dispatch_epoch = self.combine_epoch = 0
        words = heap.local.view(torch.int32)
        payload = self.layout.payload_words
        start = self.layout.payload_send // 4
        self.payload_send = words[start:start + num_ranks * payload].view(num_ranks, payload)
        start = self.layout.payload_landing // 4
        self.payload_landing = words[start:start + 2 * num_ranks * payload].view(2, num_ranks, payload)

    def check_status(self) -> None:
        code = self.status.code
        if code:
            raise timeout_error(code, self.rank, self.timeout_ns, "internode dispatch/combine calls", self.per_node)

    def _args(self) -> tuple:
        return self.heap.transport_table, self.heap.base, self.rank

    # ------------------------------------------------------------------ count exchange
    def _exchange(self, request: DispatchRequest, packing: RowPacking) -> torch.Tensor:
        """Every rank's payload for this rank, int64 [R sources, payload words] on the host."""
        in_rank, R, nodes = request.is_token_in_rank, self.num_ranks, self.num_nodes
        experts_per_rank = request.num_experts // R
        if experts_per_rank > self.layout.payload_words - R - nodes - 8:
            raise InputError(f"at most {self.layout.payload_words - R - nodes - 8} experts per rank, got "
                             f"{experts_per_rank}")
        send = self.payload_send
        send[:, :R] = in_rank.sum(0, dtype=torch.int32)
        send[:, R:R + nodes] = routing.tokens_per_node(in_rank, self.per_node)
        send[:, R + nodes:R + nodes + experts_per_rank] = request.num_tokens_per_expert.view(R, experts_per_rank)
        signature = [packing.x_words, packing.scale_words, packing.num_topk, request.num_experts,
                     request.num_worst_tokens, request.num_max_tokens_per_rank]
        send[:, -8:-2] = torch.tensor(signature, dtype=torch.int32, device="cpu").to(self.device)
        self.notify_epoch += 1
        layout = self.layout
        launch(dispatch_kernel.notify_kernel, 1, (*self._args(), self.notify_epoch, self.status.tensor,
                                                   self.timeout_ns),
               dict(PAYLOAD_SEND=layout.payload_send, PAYLOAD_LANDING=layout.payload_landing,
                    PAYLOAD_BYTES=4 * layout.payload_words, FLAG=layout.notify_flag, NUM_RANKS=R, GPU=GPU_KERNELS),
               self.heap.transport)
        table = self.payload_landing[self.notify_epoch % 2].to("cpu", torch.int64)   # the sync
        self.check_status()
        return table

    def _check_table(self, table: torch.Tensor, request: DispatchRequest, cap: int) -> None:
        """Raise alike on every rank (all hold the same table) for calls that cannot go on."""
        R, nodes = self.num_ranks, self.num_nodes
        # The signature's words that every rank must pass alike (num_worst_tokens may differ).
        names = {-8: "hidden words", -7: "scale words", -6: "top-k", -5: "num_experts", -3: "num_max_tokens_per_rank"}
        for column, name in names.items():
            values = table[:, column].tolist()
            if any(v != values[0] for v in values):
                raise InputError(f"dispatch: every rank must pass the same {name}, got "
                                 + ", ".join(f"rank {r}: {v}" for r, v in enumerate(values)))
        received = table[:, :R].sum(0).tolist()
        for target, worst in enumerate(table[:, -4].tolist()):
            if 0 < worst < received[target]:
                raise InputError(f"dispatch: rank {target} receives {received[target]} tokens but passed "
                                 f"num_worst_tokens={worst}; num_worst_tokens must be an upper bound")
        most = int(table[:, R:R + nodes].max()) if R else 0
        if most > cap:
            raise InputError(f"dispatch: a rank sends {most} tokens to one node but the internode buffer holds "
                             f"{cap} such rows; make the Buffer with more num_rdma_bytes")

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, request: DispatchRequest) -> DispatchResult:
        self.check_status()
        x, scales, handle = request.x, request.x_scales, request.cached_handle
        R, G, nodes, rank = self.num_ranks, self.per_node, self.num_nodes, self.rank
        row_bytes = x.shape[1] * x.element_size()
        if row_bytes % 4:
            raise InputError(f"the internode backend moves rows in 4-byte words; hidden={x.shape[1]} of {x.dtype} "
                             f"gives {row_bytes} bytes")
        has_topk = request.topk_idx is not None
        packing = RowPacking(row_bytes // 4, scales.shape[1] if scales is not None else 0,
                             request.topk_idx.shape[1] if has_topk else 0, G)
        cap, send, landing = self.layout.dispatch(packing.row_words)
        per_expert = None
        if handle is None:
            table = self._exchange(request, packing)
            self._check_table(table, request, cap)
            count_matrix = table[:, :R]
            prefix = routing.rank_prefix_matrix(count_matrix).to(self.device)
            real_rows = int(count_matrix[:, rank].sum())
            num_out_rows = request.num_worst_tokens or real_rows
            experts_per_rank = request.num_experts // R
            if request.num_worst_tokens:
                per_expert = []
            else:
                per_expert = routing.round_up_counts(
                    table[:, R + nodes:R + nodes + experts_per_rank].sum(0).tolist(), request.expert_alignment)
            plan = self._plan(request.is_token_in_rank, table)
        else:
            plan = handle.backend_state
            prefix, num_out_rows = handle.rank_prefix_matrix, handle.num_recv_rows
            real_rows = int(prefix[-1, rank])
            if plan.worst > cap:
                raise InputError(f"cached dispatch: a rank sends {plan.worst} tokens to one node but the internode "
                                 f"buffer holds {cap} rows of this size; make the Buffer with more num_rdma_bytes")
        self._pack(x, scales, request.topk_idx, request.topk_weights, plan, packing, cap, send)
        outputs = self._outputs(x, scales, packing, num_out_rows, real_rows, has_topk)
        self._launch_dispatch(plan, prefix, packing, cap, send, landing, outputs, num_out_rows, request.num_experts)
        recv_x, recv_scales, recv_idx, recv_weights, recv_src = outputs
        if handle is None:
            handle = NodeDispatchHandle(prefix, request.is_token_in_rank, recv_src, num_out_rows, x.shape[1],
                                        self.buffer_id, plan, rank=rank, ranks_per_node=G)
        if request.cached_handle is not None:
            recv_idx = recv_weights = None
        return DispatchResult(recv_x, recv_scales, recv_idx, recv_weights, per_expert, handle)

    def _plan(self, in_rank: torch.Tensor, table: torch.Tensor) -> NodePlan:
        """This rank's send plan (torch ops, no sync) and what the exchange told it."""
        num_tokens, R, G, nodes = in_rank.shape[0], self.num_ranks, self.per_node, self.num_nodes
        my_node = self.rank // G
        in_node = in_rank.view(num_tokens, nodes, G).any(dim=2)
        node_pos = routing.column_positions(in_node)
        destination, tokens = in_node.t().nonzero(as_tuple=True)      # by node, then token
        rows = node_pos[tokens, destination].to(torch.int64)
        rank_pos = routing.column_positions(in_rank)
        positions = rank_pos.view(num_tokens, nodes, G)[tokens, destination]
        per_node = table[:, R:R + nodes]
        landing_rows = per_node[[n * G + local for local in range(G) for n in range(nodes)], my_node].view(G, nodes)
        worst = int(per_node.max()) if R else 0
        kept = torch.full((nodes, max(worst, 1), G), -1, dtype=torch.int32, device=self.device)
        return NodePlan(tokens, destination, rows, positions.contiguous(), in_node.sum(0, dtype=torch.int32),
                        node_pos.contiguous(), landing_rows.to(torch.int32).to(self.device), kept, worst)

    def _pack(self, x: torch.Tensor, scales: torch.Tensor | None, topk_idx: torch.Tensor | None,
              topk_weights: torch.Tensor | None, plan: NodePlan, packing: RowPacking, cap: int, send: int) -> None:
        """This rank's rows, once per destination node, into its send area (torch ops)."""
        tokens = plan.send_tokens
        rows = torch.zeros(tokens.numel(), packing.row_words, dtype=torch.int32, device=self.device)
        rows[:, :packing.x_words] = as_words(x)[tokens]
        if scales is not None:
            rows[:, packing.x_words:packing.x_words + packing.scale_words] = as_words(scales)[tokens]
        if topk_idx is not None:
            k = packing.num_topk
            rows[:, packing.idx_word:packing.idx_word + 2 * k] = \
                topk_idx[tokens].contiguous().view(torch.int32)
            rows[:, packing.weights_word:packing.weights_word + k] = topk_weights[tokens].view(torch.int32)
        rows[:, packing.src_word] = tokens.to(torch.int32)
        rows[:, packing.pos_word:packing.pos_word + self.per_node] = plan.send_positions
        area = self.heap.local[send:].view(torch.int32)
        area = area[: area.numel() // packing.row_words * packing.row_words].view(-1, packing.row_words)
        area.index_copy_(0, plan.send_nodes * cap + plan.send_rows, rows)

    def _outputs(self, x: torch.Tensor, scales: torch.Tensor | None, packing: RowPacking, rows: int, real: int,
                 has_topk: bool) -> tuple:
        """Outputs; rows past the received ones (num_worst_tokens) hold DeepEP's padding."""
        device, k = self.device, packing.num_topk
        recv_x = torch.zeros(rows, x.shape[1], dtype=x.dtype, device=device) if rows > real else \
            torch.empty(rows, x.shape[1], dtype=x.dtype, device=device)
        recv_scales = None if scales is None else torch.zeros(rows, scales.shape[1], dtype=scales.dtype, device=device)
        recv_idx = torch.full((rows, k), -1, dtype=torch.int64, device=device) if has_topk else None
        recv_weights = torch.zeros(rows, k, dtype=torch.float32, device=device) if has_topk else None
        recv_src = torch.full((rows,), -1, dtype=torch.int32, device=device)
        return recv_x, recv_scales, recv_idx, recv_weights, recv_src

    def _launch_dispatch(self, plan: NodePlan, prefix: torch.Tensor, packing: RowPacking, cap: int, send: int,
                         landing: int, outputs: tuple, num_out_rows: int, num_experts: int) -> None:
        layout, heap, G, nodes, R = self.layout, self.heap, self.per_node, self.num_nodes, self.num_ranks
        recv_x, recv_scales, recv_idx, recv_weights, recv_src = outputs
        released = G * self.dispatch_epoch      # receivers of a node add one each per call
        self.dispatch_epoch += 1
        launch(dispatch_kernel.network_send_kernel, nodes * CHANNELS,
               (*self._args(), plan.node_rows, cap, 4 * packing.row_words, send, landing, self.dispatch_epoch,
                released, self.status.tensor, self.timeout_ns),
               dict(TAIL=layout.landing_tail, FREE=layout.landing_free, RANKS_PER_NODE=G, NUM_NODES=nodes,
                    CHANNELS=CHANNELS, GPU=GPU_KERNELS), heap.transport, num_warps=PUT_WARPS)
        placeholder = recv_src
        k = max(packing.num_topk, 1)
        launch(dispatch_kernel.node_receive_kernel, G * nodes * CHANNELS,
               (heap.node_peer_ptrs, *self._args(), landing, cap, packing.row_words, plan.landing_rows, prefix,
                packing.x_words, packing.scale_words, packing.idx_word, packing.weights_word, packing.src_word,
                packing.pos_word, as_words(recv_x), as_words(recv_scales) if recv_scales is not None else placeholder,
                recv_idx if recv_idx is not None else placeholder,
                recv_weights if recv_weights is not None else placeholder, recv_src, num_out_rows, plan.kept_pos,
                plan.kept_pos.shape[1], max(num_experts // R, 1), self.dispatch_epoch, self.status.tensor,
                self.timeout_ns),
               dict(TAIL=layout.landing_tail, FREE=layout.landing_free, DONE=layout.done_counters, RANKS_PER_NODE=G,
                    NUM_NODES=nodes, NUM_RANKS=R, CHANNELS=CHANNELS, HAS_SCALES=recv_scales is not None,
                    HAS_TOPK=recv_idx is not None, NUM_TOPK=k, TOPK_PAD=triton.next_power_of_2(k),
                    NODE_PAD=triton.next_power_of_2(G), ROWS=ROWS, BLOCK=NODE_BLOCK, GPU=GPU_KERNELS), heap.transport,
               num_warps=RECEIVE_WARPS)

    # ------------------------------------------------------------------ combine
    def combine(self, request: CombineRequest) -> CombineResult:
        self.check_status()
        # The in-node stage sums ranks' weights before the token's rank sees them: V2's own-slot
        # rule is applied to them here.
        x, handle, weights, bias = request.x, request.handle, request.weights_to_sum(), request.bias
        plan: NodePlan = handle.backend_state
        hidden, num_tokens = x.shape[1], handle.is_token_in_rank.shape[0]
        if hidden % 2:
            raise InputError(f"the internode backend moves combine rows in 4-byte words; hidden must be even, got "
                             f"{hidden}")
        k = weights.shape[1] if weights is not None else 0
        cap, staging_x, staging_weights, partial_send, partial_landing = self.layout.combine(hidden, k)
        if plan.worst > cap:
            raise InputError(f"combine: a rank sends {plan.worst} tokens to one node but the internode buffer holds "
                             f"{cap} combine rows of hidden {hidden}; make the Buffer with more num_rdma_bytes")
        layout, heap, G, nodes, R = self.layout, self.heap, self.per_node, self.num_nodes, self.num_ranks
        out = torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device=self.device)
        out_weights = torch.empty(num_tokens, k, dtype=torch.float32, device=self.device) if weights is not None \
            else None
        released = self.combine_epoch
        self.combine_epoch += 1
        epoch = self.combine_epoch
        rows = x[: handle.num_recv_rows]
        programs = max(1, min(request.config.num_sms, 64))
        pad = weights_pad(k)
        common = dict(RANKS_PER_NODE=G, GPU=GPU_KERNELS)
        # Only the node's pointers: no transport operation, so no NVSHMEM module (see ``launch``).
        combine_kernel.stage_kernel[(programs,)](
            as_words(rows), weights if weights is not None else out, rows.shape[0], hidden // 2,
            heap.node_peer_ptrs, heap.base, self.rank, staging_x, staging_weights, epoch, released,
            self.status.tensor, self.timeout_ns,
            STAGED=layout.staged, STAGING_FREE=layout.staging_free, DONE=layout.done_counters + 8,
            NUM_TOPK=max(k, 1), WEIGHTS_PAD=pad, HAS_WEIGHTS=weights is not None, ROWS=ROWS, BLOCK=1024, **common,
            num_warps=RECEIVE_WARPS)
        launch(combine_kernel.node_reduce_kernel, min(programs, nodes * CHANNELS),
               (heap.node_peer_ptrs, *self._args(), handle.rank_prefix_matrix, plan.landing_rows, plan.kept_pos,
                plan.kept_pos.shape[1], hidden, staging_x, staging_weights, partial_send, partial_landing, cap, epoch,
                released, self.status.tensor, self.timeout_ns),
               dict(STAGED=layout.staged, STAGING_FREE=layout.staging_free, TAIL=layout.partial_tail,
                    FREE=layout.partial_free, DONE=layout.done_counters + 16, NUM_NODES=nodes, NUM_RANKS=R,
                    CHANNELS=CHANNELS, WEIGHTS_PAD=pad, HAS_WEIGHTS=weights is not None,
                    NODE_PAD=triton.next_power_of_2(G), ROWS=ROWS, BLOCK=NODE_BLOCK, **common), heap.transport,
               num_warps=PUT_WARPS)
        launch(combine_kernel.final_reduce_kernel, programs,
               (*self._args(), plan.node_pos, num_tokens, hidden, partial_landing, cap,
                bias[0] if bias[0] is not None else out, bias[1] if bias[1] is not None else out, out,
                out_weights if out_weights is not None else out, epoch, self.status.tensor, self.timeout_ns),
               dict(TAIL=layout.partial_tail, FREE=layout.partial_free, DONE=layout.done_counters + 24,
                    NUM_NODES=nodes, CHANNELS=CHANNELS, NUM_TOPK=max(k, 1), WEIGHTS_PAD=pad,
                    HAS_WEIGHTS=weights is not None, HAS_BIAS0=bias[0] is not None, HAS_BIAS1=bias[1] is not None,
                    NODES_PAD=triton.next_power_of_2(nodes), TOKENS=4, BLOCK=NODE_BLOCK, **common), heap.transport,
               num_warps=RECEIVE_WARPS)
        return CombineResult(out, out_weights)
