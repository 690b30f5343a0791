"""Benchmark: tritonep's dispatch and combine against what users would do without it.

    python -m benchmarks [--ranks R] [--tokens N] [--hidden H] [--experts E] [--topk K]
                         [--num-sms 24] [--iters 50] [--rounds 2] [--out DIR] [--sweep | --curve] [--vs-deepep]
                         [--ll-tokens T] [--ll-experts E] [--skip-normal] [--skip-low-latency]
                         [--gpus-per-node N [--nic-gbps 50] [--internode-only]]
                         [--cpu | --gpu] [--profile | --baseline DIR | --api v2]

Modes, one per run:

* the benchmark (default), on GPUs one rank per GPU (NCCL), on the same routing:
  - normal mode (``normal.py``): tritonep's NVLink backend at ``--num-sms`` programs, the
    all_to_all_single path (tritonep's collective backend on NCCL, and the bare
    ``all_to_all_single`` of already-permuted rows), DeepEP V1 with ``--vs-deepep`` when
    ``import deep_ep`` gives DeepEP itself; the link ceiling (``ceiling.py``); with ``--sweep``
    a num_sms curve (DeepEP's too) and kernel shapes, with ``--curve`` the curve alone;
  - low-latency mode (``low_latency.py``), DeepEP's decode problem, the same paths (with
    ``--sweep`` also the NVLink kernels under other launch shapes);
  - with ``--gpus-per-node N``, the normal-mode rows on the group split into nodes of N ranks
    (``internode.py``) and its low-latency rows (``low_latency.traffic``): time, network and
    NVLink bytes per rank, the network bytes' time at ``--nic-gbps``;
  it prints both tables and writes ``bench.json`` (and ``bench.png`` with a curve) to ``--out``;
* ``--profile``: where each normal-mode call's GPU time goes (``kernel_profile.py``), per rank (with
  ``--gpus-per-node N``: the internode backend's calls);
  writes ``profile.json``;
* ``--baseline DIR`` (at ``--ranks 1``): the package at DIR against this checkout, one rank, both
  in one process taking turns (``ab.py``); writes ``ab.json``.
* ``--api v2``: DeepEP V2's calls (``ElasticBuffer``) beside V1's (``Buffer``) on the same backend
  and inputs, GPU and host time per call and V2's extra host time (``v2.py``); writes ``bench_v2.json``;
  with ``--host-profile`` also the functions whose own host time differs most between the two
  APIs, under cProfile (``host_profile.py``); without ``--api v2``, ``--host-profile`` lists where
  each host row's time goes (the cached dispatch with either receive).

Bandwidth is DeepEP's "NVL GB/s": received bf16 bytes (rows from the rank itself included) over
the time of one call (fp8: bytes scaled by (1 + 4/128) / 2). ``timing.py`` says how calls are
timed; every figure is the slowest rank's. Without GPUs (or with ``--cpu``) every mode runs on
gloo CPU ranks at a small size, with the CPU backend, so the command works everywhere.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from . import ab, internode, kernel_profile, low_latency, normal, report, v2
from .internals import RankPool


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, help="ranks (default: one per GPU; 4 CPU ranks; 1 for --baseline)")
    parser.add_argument("--tokens", type=int, help="tokens per rank (default 4096 on GPUs, 256 on CPUs)")
    parser.add_argument("--hidden", type=int, help="default 7168 on GPUs, 512 on CPUs")
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--num-sms", type=int, default=24)
    parser.add_argument("--iters", type=int, default=50, help="timed calls per figure")
    parser.add_argument("--rounds", type=int, default=2,
                        help="rounds of the main figures on GPUs (tritonep and DeepEP in turn; for --baseline, "
                             "the two packages in turn): medians and spread")
    parser.add_argument("--sweep", action="store_true", help=f"num_sms curve {normal.SWEEP_SMS} and kernel shapes")
    parser.add_argument("--curve", action="store_true", help="the num_sms curve alone (no kernel shapes)")
    parser.add_argument("--vs-deepep", action="store_true",
                        help="also DeepEP V1 (import deep_ep) on the same inputs, when it imports")
    parser.add_argument("--ll-tokens", type=int, help="low-latency tokens per rank (default 128 on GPUs, 16 on CPUs)")
    parser.add_argument("--ll-experts", type=int, help="low-latency experts (default 288 on GPUs, 16 on CPUs)")
    parser.add_argument("--skip-normal", action="store_true", help="only the low-latency part")
    parser.add_argument("--skip-low-latency", action="store_true", help="only the normal-mode part")
    parser.add_argument("--gpus-per-node", type=int, default=0,
                        help="also the internode rows: the group split into nodes of N ranks (internode.py)")
    parser.add_argument("--internode-only", action="store_true",
                        help="with --gpus-per-node: only the internode normal-mode rows (no one-node rows)")
    parser.add_argument("--nic-gbps", type=float, default=50.0,
                        help="NIC rate per GPU, GB/s each way, for the internode rows' projected times")
    parser.add_argument("--cpu", action="store_true", help="CPU ranks even when GPUs exist")
    parser.add_argument("--gpu", action="store_true",
                        help="GPU ranks on a machine with one GPU, where the benchmark's default is CPU ranks")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--profile", action="store_true", help="normal-mode kernel and copy times (torch.profiler)")
    mode.add_argument("--baseline", metavar="DIR", help="one-rank A/B: the tritonep package at DIR against this one")
    mode.add_argument("--api", choices=("v1", "v2"), default="v1",
                      help="v2: DeepEP V2's ElasticBuffer calls beside V1's Buffer calls (v1: the benchmark above)")
    parser.add_argument("--host-profile", action="store_true",
                        help="each host row's calls under cProfile (rank 0's): with --api v2 the functions whose "
                             "own host time differs most between V1 and V2, else those with the most")
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args(argv)
    gpus = 0 if args.cpu else torch.cuda.device_count()
    # The benchmark compares ranks over NVLink, so one GPU gives CPU ranks unless --gpu; the
    # profile and the A/B are about one GPU's kernels and host path, and use it.
    args.use_gpu = gpus >= 2 or (gpus == 1 and (args.gpu or args.profile or args.baseline is not None))
    if args.ranks is None:
        args.ranks = 1 if args.baseline is not None else gpus if args.use_gpu else 4
    if args.use_gpu:
        args.ranks = min(args.ranks, gpus)
    if args.gpus_per_node and (args.ranks % args.gpus_per_node or args.ranks // args.gpus_per_node < 2):
        parser.error(f"--gpus-per-node {args.gpus_per_node} must split the {args.ranks} ranks into 2+ whole nodes")
    if args.internode_only and (not args.gpus_per_node or args.skip_normal):
        parser.error("--internode-only needs --gpus-per-node, and the normal mode (no --skip-normal)")
    if args.baseline is not None and args.ranks != 1:
        parser.error("--baseline runs at one rank: --ranks 1")
    for name, on_gpus, on_cpus in (("tokens", 4096, 256), ("hidden", 7168, 512), ("ll_tokens", 128, 16),
                                   ("ll_experts", 288, 16)):
        if getattr(args, name) is None:
            setattr(args, name, on_gpus if args.use_gpu else on_cpus)
    return args


def _write(args: argparse.Namespace, name: str, result: object) -> None:
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, name)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.baseline is not None:
        result = ab.run(args, args.use_gpu)
        ab.print_table(result)
        _write(args, "ab.json", result)
        return
    if args.internode_only:
        result: dict = {}
        _internode(args, result)
        return
    with RankPool(args.ranks, use_gpu=args.use_gpu, timeout=1200) as pool:
        if args.profile:
            reports = pool.run(kernel_profile.run_rank, args)
            kernel_profile.print_reports(reports)
            _write(args, "profile.json", reports)
            return
        if args.api == "v2":
            result = pool.run(v2.run_rank, args)[0]
            v2.print_report(result)
            _write(args, "bench_v2.json", result)
            return
        result = {} if args.skip_normal else pool.run(normal.run_rank, args)[0]
        if not args.skip_low_latency:
            backends = ["nvlink", "collective"] if args.use_gpu else ["collective"]
            backends += ["internode"] if args.gpus_per_node else []
            result["low_latency"] = pool.run(low_latency.run_rank, args, backends)[0]
        _report(args, result)
    if args.gpus_per_node and not args.skip_normal:
        _internode(args, result)


def _internode(args: argparse.Namespace, result: dict) -> None:
    """The internode rows into ``result``, printed and saved. Last, and guarded: the one-node
    figures are printed and saved whatever happens here. In ranks of their own: torch picks a
    process's symmetric-memory backend (NVSHMEM here, its CUDA backend for the one-node rows)
    once, at the first allocation."""
    try:
        with RankPool(args.ranks, use_gpu=args.use_gpu, timeout=1200) as pool:
            result["internode"] = pool.run(internode.run_rank, args)[0]
    except Exception as error:  # noqa: BLE001 - a failed transport is a row of the report
        result["internode"] = {"error": f"{type(error).__name__}: {error}"}
    report.print_internode(result["internode"])
    _write(args, "bench.json", result)


def _report(args: argparse.Namespace, result: dict) -> None:
    """Print the one-node tables, save the JSON and the plot."""
    if not args.skip_normal:
        report.print_normal(result)
    if "low_latency" in result:
        report.print_low_latency(result["low_latency"])
    _write(args, "bench.json", result)
    report.plot(result, os.path.join(args.out, "bench.png"))


if __name__ == "__main__":
    main()
