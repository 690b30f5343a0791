"""What a bench run prints and draws: the normal-mode table, the low-latency table, and the PNG
of the num_sms curves (tritonep and DeepEP) with the all_to_all_single path and the link ceiling."""

from __future__ import annotations

FP8_BYTES = (1 + 4 / 128) / 2   # fp8 rows with their scales, against the bf16 rows of "NVL GB/s"
PATHS = (("tritonep", "tritonep"), ("DeepEP V1", "deepep"), ("all_to_all_single path", "all_to_all_path"))


def gbps(num_bytes: float, us: float) -> float:
    return num_bytes / us / 1e3 if us > 0 else float("nan")


def ceiling_nvl_gbps(report: dict) -> float | None:
    """The link ceiling in the table's metric: a call that moves this rank's remote bytes at the
    ceiling's rate takes remote_bytes / rate; received bytes (own rows included) over that time."""
    best = report.get("link_ceiling", {}).get("best_gbps")
    if best is None or "tritonep" not in report or not report.get("remote_bytes"):
        return None
    return best * report["tritonep"]["recv_bytes"] / report["remote_bytes"]


def _normal_rows(report: dict) -> list[tuple[str, float, float | None]]:
    rows = []
    for name, key in PATHS:
        m = report.get(key, {})
        if "recv_bytes" not in m:
            continue
        rows += [(f"{name}: layout", m["layout_us"], None),
                 (f"{name}: dispatch (with counts)", m["dispatch_us"], m["recv_bytes"]),
                 (f"{name}: cached dispatch bf16", m["cached_dispatch_us"], m["recv_bytes"])]
        if "fresh_minus_cached_dispatch_us" in m:
            rows.append((f"{name}: fresh - cached, pairs", m["fresh_minus_cached_dispatch_us"], None))
        rows.append((f"{name}: combine", m["combine_us"], m["recv_bytes"]))
        if "combine_sm_only_us" in m:
            rows.append((f"{name}: combine, SMs push (no copy engine)", m["combine_sm_only_us"], m["recv_bytes"]))
        if "cached_dispatch_pipelined_us" in m:
            rows += [(f"{name}: layout, back to back", m["layout_pipelined_us"], None),
                     (f"{name}: cached dispatch, back to back", m["cached_dispatch_pipelined_us"], m["recv_bytes"]),
                     (f"{name}: combine, back to back", m["combine_pipelined_us"], m["recv_bytes"])]
        if "cached_dispatch_fp8_us" in m:
            rows.append((f"{name}: cached dispatch fp8", m["cached_dispatch_fp8_us"], m["recv_bytes"] * FP8_BYTES))
    any_path = report.get("tritonep", report["all_to_all_path"])
    rows.append(("bare all_to_all_single (rows only)", report["bare_all_to_all_us"], any_path["recv_bytes"]))
    return rows


def _print_ceiling(report: dict) -> None:
    ceiling = report.get("link_ceiling", {})
    if "best_gbps" not in ceiling:
        if ceiling:
            print(f"link ceiling: not measured ({ceiling.get('skipped') or 'failed: ' + str(ceiling.get('failed'))})")
        return
    ways = ", ".join(f"{way} {value:.1f}" for way, value in ceiling["gbps"].items())
    print(f"{'link ceiling, all peers at once (best)':<48}{'':>12}{ceiling['best_gbps']:>10.1f}  "
          f"GB/s out per GPU; {ways}")
    nvl = ceiling_nvl_gbps(report)
    if nvl is not None:
        floor_us = report["remote_bytes"] / 1e3 / ceiling["best_gbps"]
        print(f"{'  the same in NVL GB/s':<48}{floor_us:>12.1f}{nvl:>10.1f}")
    print(f"(remote bytes per rank: {report['remote_bytes'] / 1e6:.1f} MB; NVL GB/s counts own rows too, so a call "
          f"that moves only its remote bytes at the ceiling's rate reaches the second figure)")


