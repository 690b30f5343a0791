"""The example MoE layer (examples/moe_layer.py, run by scripts/run_demo.sh) runs end to end,
its model pieces are consistent, and its check catches a wrong layer."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

# examples/ is not a package: put it on the path (rank processes inherit it) and import the file.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
moe_layer = importlib.import_module("moe_layer")

SMALL = ["--ranks", "2", "--tokens", "48", "--hidden", "128", "--experts", "4", "--topk", "2", "--ffn", "64",
         "--iters", "2"]


def test_moe_layer_passes_on_cpu_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    assert moe_layer.main(["--cpu", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "CPU (gloo)" in out
    for phase in moe_layer.PHASES:
        assert phase in out
    for path in moe_layer.PATHS:
        assert f"check {path}:" in out
    assert "FAIL" not in out and out.count("PASS") == len(moe_layer.PATHS)


@pytest.mark.gpu
def test_moe_layer_passes_on_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    assert moe_layer.main(SMALL) == 0
    assert "GPUs (NCCL)" in capsys.readouterr().out


def test_defaults_are_deepeps_shape_on_gpus_and_small_on_cpus() -> None:
    s, use_gpu = moe_layer.parse_setup([], num_gpus=4)
    assert use_gpu and (s.ranks, s.tokens, s.hidden, s.experts, s.topk) == (4, 4096, 7168, 256, 8)
    s, use_gpu = moe_layer.parse_setup(["--ranks", "8"], num_gpus=4)
    assert use_gpu and s.ranks == 4   # one GPU per rank
    for num_gpus, argv in ((0, []), (1, []), (4, ["--cpu"])):
        s, use_gpu = moe_layer.parse_setup(argv, num_gpus=num_gpus)
        assert not use_gpu and (s.ranks, s.tokens, s.hidden) == (4, 256, 256)


def _small_layer(s: moe_layer.Setup) -> tuple:
    """(expert weights, rank 0's tokens, their top-k ids and weights) of a float32 layer on the CPU."""
    cpu = torch.device("cpu")
    experts = [moe_layer.expert_weights(s, e, cpu, torch.float32) for e in range(s.experts)]
    x = moe_layer.make_tokens(s, 0, cpu)
    idx, weights = moe_layer.route(x, moe_layer.make_router(s, cpu), s.topk)
    return experts, x, idx, weights


def test_experts_split_across_ranks_sum_to_whole_layer() -> None:
    # What dispatch + combine must reproduce: each rank's share over its own experts adds up.
    experts, x, idx, weights = _small_layer(moe_layer.Setup(ranks=2, tokens=16, hidden=128, experts=4, topk=2,
                                                            ffn=32, iters=1))
    whole = moe_layer.moe_experts(x, idx, weights, experts)
    parts = sum(moe_layer.moe_experts(x, torch.where(idx // 2 == r, idx % 2, -1), weights, experts[2 * r:2 * r + 2])
                for r in range(2))
    torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-5)


def test_check_catches_a_missing_expert_output() -> None:
    experts, x, idx, weights = _small_layer(moe_layer.Setup(ranks=1, tokens=64, hidden=128, experts=8, topk=4,
                                                            ffn=32, iters=1))
    expected = moe_layer.moe_experts(x, idx, weights, experts).bfloat16()
    one_lost = moe_layer.moe_experts(x, torch.where(idx == idx[0, -1], -1, idx), weights, experts).bfloat16()
    assert moe_layer.compare(expected, expected)["worst_token"] == 0
    assert moe_layer.compare(one_lost, expected)["worst_token"] > 10 * moe_layer.WORST_TOKEN_TOLERANCE


def test_rejects_bad_sizes() -> None:
    with pytest.raises(SystemExit):
        moe_layer.main(["--cpu", "--ranks", "3", "--experts", "4"])
