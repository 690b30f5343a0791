"""The demo (the project's main job) runs end to end and its model pieces are consistent."""

from __future__ import annotations

import pytest
import torch

from tritonep import demo

SMALL = ["--ranks", "2", "--tokens", "48", "--hidden", "128", "--experts", "4", "--topk", "2", "--iters", "2"]


def test_demo_passes_on_cpu_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--cpu", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out
    for phase in demo.PHASES:
        assert phase in out


@pytest.mark.gpu
def test_demo_passes_on_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(SMALL) == 0
    assert "GPUs (NCCL)" in capsys.readouterr().out


def test_experts_split_across_ranks_sum_to_whole_layer() -> None:
    # What dispatch + combine must reproduce: each rank's share over its own experts adds up.
    s = demo.Setup(ranks=2, tokens=16, hidden=128, experts=4, topk=2, iters=1)
    w = demo.make_weights(s)
    x = demo.make_tokens(s, 0)
    idx, weights = demo.route(x, w["router"], s.topk)
    whole = demo.experts_forward(x, idx, weights, w["w1"], w["w2"])
    parts = sum(demo.experts_forward(x, torch.where(idx // 2 == r, idx % 2, -1), weights,
                                     w["w1"][2 * r:2 * r + 2], w["w2"][2 * r:2 * r + 2]) for r in range(2))
    torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-5)


def test_demo_rejects_bad_sizes() -> None:
    with pytest.raises(SystemExit):
        demo.main(["--cpu", "--ranks", "3", "--experts", "4"])
