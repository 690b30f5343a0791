"""The benchmark's other modes on CPUs: ``--profile`` on gloo ranks, and the one-rank A/B against
a package as of commit bb06a2c (both packages in one worker process, public API only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks import ab
from benchmarks.__main__ import main

CHECKOUT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
BASELINE_COMMIT = "bb06a2c"


def test_profile_mode_on_cpu_ranks(tmp_path) -> None:
    main(["--cpu", "--ranks", "2", "--profile", "--tokens", "16", "--hidden", "256", "--out", str(tmp_path)])
    reports = json.loads((tmp_path / "profile.json").read_text())
    assert [r["rank"] for r in reports] == [0, 1]
    for kind in ("layout", "fresh_dispatch", "cached_dispatch", "combine_copy_engine"):
        assert reports[0][kind]["wall_us_per_call"] > 0 and reports[0][kind]["device_us_per_call"], kind


@pytest.fixture(scope="module")
def baseline_package(tmp_path_factory) -> str:
    """tritonep as of ``BASELINE_COMMIT``, unpacked from this repository's history."""
    folder = tmp_path_factory.mktemp("baseline")
    archive = subprocess.run(["git", "-C", CHECKOUT, "archive", BASELINE_COMMIT, "tritonep"], capture_output=True)
    if archive.returncode != 0:
        pytest.skip(f"no commit {BASELINE_COMMIT} in this checkout's history: {archive.stderr.decode()[:200]}")
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    return str(folder)


def test_one_rank_ab_against_an_older_package(baseline_package, tmp_path, capsys) -> None:
    main(["--cpu", "--ranks", "1", "--baseline", baseline_package, "--tokens", "16", "--hidden", "256",
          "--ll-tokens", "8", "--ll-experts", "8", "--iters", "2", "--rounds", "1", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "ab.json").read_text())
    assert result["baseline"]["tritonep"].startswith(os.path.realpath(baseline_package))
    assert result["new"]["tritonep"].startswith(CHECKOUT)
    assert result["baseline"]["rounds"][0]["buffer_module"].startswith("tritonep_baseline.")
    assert result["new"]["rounds"][0]["buffer_module"] == "tritonep.v1.buffer"
    rows = result["new"]["rows"]
    assert set(rows) == set(result["baseline"]["rows"]) == {
        "layout", "fresh dispatch", "cached dispatch bf16", "cached dispatch fp8", "combine", "low-latency dispatch",
        "low-latency dispatch, hook", "low-latency combine", "low-latency combine, hook"}
    assert all(figure > 0 for figures in rows.values() for figure in figures.values())
    assert len(result["ratios"]) == 2 * len(rows)
    assert "row(s) worse by more than 5%" in capsys.readouterr().out


def test_ab_baseline_runs_its_own_modules(tmp_path) -> None:
    """A baseline whose modules import each other by absolute name (as this checkout's do) runs
    its own modules, not this checkout's under its name: this checkout taken as the baseline
    gives two Buffer classes, each from its own package."""
    script = ("import sys; from benchmarks.ab_worker import import_both; "
              f"p = import_both({CHECKOUT!r}, {str(tmp_path)!r}); "
              "b, n = p['baseline'].Buffer, p['new'].Buffer; "
              "print(b is not n, b.__module__, n.__module__, sys.modules[b.__module__].checks.__name__)")
    out = subprocess.run([sys.executable, "-c", script], cwd=CHECKOUT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "tritonep_baseline.v1.buffer", "tritonep.v1.buffer",
                                  "tritonep_baseline.core.checks"]


def test_ab_flags_rows_more_than_five_percent_slower(capsys) -> None:
    def reports(layout_us: float, combine_us: float) -> list[dict]:
        rows = {"layout": {"gpu_us": layout_us, "host_us": 10.0}, "combine": {"gpu_us": combine_us, "host_us": 10.0}}
        return [{"package": "p", "tritonep": "p/tritonep/__init__.py", "device": "GPU", "rows": rows,
                 "torch add_ (host yardstick)": 7.0}]

    result = ab.compare({"baseline": reports(100.0, 100.0), "new": reports(104.0, 106.0)})
    assert result["worse"] == ["combine, gpu_us"]
    assert abs(result["ratios"]["layout, gpu_us"] - 1.04) < 1e-12
    ab.print_table(result)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(",")[0] for line in lines if "WORSE" in line] == ["combine"]


