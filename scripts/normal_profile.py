"""Where a normal-mode call's GPU time goes: torch.profiler over cached dispatches and combines.

    python scripts/normal_profile.py [--tokens 4096] [--hidden 7168] [--num-sms 24] [--json PATH]
                                     [--combine-variants "tokens=8 tokens=16,combine_block=1024"]

One rank per GPU, DeepEP's benchmark shape. For each call kind (layout; fresh dispatch, with
the GPU's idle time between the count exchange and the dispatch kernel; cached dispatch;
combine with the copy engines; combine with SMs only) it runs 20 calls under the profiler and prints, per
rank, the mean device time of each kernel and copy it launched (copy-engine copies show up as
"Memcpy PtoP" / "Memcpy DtoD"), plus the mean wall time per call. ``--combine-variants``
then times the combine (bench timing: L2 flushed, median, slowest rank) under each listed
change of the backend's ``Tuning``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections import defaultdict

import torch
import torch.distributed as dist

import tritonep
from tritonep.backends.nvlink.tuning import with_changes
from tritonep.bench import _median_us
from tritonep.rank_pool import RankPool

CALLS = 20


def _profile(fn, gaps: tuple[str, str] | None = None) -> dict:
    """Mean device time per call of each kernel and copy; with ``gaps=(a, b)`` also the mean
    idle time on the GPU between the end of kernel ``a`` and the start of the next ``b`` (the
    host's share of a fresh dispatch: count read-back, allocation, launch)."""
    fn()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(CALLS):
            fn()
        end.record()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name[:60]] += event.device_time_total
    per_call = {name: round(us / CALLS, 1) for name, us in sorted(totals.items(), key=lambda kv: -kv[1])}
    result = {"wall_us_per_call": round(start.elapsed_time(end) * 1e3 / CALLS, 1), "device_us_per_call": per_call}
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    # The last call's kernels and copies: start (from the first one's) and duration, in us.
    last = kernels[len(kernels) - len(kernels) // CALLS:]
    result["last_call"] = [(name[:40], round(begin - last[0][0], 1), round(end - begin, 1))
                           for begin, end, name in last]
    if gaps is not None:
        idle, first_end = [], None
        for begin, finish, name in kernels:
            if name.startswith(gaps[0]):
                first_end = finish
            elif name.startswith(gaps[1]) and first_end is not None:
                idle.append(begin - first_end)
                first_end = None
        result[f"idle_us_{gaps[0]}_to_{gaps[1]}"] = round(sum(idle) / max(len(idle), 1), 1)
    return result


def run_rank(group: dist.ProcessGroup, args: argparse.Namespace) -> dict:
    rank = group.rank()
    torch.manual_seed(7 + rank)
    x = torch.randn(args.tokens, args.hidden, device="cuda").to(torch.bfloat16)
    scores = torch.randn(args.tokens, args.experts, device="cuda").abs() + 1
    topk_idx = scores.topk(args.topk, dim=-1).indices
    topk_weights = torch.rand(args.tokens, args.topk, device="cuda")
    nvl_bytes = 2 * (args.tokens * group.size() * (args.hidden * 2 + 256)) + (64 << 20)
    buffer = tritonep.Buffer(group, num_nvl_bytes=nvl_bytes, explicitly_destroy=True)
    config = tritonep.Config(args.num_sms)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, args.experts)
    recv_x, _, recv_weights, _, handle, _ = buffer.dispatch(
        x, topk_idx=topk_idx, topk_weights=topk_weights, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, config=config)
    report = {"rank": rank, "recv_rows": recv_x.shape[0]}
    report["layout"] = _profile(lambda: buffer.get_dispatch_layout(topk_idx, args.experts))
    report["fresh_dispatch"] = _profile(lambda: buffer.dispatch(
        x, topk_idx=topk_idx, topk_weights=topk_weights, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, config=config), gaps=("notify_dispatch", "dispatch_kernel"))
    report["cached_dispatch"] = _profile(lambda: buffer.dispatch(x, handle=handle, config=config))
    report["combine_copy_engine"] = _profile(
        lambda: buffer.combine(recv_x, handle, topk_weights=recv_weights, config=config))
    default = buffer.backend.tuning
    buffer.backend.tuning = dataclasses.replace(default, copy_engine_combine=False)
    report["combine_sm_only"] = _profile(
        lambda: buffer.combine(recv_x, handle, topk_weights=recv_weights, config=config))
    buffer.backend.tuning = default
    report["combine_variants"] = {}
    for variant in args.combine_variants:
        buffer.backend.tuning = with_changes(default, variant)
        report["combine_variants"][variant] = round(_median_us(
            group, lambda: buffer.combine(recv_x, handle, topk_weights=recv_weights, config=config), 30), 1)
    buffer.backend.tuning = default
    buffer.destroy()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--num-sms", type=int, default=24)
    parser.add_argument("--combine-variants", nargs="*", default=[],
                        help="Tuning changes, each 'field=value[,field=value]'; 'defaults' for none")
    parser.add_argument("--json")
    args = parser.parse_args()
    with RankPool(torch.cuda.device_count(), use_gpu=True, timeout=600) as pool:
        reports = pool.run(run_rank, args)
    for report in reports:
        print(f"== rank {report['rank']} ({report['recv_rows']} rows received)")
        for kind in ("layout", "fresh_dispatch", "cached_dispatch", "combine_copy_engine", "combine_sm_only"):
            gaps = {key: value for key, value in report[kind].items() if key.startswith("idle_us")}
            print(f"  {kind}: {report[kind]['wall_us_per_call']} us per call {gaps or ''}")
            for name, us in list(report[kind]["device_us_per_call"].items())[:6]:
                print(f"    {us:9.1f} us  {name}")
            print("    last call: " + "; ".join(f"{name} @{begin} +{length}"
                                                for name, begin, length in report[kind]["last_call"]))
    for variant, us in reports[0]["combine_variants"].items():
        print(f"combine {variant:<45} {us:8.1f} us (slowest rank, median)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=1)


if __name__ == "__main__":
    main()
