"""The normal-mode benchmark's report: the table ``python -m tritonep.bench`` prints and its PNG
(the num_sms curve of tritonep and DeepEP, the all_to_all_single path and the link ceiling)."""

from __future__ import annotations


def _ceiling_nvl_gbps(report: dict) -> float | None:
    """The link ceiling in the table's metric: the remote bytes moved at the copy engine's rate
    take remote_bytes / rate; received bytes (own rows included) over that time."""
    if "tritonep" not in report or not report.get("remote_bytes"):
        return None
    return report["copy_engine_ceiling_gbps"] * report["tritonep"]["recv_bytes"] / report["remote_bytes"]


def _gbps(num_bytes: float, us: float) -> float:
    return num_bytes / us / 1e3 if us > 0 else float("nan")


def print_table(report: dict) -> None:
    fp8_factor = (1 + 4 / 128) / 2
    print(f"\n{report['ranks']} ranks on {report['device']}, {report['tokens']} tokens/rank, "
          f"hidden {report['hidden']}, "
          f"top-{report['topk']} of {report['experts']} experts, num_sms={report['num_sms']}")
    print(f"{'path':<40}{'time (us)':>12}{'GB/s':>10}")
    rows = []
    deepep = report.get("deepep", {})
    for name, key in (("tritonep", "tritonep"), ("DeepEP V1", "deepep"), ("all_to_all_single path", "all_to_all_path")):
        if key not in report or "recv_bytes" not in report[key]:
            continue
        m = report[key]
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
            rows.append((f"{name}: cached dispatch fp8", m["cached_dispatch_fp8_us"], m["recv_bytes"] * fp8_factor))
    any_path = report.get("tritonep", report["all_to_all_path"])
    rows.append(("bare all_to_all_single (rows only)", report["bare_all_to_all_us"], any_path["recv_bytes"]))
    for name, us, num_bytes in rows:
        print(f"{name:<40}{us:>12.1f}{_gbps(num_bytes, us) if num_bytes else float('nan'):>10.1f}")
    for name, key in (("tritonep", "tritonep"), ("DeepEP V1", "deepep"), ("all_to_all_single path", "all_to_all_path")):
        host = report.get(key, {}).get("host_us")
        if host:
            calls = ", ".join(f"{call} {us:.1f} us" for call, us in host.items())
            print(f"{name + ': host per call (CPU)':<40} {calls}")
    for name, key in (("tritonep", "tritonep"), ("DeepEP V1", "deepep")):
        spread = report.get(key, {}).get("round_spread")
        if spread:
            worst = max(spread, key=spread.get)
            verdict = "within 10%" if spread[worst] <= 0.10 else "OVER 10%: not a result yet"
            print(f"({name}: {len(report[key]['rounds'])} rounds, figures are their medians; largest spread "
                  f"{100 * spread[worst]:.1f}% ({worst}), {verdict})")
    if "copy_engine_ceiling_gbps" in report:
        print(f"{'link ceiling (copy engine push)':<40}{'':>12}{report['copy_engine_ceiling_gbps']:>10.1f}")
        nvl = _ceiling_nvl_gbps(report)
        if nvl is not None:
            floor_us = report["remote_bytes"] / 1e3 / report["copy_engine_ceiling_gbps"]
            print(f"{'  the same in NVL GB/s':<40}{floor_us:>12.1f}{nvl:>10.1f}")
        print(f"(remote bytes per rank: {report['remote_bytes'] / 1e6:.1f} MB; NVL GB/s counts own rows too, so a "
              f"call that moves only its remote bytes at the link's rate reaches the second figure)")
    if "missing" in deepep or "error" in deepep:
        print(f"DeepEP V1: {deepep.get('missing') or deepep.get('error')}")
    for n, m in deepep.get("num_sms_curve", {}).items():
        print(f"DeepEP num_sms={n:<4} cached dispatch {_gbps(m['recv_bytes'], m['cached_dispatch_us']):7.1f} GB/s  "
              f"combine {_gbps(m['recv_bytes'], m['combine_us']):7.1f} GB/s")
    for n, m in report.get("num_sms_curve", {}).items():
        print(f"num_sms={n:<4} cached dispatch {_gbps(m['recv_bytes'], m['cached_dispatch_us']):7.1f} GB/s  "
              f"combine {_gbps(m['recv_bytes'], m['combine_us']):7.1f} GB/s  back to back: "
              f"{_gbps(m['recv_bytes'], m['cached_dispatch_pipelined_us']):7.1f} / "
              f"{_gbps(m['recv_bytes'], m['combine_pipelined_us']):7.1f} GB/s")
    for m in report.get("shape_sweep", []):
        print(f"{str(m['change']):<55} cached dispatch "
              f"{_gbps(m['recv_bytes'], m['cached_dispatch_us']):7.1f} GB/s  combine "
              f"{_gbps(m['recv_bytes'], m['combine_us']):7.1f} GB/s  back to back: "
              f"{_gbps(m['recv_bytes'], m['cached_dispatch_pipelined_us']):7.1f} / "
              f"{_gbps(m['recv_bytes'], m['combine_pipelined_us']):7.1f} GB/s")


def plot(report: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    curves = {"tritonep": report.get("num_sms_curve"), "DeepEP V1": report.get("deepep", {}).get("num_sms_curve")}
    if not curves["tritonep"]:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, curve in curves.items():
        if not curve:
            continue
        sms = sorted(curve, key=int)
        for key, label in (("cached_dispatch_us", "cached dispatch bf16"), ("combine_us", "combine")):
            ax.plot([int(n) for n in sms], [_gbps(curve[n]["recv_bytes"], curve[n][key]) for n in sms],
                    "o-" if name == "tritonep" else "s--", label=f"{name}: {label}")
    if "all_to_all_path" in report:
        m = report["all_to_all_path"]
        ax.axhline(_gbps(m["recv_bytes"], m["cached_dispatch_us"]), color="tab:red", ls=":",
                   label="all_to_all_single path: cached dispatch")
    if _ceiling_nvl_gbps(report) is not None:
        ax.axhline(_ceiling_nvl_gbps(report), color="gray", ls="--",
                   label="link ceiling (remote bytes at copy-engine rate)")
    ax.set_xlabel("num_sms (programs per launch)")
    ax.set_ylabel("NVL GB/s (DeepEP metric)")
    ax.set_title(f"{report['ranks']}x {report['device']}, {report['tokens']} tokens/rank")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")