def test_v2_api_beside_v1_on_cpu_ranks(tmp_path, capsys) -> None:
    """``--api v2``: every V2 call beside the V1 call(s) of the same shape, same run: both APIs'
    call and host times, and V2's extra host time, per row."""
    main(["--cpu", "--ranks", "2", "--api", "v2", "--tokens", "16", "--hidden", "256", "--experts", "8", "--topk", "3",
          "--iters", "2", "--rounds", "1", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "bench_v2.json").read_text())
    assert result["backend"] == "collective" and result["ranks"] == 2
    rows = result["rows"]
    assert set(rows) == {"fresh dispatch", "fresh dispatch, no CPU sync", "cached dispatch", "combine",
                         "combine, top-k weights"}
    for name, row in rows.items():
        assert all(row[f"{api}_{kind}_us"] > 0 for api in ("v1", "v2") for kind in ("gpu", "host")), name
        assert abs(row["v2_minus_v1_host_us"]) < 1e6, name
    table = capsys.readouterr().out
    assert "V2 (ElasticBuffer) beside V1 (Buffer): 2 ranks on cpu" in table
    assert all(name in table for name in rows)


def test_v2_host_profile_names_where_the_apis_differ(tmp_path, capsys) -> None:
    """``--api v2 --host-profile``: per row, both APIs' own host time under cProfile and the
    functions that differ most, V2's front end among them (code only V2 runs)."""
    main(["--cpu", "--ranks", "2", "--api", "v2", "--host-profile", "--tokens", "16", "--hidden", "256", "--experts",
          "8", "--topk", "3", "--iters", "2", "--rounds", "1", "--out", str(tmp_path)])
    profiled = json.loads((tmp_path / "bench_v2.json").read_text())["host_profile"]
    assert set(profiled) == {"fresh dispatch", "fresh dispatch, no CPU sync", "cached dispatch", "combine",
                             "combine, top-k weights"}
    for name, row in profiled.items():
        assert row["v1_us"] > 0 and row["v2_us"] > 0, name
        assert any(function.startswith("v2/") and v1_us == 0 and v2_us > 0
                   for function, v1_us, v2_us in row["largest_differences"]), (name, row["largest_differences"])
        # Each API's own largest times, largest first, within its total.
        for api in ("v1", "v2"):
            times = [us for _, us in row[f"{api}_largest"]]
            assert times == sorted(times, reverse=True) and 0 < sum(times) <= row[f"{api}_us"] + 1e-6, (name, api)
    out = capsys.readouterr().out
    assert "fresh dispatch: own host us per call under cProfile" in out and "largest own times, v2:" in out


def test_v1_host_profile_lists_where_each_host_row_goes(tmp_path, capsys) -> None:
    """``--host-profile`` without ``--api v2``: each host row's own host time under cProfile and
    its largest functions, the front end's dispatch among the cached dispatch's; also the cached
    dispatch and the combine each on a new handle, and the combine on new rows each call."""
    main(["--cpu", "--ranks", "2", "--host-profile", "--skip-low-latency", "--tokens", "16", "--hidden", "256",
          "--experts", "8", "--topk", "3", "--iters", "2", "--rounds", "1", "--out", str(tmp_path)])
    profiled = json.loads((tmp_path / "bench.json").read_text())["host_profile"]
    assert set(profiled) == {"layout", "cached_dispatch", "combine", "cached_dispatch_new_handle", "combine_new_handle",
                             "combine_new_inputs"}
    for name, row in profiled.items():
        times = [us for _, us in row["largest"]]
        assert times == sorted(times, reverse=True) and 0 < sum(times) <= row["us"] + 1e-6, name
    assert any(function.startswith("v1/buffer.py") and "dispatch" in function
               for function, _ in profiled["cached_dispatch"]["largest"]), profiled["cached_dispatch"]
    assert "host profile, cached_dispatch: own host us per call under cProfile" in capsys.readouterr().out


