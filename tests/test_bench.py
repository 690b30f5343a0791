"""``python -m benchmarks`` on CPU ranks: the command a user runs without GPUs works, its JSON
holds every path's figures, the low-latency pair and host time, and, with ``--vs-deepep``
where DeepEP is not installed, the reason it is missing; the report's GPU-only parts (rounds,
the link ceiling, the curves) from a report made up the way a GPU run makes it; and the link
ceiling's SM kernel under Triton's interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy
import pytest

from benchmarks import normal, report, timing
from benchmarks.__main__ import main

CHECKOUT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))


def test_bench_on_cpu_ranks_writes_every_path(tmp_path) -> None:
    main(["--cpu", "--ranks", "2", "--iters", "2", "--tokens", "32", "--hidden", "256", "--vs-deepep",
          "--out", str(tmp_path)])
    result = json.loads((tmp_path / "bench.json").read_text())
    normal_path = result["all_to_all_path"]
    timed = ("layout_us", "dispatch_us", "cached_dispatch_us", "combine_us")
    assert all(normal_path[key] > 0 for key in timed) and normal_path["recv_bytes"] > 0
    host = normal_path["host_us"]
    assert set(host) == {"layout", "cached_dispatch", "combine", "cached_dispatch_new_handle", "combine_new_handle",
                         "combine_new_inputs"}
    assert all(us > 0 for us in host.values()), host
    assert result["bare_all_to_all_us"] > 0
    assert "link_ceiling" not in result   # measured on GPUs only, beside the NVLink backend
    low_latency = result["low_latency"]
    assert low_latency["torch_add_host_back_to_back_us"] > 0   # the host's yardstick
    for key in ("dispatch_profiled_us", "combine_profiled_us", "pair_us", "dispatch_us", "combine_us",
                "dispatch_send_us", "dispatch_recv_us", "combine_send_us", "combine_recv_us", "dispatch_host_us",
                "combine_host_us", "dispatch_host_back_to_back_us", "combine_host_back_to_back_us"):
        assert low_latency["collective"][key] > 0, key
    try:
        import deep_ep  # noqa: F401
    except ImportError:
        assert "DeepEP not found" in result["deepep"]["missing"]
        assert "DeepEP not found" in low_latency["deepep"]["missing"]


def test_first_use_host_time_uses_each_argument_once() -> None:
    """Each timed call gets an argument no call had before (a new handle each), made ahead of its round."""
    made, used = [], []

    def make() -> object:
        made.append(object())
        return made[-1]

    assert timing.first_use_host_us(make, used.append, calls=4, rounds=3) >= 0
    assert len(made) == 12 and used == made


def test_rounds_combine_into_medians_and_a_spread() -> None:
    """Several rounds of the main figures: each figure the median over rounds, the spread per
    time figure (slowest / fastest - 1), the bytes taken as they are; one round stays as it is."""
    rounds = [dict(recv_rows=10, recv_bytes=100.0, combine_us=c, cached_dispatch_us=d, host_us=dict(combine=h))
              for c, d, h in ((100.0, 50.0, 9.0), (120.0, 50.0, 7.0), (110.0, 51.0, 8.0))]
    combined = normal.combine_rounds(rounds)
    assert combined["combine_us"] == 110.0 and combined["cached_dispatch_us"] == 50.0
    assert combined["host_us"] == dict(combine=8.0) and "host_us" not in combined["round_spread"]
    assert combined["recv_bytes"] == 100.0 and combined["rounds"] == rounds
    assert abs(combined["round_spread"]["combine_us"] - 0.2) < 1e-12
    assert abs(combined["round_spread"]["cached_dispatch_us"] - 0.02) < 1e-12
    assert "recv_bytes" not in combined["round_spread"]
    assert normal.combine_rounds(rounds[:1]) == rounds[0]


def _gpu_like_report() -> dict:
    path = dict(recv_rows=8000, recv_bytes=117e6, layout_us=17.0, dispatch_us=400.0, cached_dispatch_us=240.0,
                combine_us=250.0, layout_pipelined_us=48.0, cached_dispatch_pipelined_us=230.0,
                combine_pipelined_us=245.0, fresh_minus_cached_dispatch_us=15.0, cached_dispatch_fp8_us=147.0,
                host_us=dict(layout=46.0, cached_dispatch=50.0, combine=74.0))
    curve = {"8": dict(path), "24": dict(path)}
    return dict(ranks=2, device="GPU", tokens=4096, hidden=7168, experts=256, topk=8, num_sms=24,
                tritonep=dict(path, combine_sm_only_us=260.0), deepep={"missing": "not built"},
                all_to_all_path=dict(path), bare_all_to_all_us=260.0, remote_bytes=58.5e6, num_sms_curve=curve,
                link_ceiling=dict(remote_bytes=58.5e6, gbps={"sm_stores_24_programs": 253.0, "copy_engines": 274.0},
                                  best="copy_engines", best_gbps=274.0))


def test_report_puts_the_link_ceiling_in_the_table(capsys, tmp_path) -> None:
    """The ceiling's NVL figure: the remote bytes at the best way's rate, received bytes over that time."""
    made_up = _gpu_like_report()
    assert abs(report.ceiling_nvl_gbps(made_up) - 274.0 * 117e6 / 58.5e6) < 1e-9
    report.print_normal(made_up)
    table = capsys.readouterr().out
    assert "link ceiling, all peers at once (best)" in table and "copy_engines 274.0" in table
    assert "548.0" in table   # 274 GB/s out per GPU moves the 117 MB received in 213.5 us
    report.plot(made_up, str(tmp_path / "bench.png"))   # draws, or says matplotlib is missing
    assert report.ceiling_nvl_gbps(dict(made_up, link_ceiling={"skipped": "one rank: no peers"})) is None


def test_low_latency_table_lists_each_launch_shape(capsys) -> None:
    """``--sweep``'s low-latency launch shapes: one line each, a failed variant with its error."""
    times = dict(graph_us=30.0, profiled_us=31.0, us=35.0, send_us=20.0, recv_us=15.0, host_us=20.0,
                 host_back_to_back_us=15.0)
    nvlink = {f"{kind}_{key}": value for kind in ("dispatch", "combine") for key, value in times.items()}
    made_up = dict(ranks=4, tokens=128, hidden=7168, experts=288, topk=8, dispatch_bytes=7e6, combine_bytes=14e6,
                   torch_add_host_back_to_back_us=10.0, nvlink=dict(nvlink, pair_us=70.0),
                   nvlink_shape_sweep=[{"change": "defaults", "dispatch_graph_us": 35.2, "combine_graph_us": 47.3},
                                       {"change": {"TRITONEP_LL_WARPS": "16"}, "error": "RuntimeError: no room"}])
    report.print_low_latency(made_up)
    table = capsys.readouterr().out
    assert "tritonep shapes: defaults: dispatch 35.2 us, combine 47.3 us (CUDA graph replay)" in table
    assert "tritonep shapes: {'TRITONEP_LL_WARPS': '16'}: RuntimeError: no room" in table


@pytest.mark.interpreter
@pytest.mark.skipif(tuple(int(p) for p in numpy.__version__.split(".")[:2]) >= (2, 4),
                    reason="Triton 3.6's interpreter needs numpy<2.4 for loops with runtime bounds")
def test_ceiling_push_kernel_delivers_every_peer_chunk() -> None:
    """Each peer's chunk lands whole at its address, whatever the programs per peer and in both
    orders (spans that end inside a block included)."""
    script = """
import torch
from benchmarks.push_kernel import push
peers, words = 3, 5000
sources = torch.randint(-(1 << 62), 1 << 62, (peers * words,), dtype=torch.int64)
for programs_per_peer in (1, 2, 3):
    for strided in (True, False):
        targets = [torch.zeros(words, dtype=torch.int64) for _ in range(peers)]
        push(sources, torch.tensor([t.data_ptr() for t in targets], dtype=torch.int64), programs_per_peer, strided)
        assert all(torch.equal(t, sources[i * words:(i + 1) * words]) for i, t in enumerate(targets)), \
            (programs_per_peer, strided)
print("ok")
"""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": CHECKOUT}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
