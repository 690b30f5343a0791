"""ElasticBuffer's constructor, attributes and helpers (DeepEP V2's API) on the collective backend.

The rank functions run on a 2-rank pool (one node) and a 4-rank pool split into 2 nodes of 2
(``TRITONEP_GPUS_PER_NODE=2``), where V2's hybrid domains differ from its direct ones.
"""

from __future__ import annotations

import pytest
import torch
from torch_defaults import pool_options

import tritonep as deep_ep
from tritonep.core.topology import GPUS_PER_NODE_VARIABLE
from tritonep.rank_pool import RankFailure, RankPool

MIB2 = 2 << 20


@pytest.fixture(scope="module")
def pool():
    with RankPool(2, timeout=60, **pool_options()) as ranks:
        yield ranks


@pytest.fixture(scope="module")
def split_pool():
    with RankPool(4, timeout=60, env={GPUS_PER_NODE_VARIABLE: "2"}, **pool_options()) as ranks:
        yield ranks


# ----------------------------------------------------------------------------- rank functions
def case_constructor(group) -> dict:
    rank, R = group.rank(), group.size()
    hint = deep_ep.ElasticBuffer.get_buffer_size_hint(group, 64, 256, num_topk=4)
    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=64, hidden=256, num_topk=4)
    assert buffer.num_bytes == hint and hint % MIB2 == 0 and hint >= deep_ep.nvl_bytes_for(64, 256, R, 4)
    # num_topk 0 sizes for V2's largest top-k; fp8 changes nothing here.
    assert deep_ep.ElasticBuffer.get_buffer_size_hint(group, 64, 256) >= hint
    assert deep_ep.ElasticBuffer.get_buffer_size_hint(group, 64, 256, 4, use_fp8_dispatch=True) == hint
    assert buffer.group is group and buffer.rank_idx == rank and buffer.num_ranks == R
    assert buffer.num_max_tokens_per_rank == 64
    assert (buffer.num_scaleout_ranks, buffer.num_scaleup_ranks) == (1, R) == buffer.get_logical_domain_size()
    assert (buffer.num_rdma_ranks, buffer.num_nvlink_ranks) == (1, R) == buffer.get_physical_domain_size()
    assert (buffer.scaleout_rank_idx, buffer.scaleup_rank_idx) == (0, rank)
    assert deep_ep.get_physical_domain_size(group) == (1, R) and deep_ep.get_logical_domain_size(group) == (1, R)
    assert buffer.num_allocated_qps == 129 and buffer.get_theoretical_num_qps(24) == 129
    assert buffer.get_comm_stream() is None and buffer.runtime is not None
    event = deep_ep.ElasticBuffer.capture()
    assert isinstance(event, deep_ep.EventHandle) and isinstance(event, deep_ep.EventOverlap)
    event.current_stream_wait()
    buffer.barrier()
    buffer.barrier(use_comm_stream=False, with_cpu_sync=True, sequential=False)
    assert deep_ep.topk_idx_t == torch.int64

    num_sms = buffer.get_theoretical_num_sms(8, 2)
    assert num_sms % 2 == 0 and 4 <= num_sms <= 132 and buffer.get_theoretical_num_sms(8, 2) == num_sms
    # A faster link needs more programs; a faster program fewer.
    assert buffer.get_theoretical_num_sms(8, 2, nvlink_gbs=900) > num_sms
    assert buffer.get_theoretical_num_sms(8, 2, sm_write_gbs=100, sm_read_gbs=100) < num_sms
    for name in ("engram_write", "pp_send", "all_gather", "agrs_set_config"):
        with pytest.raises(NotImplementedError, match="not built"):
            getattr(buffer, name)

    direct = deep_ep.ElasticBuffer(group, num_bytes=MIB2, num_max_tokens_per_rank=8, allow_hybrid_mode=False,
                                   prefer_overlap_with_compute=False, num_allocated_qps=12, sl_idx=1,
                                   num_cpu_timeout_secs=5, num_gpu_timeout_secs=5, deterministic=True)
    assert direct.num_bytes == MIB2 and direct.num_allocated_qps == 12
    assert direct.get_theoretical_num_qps(24) == 9 and direct.get_theoretical_num_qps(4) == 4
    assert direct.get_theoretical_num_sms(8, 2) == 64   # not overlapping with compute: at least 64
    assert deep_ep.ElasticBuffer(group, num_bytes=2 * MIB2, allow_hybrid_mode=False).num_allocated_qps == 17
    # V2's CPU (Engram) bytes are accepted; the engines stage rows in the rest.
    assert deep_ep.ElasticBuffer(group, num_bytes=2 * MIB2, num_cpu_bytes=MIB2).num_cpu_bytes == MIB2

    lasting = deep_ep.ElasticBuffer(group, num_bytes=MIB2, explicitly_destroy=True)
    lasting.destroy()
    assert lasting.runtime is None
    with pytest.raises(deep_ep.InputError, match="destroyed"):
        lasting.dispatch(torch.zeros(1, 128, dtype=torch.bfloat16), topk_idx=torch.zeros(1, 1, dtype=torch.int64),
                         num_experts=R)
    with pytest.raises(deep_ep.InputError, match="explicitly_destroy=True"):
        buffer.destroy()
    return num_sms


