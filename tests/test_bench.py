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