def test_internode_rows_beside_one_node_rows_on_cpu_ranks(tmp_path, capsys) -> None:
    """``--gpus-per-node 2`` on 4 CPU ranks: the split group's rows (the collective backend serves
    it) in the same run as the one-node rows, with bytes per rank and the NIC projection."""
    main(["--cpu", "--ranks", "4", "--gpus-per-node", "2", "--nic-gbps", "25", "--tokens", "16", "--hidden", "256",
          "--experts", "16", "--topk", "4", "--iters", "2", "--rounds", "1", "--skip-low-latency",
          "--out", str(tmp_path)])
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["all_to_all_path"]["recv_bytes"] > 0
    internode = result["internode"]
    assert (internode["nodes"], internode["gpus_per_node"], internode["backend"]) == (2, 2, "CollectiveBackend")
    calls = internode["calls"]
    assert set(calls) == {"layout", "dispatch", "cached_dispatch", "cached_dispatch_fp8", "combine"}
    assert all(m["us"] > 0 for m in calls.values())
    assert 0 < internode["network_rows"] <= 16 and 0 < internode["nvlink_rows"] <= 16 * 3
    bf16 = calls["cached_dispatch"]
    assert bf16["network_bytes"] == internode["network_rows"] * 512
    assert abs(bf16["nic_us"] - bf16["network_bytes"] / 25e3) < 1e-9
    assert calls["combine"]["network_bytes"] == 2 * bf16["network_bytes"]   # float32 partial sums
    assert calls["cached_dispatch_fp8"]["network_bytes"] == internode["network_rows"] * (256 + 8)
    table = capsys.readouterr().out
    assert "internode: 2 nodes of 2 ranks" in table and "internode: cached dispatch fp8" in table


def test_internode_only(tmp_path, capsys) -> None:
    """``--internode-only``: the split group's rows and nothing else."""
    main(["--cpu", "--ranks", "4", "--gpus-per-node", "2", "--internode-only", "--tokens", "16", "--hidden", "256",
          "--experts", "16", "--topk", "4", "--iters", "2", "--rounds", "1", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "bench.json").read_text())
    assert set(result) == {"internode"} and result["internode"]["calls"]["combine"]["us"] > 0
    assert "all_to_all_single" not in capsys.readouterr().out


def test_internode_traffic_rows_match_a_count_by_hand() -> None:
    """Rows crossing nodes once per (token, other node); rows forwarded inside a node once per
    (token, taking rank) but the rank of the sender's local index, which the row lands at."""
    import torch

    from benchmarks.internode import traffic_rows

    generator = torch.Generator().manual_seed(3)
    in_rank = torch.rand(50, 6, generator=generator) < 0.4
    for rank in range(6):
        network = forwarded = 0
        for token in in_rank.tolist():
            for node in range(3):
                takers = [2 * node + local for local in range(2) if token[2 * node + local]]
                network += bool(takers) and node != rank // 2
                forwarded += len([d for d in takers if d != 2 * node + rank % 2])
        assert traffic_rows(in_rank, rank, 2) == (network, forwarded), rank


def test_internode_low_latency_rows_on_cpu_ranks(tmp_path, capsys) -> None:
    """``--gpus-per-node 2 --skip-normal``: the low-latency calls on the split group beside the
    other paths, with rows per rank over the network and over NVLink counted from the routing."""
    main(["--cpu", "--ranks", "4", "--gpus-per-node", "2", "--skip-normal", "--hidden", "256", "--experts", "16",
          "--topk", "4", "--ll-tokens", "4", "--ll-experts", "8", "--iters", "1", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "bench.json").read_text())["low_latency"]
    assert result["internode"]["dispatch_us"] > 0 and result["internode"]["combine_us"] > 0
    traffic = result["internode_traffic"]
    # 4 tokens x top-4 = 16 rows per rank, each to another node, another rank of this node, or itself.
    assert 0 < traffic["network_rows"] <= 16 and traffic["network_rows"] + traffic["nvlink_rows"] <= 16
    assert traffic["dispatch_network_bytes"] == traffic["network_rows"] * (256 + 8)
    assert traffic["combine_network_bytes"] == traffic["network_rows"] * 512
    assert abs(traffic["combine_nic_us"] - traffic["combine_network_bytes"] / 50e3) < 1e-9
    assert "split into nodes of 2: dispatch + combine" in capsys.readouterr().out