def case_split(group) -> dict:
    """2 nodes of 2: V2's hybrid logical domain is the physical one; without hybrid mode one
    scale-out rank of 4. Dispatch on the hybrid buffer groups its per-source prefix by scale-up index."""
    rank, R = group.rank(), group.size()
    hybrid = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=4, hidden=128, num_topk=2)
    direct = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=4, hidden=128, num_topk=2, allow_hybrid_mode=False)
    assert hybrid.get_physical_domain_size() == (2, 2) == direct.get_physical_domain_size()
    assert hybrid.get_logical_domain_size() == (2, 2) and direct.get_logical_domain_size() == (1, 4)
    assert (hybrid.scaleout_rank_idx, hybrid.scaleup_rank_idx) == (rank // 2, rank % 2)
    assert (direct.scaleout_rank_idx, direct.scaleup_rank_idx) == (0, rank)
    assert deep_ep.get_logical_domain_size(group, allow_hybrid_mode=False) == (1, 4)
    # Every rank sends its 4 tokens to expert 2r' of each rank r' (one token per rank).
    topk = torch.tensor([[2 * r, -1] for r in range(R)], dtype=torch.int64)
    x = torch.full((R, 128), float(rank), dtype=torch.bfloat16)
    _, _, _, h_hybrid, _ = hybrid.dispatch(x, topk_idx=topk, num_experts=2 * R)
    _, _, _, h_direct, _ = direct.dispatch(x, topk_idx=topk, num_experts=2 * R)
    assert h_direct.psum_num_recv_tokens_per_scaleup_rank.tolist() == [1, 2, 3, 4]
    assert h_hybrid.psum_num_recv_tokens_per_scaleup_rank.tolist() == [2, 4]   # sources 0, 2 then 1, 3
    return True


def case_disagree(group) -> None:
    """Ranks given different sizes raise on every rank (no hang, no corrupt layout)."""
    deep_ep.ElasticBuffer(group, num_bytes=MIB2 * (1 + group.rank()))


# ----------------------------------------------------------------------------- the tests
def test_constructor_attributes_and_helpers(pool):
    num_sms = pool.run(case_constructor)
    assert len(set(num_sms)) == 1


def test_node_split_domains(split_pool):
    assert split_pool.run(case_split) == [True] * 4


def test_ranks_that_disagree_all_raise(pool):
    with pytest.raises(RankFailure) as failure:
        pool.run(case_disagree)
    message = str(failure.value)
    assert message.count("InputError") >= 2 and "num_bytes" in message
