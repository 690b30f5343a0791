"""Where a profiled kernel's warps stall, by source line, from an Nsight Compute report taken
with ``--set full --import-source yes`` (Triton kernels carry Python line info, so the lines
are the kernel's own).

    python scripts/ncu_hotspots.py report.ncu-rep [--top 30]

Two readings, both printed when they work: ncu's Python module (``ncu_report``, shipped in
ncu's ``extras/python``) summed per (line, stall reason), and the SASS source page as CSV (the
top instructions by warp-state samples). One profiled launch per report is expected.
"""

from __future__ import annotations

import argparse
import collections
import csv
import glob
import io
import os
import shutil
import subprocess
import sys


def by_line(report: str, top: int) -> None:
    """Warp-state samples per (file line, stall reason) through ``ncu_report``."""
    ncu = os.path.realpath(shutil.which("ncu") or "ncu")
    for pattern in (os.path.join(os.path.dirname(ncu), "**", "extras", "python"),
                    "/usr/local/cuda*/nsight-compute*/extras/python", "/opt/nvidia/nsight-compute/*/extras/python"):
        sys.path.extend(glob.glob(pattern, recursive=True))
    import ncu_report  # noqa: PLC0415 (only on machines with ncu)

    action = ncu_report.load_report(report).range_by_idx(0).action_by_idx(0)
    samples: collections.Counter = collections.Counter()
    for name in action.metric_names():
        if not name.startswith("smsp__pcsamp_warps_issue_stalled_") or name.endswith("_not_issued"):
            continue
        metric = action.metric_by_name(name)
        if metric.num_instances() == 0:
            continue
        addresses = metric.correlation_ids()
        for i in range(metric.num_instances()):
            count = metric.as_uint64(i)
            if count:
                info = action.source_info(addresses.as_uint64(i))
                where = (info.file_name(), info.line()) if info else ("?", 0)
                samples[(where, name[len("smsp__pcsamp_warps_issue_stalled_"):])] += count
    total = sum(samples.values()) or 1
    per_line: collections.Counter = collections.Counter()
    for (where, _), count in samples.items():
        per_line[where] += count
    print(f"== per source line ({total} samples): share, top stall reasons")
    for where, count in per_line.most_common(top):
        reasons = sorted(((c, r) for (w, r), c in samples.items() if w == where), reverse=True)[:3]
        text = _line_text(*where)
        print(f"{100 * count / total:5.1f}%  {os.path.basename(where[0])}:{where[1]:<4} "
              + ", ".join(f"{r} {100 * c / total:.1f}" for c, r in reasons) + f"  | {text}")


def _line_text(path: str, line: int) -> str:
    try:
        with open(path) as source:
            return source.read().splitlines()[line - 1].strip()[:90]
    except (OSError, IndexError):
        return ""


def by_instruction(report: str, top: int) -> None:
    """The SASS source page (CSV) sorted by warp-state samples."""
    text = subprocess.run(["ncu", "-i", report, "--page", "source", "--csv", "--print-source", "sass"],
                          capture_output=True, text=True, check=True).stdout
    with open(f"{report}.sass.csv", "w") as kept:   # for a closer look elsewhere
        kept.write(text)
    rows, header = [], None
    for record in csv.reader(io.StringIO(text)):
        if record and record[0] in ("Address", "# Address"):   # a table's header ("Kernel Name" lines before)
            header = record
        elif header is not None and len(record) == len(header):
            rows.append(dict(zip(header, record)))
    column = next((c for c in (header or []) if c.startswith("Warp Stall Sampling (All")), None)
    if not rows or column is None:
        print(f"no SASS rows with warp-state samples; columns: {header}")
        return

    def samples(row: dict[str, str]) -> float:
        try:
            return float(row[column].replace(",", "") or 0)
        except ValueError:
            return 0.0

    total = sum(samples(row) for row in rows) or 1.0
    order = {id(row): i for i, row in enumerate(rows)}
    print(f"== per SASS instruction ({total:.0f} samples; index = position in the kernel)")
    for row in sorted(rows, key=samples, reverse=True)[:top]:
        print(f"{100 * samples(row) / total:5.1f}%  #{order[id(row)]:<5} {row.get('Source', '').strip()[:100]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    for reading in (by_line, by_instruction):
        try:
            reading(args.report, args.top)
        except Exception as error:   # one reading failing should not hide the other
            print(f"{reading.__name__}: {type(error).__name__}: {error}")


if __name__ == "__main__":
    main()
