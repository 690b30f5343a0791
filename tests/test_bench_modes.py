"""The benchmark's other modes on CPUs: ``--profile`` on gloo ranks."""

from __future__ import annotations

import json

from benchmarks.__main__ import main


def test_profile_mode_on_cpu_ranks(tmp_path) -> None:
    main(["--cpu", "--ranks", "2", "--profile", "--tokens", "16", "--hidden", "256", "--out", str(tmp_path)])
    reports = json.loads((tmp_path / "profile.json").read_text())
    assert [r["rank"] for r in reports] == [0, 1]
    for kind in ("layout", "fresh_dispatch", "cached_dispatch", "combine_copy_engine"):
        assert reports[0][kind]["wall_us_per_call"] > 0 and reports[0][kind]["device_us_per_call"], kind
