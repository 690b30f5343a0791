"""One-rank A/B (``--ranks 1 --baseline DIR``): the package at DIR against this checkout's, on one
GPU (or one CPU rank), in the same run.

Both packages are loaded in one worker process (``ab_worker``: public API only, the baseline
under another name) and take turns call shape by call shape, ``--rounds`` rounds, the order
swapped every round, since a host's speed drifts within minutes and differs between processes.
Each row is the median over the rounds; the table flags rows where this checkout is more than
``WORSE`` slower.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHECKOUT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
WORSE = 0.05   # a row more than 5% slower in this checkout is flagged


def package_root(path: str) -> str:
    """The folder holding ``tritonep/``: ``path`` itself, or its parent when it is the package."""
    path = os.path.realpath(path)
    if os.path.isfile(os.path.join(path, "tritonep", "__init__.py")):
        return path
    if os.path.basename(path) == "tritonep" and os.path.isfile(os.path.join(path, "__init__.py")):
        return os.path.dirname(path)
    raise SystemExit(f"--baseline {path}: no tritonep package there")


def _worker(baseline: str, args: argparse.Namespace, gpu: bool, json_path: str) -> dict:
    """Both packages measured in one process of its own (so this one never imports tritonep twice)."""
    command = [sys.executable, "-m", "benchmarks.ab_worker", "--baseline", baseline, "--json", json_path,
               "--rounds", str(args.rounds)]
    for name in ("tokens", "hidden", "experts", "topk", "num_sms", "ll_tokens", "ll_experts", "iters"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if not gpu:
        command.append("--cpu")
    subprocess.run(command, cwd=CHECKOUT, env=os.environ.copy(), check=True, timeout=900)
    with open(json_path) as f:
        return json.load(f)


def _medians(rounds: list[dict]) -> dict:
    """Each row's figures as medians over the rounds."""
    rows = rounds[0]["rows"]
    return {row: {metric: statistics.median(r["rows"][row][metric] for r in rounds) for metric in rows[row]}
            for row in rows}


def run(args: argparse.Namespace, gpu: bool) -> dict:
    """Both packages measured in turns, then ``compare``d."""
    with tempfile.TemporaryDirectory() as folder:
        measured = _worker(package_root(args.baseline), args, gpu, os.path.join(folder, "ab.json"))
    return compare(measured)


def compare(measured: dict[str, list[dict]]) -> dict:
    """The A/B report from each package's rounds (``ab_worker`` reports, keys "baseline" and
    "new"): per package its rounds and each row's medians; this checkout's ratio to the
    baseline per row and figure; the rows more than ``WORSE`` slower."""
    report: dict = {which: {"package": rounds[0]["package"], "tritonep": rounds[0]["tritonep"],
                            "device": rounds[0]["device"], "rounds": rounds, "rows": _medians(rounds),
                            "host_yardstick_us": statistics.median(r["torch add_ (host yardstick)"] for r in rounds)}
                    for which, rounds in measured.items()}
    report["ratios"] = {}
    for row, figures in report["new"]["rows"].items():
        for metric, value in figures.items():
            base = report["baseline"]["rows"][row][metric]
            report["ratios"][f"{row}, {metric}"] = value / base if base > 0 else float("nan")
    report["worse"] = [row for row, ratio in report["ratios"].items() if ratio > 1 + WORSE]
    return report


def print_table(report: dict) -> None:
    base, new = report["baseline"], report["new"]
    print(f"\none-rank A/B on {new['device']}: baseline {base['tritonep']}, new {new['tritonep']}; "
          f"{len(new['rounds'])} round(s), medians; microseconds")
    print(f"{'row':<44}{'baseline':>11}{'new':>11}{'new/base':>10}")
    timed = "wall per call" if new["device"] == "cpu" else "GPU"
    for row, figures in new["rows"].items():
        for metric in figures:
            key = f"{row}, {metric}"
            ratio = report["ratios"][key]
            flag = f"  WORSE (> {100 * WORSE:.0f}%)" if key in report["worse"] else ""
            label = f"{row}, {timed if metric == 'gpu_us' else 'host per call'}"
            print(f"{label:<44}{base['rows'][row][metric]:>11.1f}{figures[metric]:>11.1f}{ratio:>10.3f}{flag}")
    print(f"{'host yardstick: torch add_ per call':<44}{base['host_yardstick_us']:>11.1f}"
          f"{new['host_yardstick_us']:>11.1f}")
    print(f"{len(report['worse'])} row(s) worse by more than {100 * WORSE:.0f}%")
