"""Repeat one normal-mode case many times on the GPUs, under kernel-shape variants, and count
the rounds whose results differ from the CPU backend: for races that show once in hundreds.

    PYTHONPATH=.:tests python scripts/dispatch_stress.py [--rounds 25] [--variants defaults rows=8]

One rank per GPU, or ``TRITONEP_GPU_RANKS`` ranks sharing the GPUs (at least 2 on a one-GPU
machine); on a machine without GPUs, two CPU ranks (with ``TRITON_INTERPRET=1``: the kernels in
Triton's interpreter, slowly).

A variant is ``defaults`` or ``field=value[,field=value]`` of the NVLink backend's ``Tuning``.
"""

from __future__ import annotations

import argparse
import random

import torch
import torch.distributed as dist
from nvlink_cases import Case, _buffers, compare_case

from tritonep.backends.nvlink.tuning import with_changes
from tritonep.rank_pool import RankPool, gpu_ranks


def run_rank(group: dist.ProcessGroup, args: argparse.Namespace) -> dict:
    nvlink, _ = _buffers(group, 1 << 30)
    default = nvlink.backend.tuning
    failures: dict[str, list] = {}
    for variant in args.variants:
        nvlink.backend.tuning = with_changes(default, variant)
        rng = random.Random(1)
        failures[variant] = []
        for round_ in range(args.rounds):
            case = Case(seed=10098 + round_, tokens=tuple(rng.choice([1, 300, 1500]) for _ in range(group.size())),
                        hidden=rng.choice([2048, 7168]), num_experts=16 * group.size() // 2, num_topk=4,
                        fp8=rng.random() < 0.7, num_sms=rng.choice([8, 24]))
            mismatches = compare_case(group, case, 1 << 30)
            if mismatches:
                failures[variant].append((str(case), mismatches))
        nvlink.backend.tuning = default
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--variants", nargs="*", default=["defaults"])
    args = parser.parse_args()
    gpus = torch.cuda.device_count()   # without GPUs: 2 CPU ranks (run under TRITON_INTERPRET=1)
    ranks = max(gpu_ranks(), 2) if gpus else 2
    with RankPool(ranks, use_gpu=gpus > 0, timeout=900) as pool:
        reports = pool.run(run_rank, args)
    for variant in args.variants:
        bad = [report[variant] for report in reports]
        print(f"{variant:<30} rounds {args.rounds}, failing rounds per rank: {[len(b) for b in bad]}")
        for rank, items in enumerate(bad):
            for case, mismatches in items[:3]:
                print(f"   rank {rank}: {case}: {mismatches}")


if __name__ == "__main__":
    main()
