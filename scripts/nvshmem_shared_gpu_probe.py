"""Probe: can torch's NVSHMEM symmetric-memory backend run with several ranks (PEs) on one GPU?

Issue 12 simulates nodes inside one host; on a machine with one GPU that needs NVSHMEM's
"multiple processes per GPU" mode. This starts R ranks (gloo group, all on GPU 0), switches
torch symmetric memory to NVSHMEM, allocates, rendezvous, and runs one Triton kernel with
``putmem_signal_block`` to the next rank and ``signal_wait_until`` from the previous one.
Prints each step's outcome per rank; exits 0 only if every rank saw its neighbour's data.

    PYTHONPATH=. python scripts/nvshmem_shared_gpu_probe.py [--ranks 2]
"""

from __future__ import annotations

import argparse
import os
import traceback

import torch
import torch.distributed as dist

from tritonep.rank_pool import RankPool


def probe(group: dist.ProcessGroup) -> str:
    import torch.distributed._symmetric_memory as symm_mem
    import triton

    rank, world = group.rank(), group.size()
    steps = []
    try:
        steps.append(f"nvshmem available={symm_mem.is_nvshmem_available()}")
        symm_mem.set_backend("NVSHMEM")
        import torch.distributed._symmetric_memory._nvshmem_triton as nvshmem
        from torch.distributed._symmetric_memory._nvshmem_triton import requires_nvshmem

        @requires_nvshmem
        @triton.jit
        def put_then_wait(dst, src, nbytes, sig, peer, expected):
            nvshmem.putmem_signal_block(dst, src, nbytes, sig, expected, 0, peer)   # NVSHMEM_SIGNAL_SET
            nvshmem.signal_wait_until(sig, 0, expected)                             # NVSHMEM_CMP_EQ

        device = torch.device("cuda", torch.cuda.current_device())
        n = 1 << 16
        src = symm_mem.empty(n, dtype=torch.bfloat16, device=device).fill_(rank + 1)
        dst = symm_mem.empty(n, dtype=torch.bfloat16, device=device).fill_(-1)
        sig = symm_mem.empty(1, dtype=torch.int64, device=device).fill_(0)
        for tensor in (src, dst, sig):
            symm_mem.rendezvous(tensor, group.group_name)
        steps.append(f"rendezvous ok, backend={symm_mem.get_backend(device)}")
        dist.barrier(group)
        torch.cuda.synchronize()
        put_then_wait[(1,)](dst, src, n * 2, sig, (rank + 1) % world, 7)
        torch.cuda.synchronize()
        previous = (rank - 1) % world + 1
        ok = bool((dst == previous).all().item())
        steps.append(f"put/signal/wait done, data from rank {previous - 1} correct={ok}")
        dist.barrier(group)
    except Exception as error:   # a probe reports, it does not stop
        steps.append(f"FAILED: {type(error).__name__}: {error}\n{traceback.format_exc()[-1500:]}")
    return f"rank {rank}: " + " | ".join(steps)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    env = {"NVSHMEM_DISABLE_NVLS": "1", "TRITONEP_GPU_RANKS": str(args.ranks)}
    with RankPool(args.ranks, use_gpu=True, timeout=120, env=env) as pool:
        reports = pool.run(probe)
    print("\n".join(reports))
    raise SystemExit(0 if all("correct=True" in report for report in reports) else 1)


if __name__ == "__main__":
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    main()
