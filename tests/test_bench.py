"""``python -m tritonep.bench`` on CPU ranks: the command a user runs without GPUs works, and
its JSON holds every path's figures, the low-latency pair and host time, and, with
``--vs-deepep`` where DeepEP is not installed, the reason it is missing."""

from __future__ import annotations

import json

from tritonep import bench


def test_bench_on_cpu_ranks_writes_every_path(tmp_path) -> None:
    bench.main(["--cpu", "--ranks", "2", "--iters", "2", "--tokens", "32", "--hidden", "256", "--vs-deepep",
                "--out", str(tmp_path)])
    report = json.loads((tmp_path / "bench.json").read_text())
    normal = report["all_to_all_path"]
    assert {"layout_us", "dispatch_us", "cached_dispatch_us", "combine_us", "recv_bytes"} <= normal.keys()
    assert all(normal[key] > 0 for key in ("layout_us", "dispatch_us", "cached_dispatch_us", "combine_us"))
    assert report["bare_all_to_all_us"] > 0
    assert report["low_latency"]["torch_add_host_back_to_back_us"] > 0   # the host's yardstick
    low_latency = report["low_latency"]["collective"]
    for key in ("dispatch_us", "combine_us", "pair_us", "dispatch_send_us", "dispatch_recv_us",
                "dispatch_host_us", "combine_host_us", "dispatch_host_back_to_back_us", "combine_host_back_to_back_us"):
        assert low_latency[key] > 0, key
    try:
        import deep_ep  # noqa: F401
    except ImportError:
        assert "DeepEP not found" in report["deepep"]["missing"]
        assert "DeepEP not found" in report["low_latency"]["deepep"]["missing"]


def test_rounds_combine_into_medians_and_a_spread() -> None:
    """Several rounds of the main figures: each figure the median over rounds, the spread per
    time figure (slowest / fastest - 1), the bytes taken as they are; one round stays as it is."""
    rounds = [dict(recv_rows=10, recv_bytes=100.0, combine_us=c, cached_dispatch_us=d, host_us=dict(combine=h))
              for c, d, h in ((100.0, 50.0, 9.0), (120.0, 50.0, 7.0), (110.0, 51.0, 8.0))]
    combined = bench.combine_rounds(rounds)
    assert combined["combine_us"] == 110.0 and combined["cached_dispatch_us"] == 50.0
    assert combined["host_us"] == dict(combine=8.0) and "host_us" not in combined["round_spread"]
    assert combined["recv_bytes"] == 100.0 and combined["rounds"] == rounds
    assert abs(combined["round_spread"]["combine_us"] - 0.2) < 1e-12
    assert abs(combined["round_spread"]["cached_dispatch_us"] - 0.02) < 1e-12
    assert "recv_bytes" not in combined["round_spread"]
    assert bench.combine_rounds(rounds[:1]) == rounds[0]