def print_normal(report: dict) -> None:
    print(f"\n{report['ranks']} ranks on {report['device']}, {report['tokens']} tokens/rank, "
          f"hidden {report['hidden']}, top-{report['topk']} of {report['experts']} experts, "
          f"num_sms={report['num_sms']}")
    print(f"{'path':<48}{'time (us)':>12}{'GB/s':>10}")
    for name, us, num_bytes in _normal_rows(report):
        print(f"{name:<48}{us:>12.1f}{gbps(num_bytes, us) if num_bytes else float('nan'):>10.1f}")
    _print_ceiling(report)
    for name, key in PATHS:
        host = report.get(key, {}).get("host_us")
        if host:
            print(f"{name + ': host per call (CPU)':<48} " + ", ".join(f"{c} {us:.1f} us" for c, us in host.items()))
    for name, key in PATHS[:2]:
        spread = report.get(key, {}).get("round_spread")
        if spread:
            worst = max(spread, key=spread.get)
            verdict = "within 10%" if spread[worst] <= 0.10 else "OVER 10%: not a result yet"
            print(f"({name}: {len(report[key]['rounds'])} rounds, figures are their medians; largest spread "
                  f"{100 * spread[worst]:.1f}% ({worst}), {verdict})")
    deepep = report.get("deepep", {})
    if "missing" in deepep or "error" in deepep:
        print(f"DeepEP V1: {deepep.get('missing') or deepep.get('error')}")
    for who, curve in (("DeepEP ", deepep.get("num_sms_curve", {})), ("", report.get("num_sms_curve", {}))):
        for n, m in curve.items():
            if "recv_bytes" in m:
                print(f"{who}num_sms={n:<4} cached dispatch {gbps(m['recv_bytes'], m['cached_dispatch_us']):7.1f} "
                      f"GB/s  combine {gbps(m['recv_bytes'], m['combine_us']):7.1f} GB/s")
    for name, profiled in report.get("host_profile", {}).items():
        print(f"host profile, {name}: own host us per call under cProfile {profiled['us']:.1f}; largest: "
              + ", ".join(f"{function} {us:.1f}" for function, us in profiled["largest"]))
    for m in report.get("shape_sweep", []):
        fp8 = f"  fp8 {m['cached_dispatch_fp8_us']:6.1f} us" if "cached_dispatch_fp8_us" in m else ""
        spread = m.get("round_spread")
        spread = f"  (rounds spread {100 * max(spread.values()):.1f}%)" if spread else ""
        print(f"{str(m['change']):<55} cached dispatch {gbps(m['recv_bytes'], m['cached_dispatch_us']):7.1f} GB/s  "
              f"combine {gbps(m['recv_bytes'], m['combine_us']):7.1f} GB/s ({m['combine_us']:.1f} us)  back to back: "
              f"{gbps(m['recv_bytes'], m['cached_dispatch_pipelined_us']):7.1f} / "
              f"{gbps(m['recv_bytes'], m['combine_pipelined_us']):7.1f} GB/s{fp8}{spread}")


_INTERNODE_ROWS = (("layout", "layout"), ("dispatch (with counts)", "dispatch"),
                   ("cached dispatch bf16", "cached_dispatch"), ("cached dispatch fp8", "cached_dispatch_fp8"),
                   ("combine", "combine"))


def print_internode(report: dict) -> None:
    """The internode rows: measured time, bytes per rank over the network and over NVLink, and
    the network bytes' time at the NIC rate (the bound a real cluster would set)."""
    if "error" in report:
        print(f"\ninternode: {report['error']}")
        return
    who = f"{report['backend']}" + (f", {report['transport']} transport" if report.get("transport") else "")
    print(f"\ninternode: {report['nodes']} nodes of {report['gpus_per_node']} ranks ({who}); bytes per rank "
          f"(largest rank), projected at {report['nic_gbps']:g} GB/s per GPU")
    print(f"{'path':<48}{'time (us)':>12}{'net MB':>10}{'NVL MB':>10}{'at NIC (us)':>14}")
    for label, key in _INTERNODE_ROWS:
        m = report["calls"][key]
        print(f"{'internode: ' + label:<48}{m['us']:>12.1f}{m['network_bytes'] / 1e6:>10.2f}"
              f"{m['nvlink_bytes'] / 1e6:>10.2f}{m['nic_us']:>14.1f}")
    print(f"(rows per rank: {report['network_rows']:.0f} cross nodes, once per token and node; "
          f"{report['nvlink_rows']:.0f} forwarded inside a node; the combine's network rows are float32 sums)")


# Low-latency rows per call, GPU-only figures first: (label, key suffix).
_LOW_LATENCY_ROWS = (("CUDA graph replay, per call", "graph_us"), ("profiler, device time per call", "profiled_us"),
                     ("one call (host path hidden)", "us"), ("send (hook mode)", "send_us"),
                     ("recv (the hook)", "recv_us"))


