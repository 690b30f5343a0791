"""What the property tests of both front ends share: every rank's inputs in one record, and a
run over the ranks whose failure names the world that made it.

A world holds every rank's tokens and routing, so each rank picks its own and the pytest
process can build what any rank must receive with plain loops that share no code with
tritonep. Each front end's tests extend ``RoutedWorld`` with the options they vary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tritonep.rank_pool import RankFailure, RankPool


@dataclass
class RoutedWorld:
    R: int
    H: int
    E: int
    K: int
    T: int
    strategy: str
    x: list[torch.Tensor]              # bf16 [N_r, H]
    x2: list[torch.Tensor]             # bf16 [N_r, H], for the cached dispatch
    topk: list[torch.Tensor]           # int64 [N_r, K]
    weights: list[torch.Tensor]        # float32 [N_r, K] (whatever the world puts where topk == -1)

    @property
    def E_local(self) -> int:
        return self.E // self.R

    def describe(self) -> str:
        return (f"R={self.R} H={self.H} E={self.E} K={self.K} T={self.T} strategy={self.strategy} "
                f"N={[t.shape[0] for t in self.topk]} {self.options()}\ntopk={[t.tolist() for t in self.topk]}")

    def options(self) -> str:
        """The options a subclass varies, for ``describe``."""
        return ""


def run_world(pool: RankPool, fn: Callable, world: RoutedWorld) -> list:
    """``fn(group, world)`` on every rank of ``pool``; a rank's failure fails the test with the
    world described, so hypothesis's shrunk example can be read off the message."""
    try:
        return pool.run(fn, world)
    except RankFailure as failure:
        raise AssertionError(f"{failure}\n{world.describe()}") from None
