"""Does a Buffer give its GPU memory back? Build and drop Buffers in cycles and read the
device's used memory (``torch.cuda.mem_get_info``, every process on the GPU) after each cycle,
with every rank at the same point (barriers around the reading).

Ways of dropping a Buffer, each in its own cycles:
  destroy:          explicitly_destroy=True, ``destroy()``, del;
  destroy+collect:  the same, then a barrier, ``torch.cuda.ipc_collect()`` and ``empty_cache()``
                    (what tests/low_latency_cases.release_buffers does);
  drop:             explicitly_destroy=False, del, ``gc.collect()``.
Also, with one Buffer alive, what nvidia-smi attributes to each process (does mapping a peer's
memory count twice?).

Ranks: one per GPU, or ``--ranks R`` sharing the GPUs (CUDA IPC instead of symmetric memory).

    PYTHONPATH=. python scripts/buffer_memory_probe.py --ranks 4 [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess

import torch
import torch.distributed as dist

import tritonep as deep_ep
from tritonep.rank_pool import RankPool

GIB = 1 << 30


def _used_gib(group: dist.ProcessGroup) -> float:
    torch.cuda.synchronize()
    dist.barrier(group=group)
    free, total = torch.cuda.mem_get_info()
    dist.barrier(group=group)   # nobody allocates before every rank has read
    return round((total - free) / GIB, 3)


def _smi() -> str:
    return subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout


def run(group: dist.ProcessGroup, cycles: int, nvl_gib: float, rdma_gib: float) -> dict:
    report: dict = {"rank": group.rank(), "start": _used_gib(group)}
    nvl, rdma = int(nvl_gib * GIB), int(rdma_gib * GIB)
    for way in ("destroy", "destroy+collect", "drop"):
        readings = []
        for cycle in range(cycles):
            buffer = deep_ep.Buffer(group, nvl, rdma, low_latency_mode=rdma > 0,
                                    explicitly_destroy=way != "drop")
            if way == "destroy" and cycle == 0:
                report["alive"] = _used_gib(group)
                report["smi_alive"] = _smi() if group.rank() == 0 else ""
            if way != "drop":
                buffer.destroy()
            del buffer
            gc.collect()
            if way == "destroy+collect":
                torch.cuda.synchronize()
                dist.barrier(group=group)
                torch.cuda.ipc_collect()
                torch.cuda.empty_cache()
            readings.append(_used_gib(group))
        report[way] = readings
        report[way + " reserved"] = round(torch.cuda.memory_reserved() / GIB, 3)
    torch.cuda.ipc_collect()
    torch.cuda.empty_cache()
    report["end"] = _used_gib(group)
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=torch.cuda.device_count())
    parser.add_argument("--cycles", type=int, default=4)
    parser.add_argument("--nvl-gib", type=float, default=1.0)
    parser.add_argument("--rdma-gib", type=float, default=0.5)
    parser.add_argument("--json")
    args = parser.parse_args()
    pool = RankPool(args.ranks, use_gpu=True, timeout=300)
    try:
        reports = pool.run(run, args.cycles, args.nvl_gib, args.rdma_gib)
    finally:
        pool.close()
    first = reports[0]
    print(f"ranks {args.ranks}, {args.nvl_gib} GiB NVLink + {args.rdma_gib} GiB low-latency per Buffer; "
          f"device GiB used (all processes): start {first['start']}, one Buffer alive {first['alive']}, "
          f"end {first['end']}")
    for way in ("destroy", "destroy+collect", "drop"):
        print(f"  {way:<16} after each cycle {first[way]}; rank reserved (caching allocator) "
              f"{[r[way + ' reserved'] for r in reports]}")
    print("  nvidia-smi with one Buffer alive:", first["smi_alive"].strip().replace("\n", "; "))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=1)


if __name__ == "__main__":
    main()