def print_low_latency(report: dict) -> None:
    print(f"\nlow latency: {report['ranks']} ranks, {report['tokens']} tokens/rank, hidden {report['hidden']}, "
          f"top-{report['topk']} of {report['experts']} experts, fp8 dispatch, bf16 combine")
    print(f"{'path':<70}{'time (us)':>12}{'GB/s':>10}")
    pair_bytes = report["dispatch_bytes"] + report["combine_bytes"]
    split = report.get("internode_traffic", {}).get("gpus_per_node")
    for backend, name in (("nvlink", "tritonep"), ("internode", f"split into nodes of {split}"),
                          ("deepep", "DeepEP V1"), ("collective", "all_to_all_single path")):
        m = report.get(backend, {})
        if "missing" in m or "error" in m:
            print(f"{name}: {m.get('missing') or m.get('error')}")
        if "pair_us" not in m:
            continue
        for kind in ("dispatch", "combine"):
            if f"{kind}_profiled_error" in m:
                print(f"{name}: {kind}, profiler: {m[f'{kind}_profiled_error']}")
            for label, suffix in _LOW_LATENCY_ROWS[:2]:
                if f"{kind}_{suffix}" in m:
                    us = m[f"{kind}_{suffix}"]
                    print(f"{f'{name}: {kind}, {label}':<70}{us:>12.1f}{gbps(report[f'{kind}_bytes'], us):>10.1f}")
        print(f"{name + ': dispatch + combine, back to back, per pair':<70}{m['pair_us']:>12.1f}"
              f"{gbps(pair_bytes, m['pair_us']):>10.1f}")
        for kind in ("dispatch", "combine"):
            for label, suffix in _LOW_LATENCY_ROWS[2:]:
                us = m[f"{kind}_{suffix}"]
                print(f"{f'{name}: {kind}, {label}':<70}{us:>12.1f}{gbps(report[f'{kind}_bytes'], us):>10.1f}")
        for kind in ("dispatch", "combine"):
            print(f"{f'{name}: {kind}, host CPU per call, GPU idle before':<70}{m[f'{kind}_host_us']:>12.1f}")
            print(f"{f'{name}: {kind}, host CPU per call, back to back':<70}"
                  f"{m[f'{kind}_host_back_to_back_us']:>12.1f}")
    print(f"{'host yardstick: torch add_ per call, back to back':<70}{report['torch_add_host_back_to_back_us']:>12.1f}")
    for variant in report.get("nvlink_shape_sweep", []):
        times = variant.get("error") or (f"dispatch {variant['dispatch_graph_us']:.1f} us, "
                                         f"combine {variant['combine_graph_us']:.1f} us (CUDA graph replay)")
        print(f"tritonep shapes: {variant['change']}: {times}")
    traffic = report.get("internode_traffic")
    if traffic:
        print(f"nodes of {traffic['gpus_per_node']}: rows per rank (largest rank) {traffic['network_rows']:.0f} over "
              f"the network, {traffic['nvlink_rows']:.0f} over NVLink; at {traffic['nic_gbps']:g} GB/s per GPU")
        for kind in ("dispatch", "combine"):
            print(f"{f'  {kind}: network MB / NVLink MB / time at the NIC (us)':<70}"
                  f"{traffic[f'{kind}_network_bytes'] / 1e6:>8.2f} / {traffic[f'{kind}_nvlink_bytes'] / 1e6:.2f} / "
                  f"{traffic[f'{kind}_nic_us']:.1f}")


def plot(report: dict, path: str) -> None:
    """The num_sms curves of the cached dispatch and the combine, with the all_to_all_single
    path and the link ceiling as lines; nothing without a curve (``--sweep``, ``--curve``) or matplotlib."""
    curves = {"tritonep": report.get("num_sms_curve"), "DeepEP V1": report.get("deepep", {}).get("num_sms_curve")}
    if not curves["tritonep"]:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, curve in curves.items():
        if not curve:
            continue
        sms = sorted((n for n in curve if "recv_bytes" in curve[n]), key=int)
        for key, label in (("cached_dispatch_us", "cached dispatch bf16"), ("combine_us", "combine")):
            ax.plot([int(n) for n in sms], [gbps(curve[n]["recv_bytes"], curve[n][key]) for n in sms],
                    "o-" if name == "tritonep" else "s--", label=f"{name}: {label}")
    if "all_to_all_path" in report:
        m = report["all_to_all_path"]
        ax.axhline(gbps(m["recv_bytes"], m["cached_dispatch_us"]), color="tab:red", ls=":",
                   label="all_to_all_single path: cached dispatch")
    nvl = ceiling_nvl_gbps(report)
    if nvl is not None:
        ax.axhline(nvl, color="gray", ls="--", label="link ceiling (all peers at once; SM stores or copy engines)")
    ax.set_xlabel("num_sms (programs per launch)")
    ax.set_ylabel("NVL GB/s (DeepEP metric)")
    ax.set_title(f"{report['ranks']}x {report['device']}, {report['tokens']} tokens/rank")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
