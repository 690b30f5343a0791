"""FastLauncher's bookkeeping, on the CPU: a stand-in for a Triton JIT function records what
would reach ``cuLaunchKernelEx``. (The real kernels go through it in every GPU test.)"""

from __future__ import annotations

import pytest
import torch

from tritonep.runtime import launcher


class _Run:
    """Triton's compiled launcher: its C entry point and the metadata read by _Setup."""

    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid = launch_pdl = 0

    def __init__(self, launches: list) -> None:
        self.launches = launches

    def launch(self, *call) -> None:
        self.launches.append(("fast", call[0], call[3], call[13:]))


class _Compiled:
    function, packed_metadata = 1234, (4, 1, 0)

    def __init__(self, launches: list) -> None:
        self.run = _Run(launches)


class _Kernel:
    """``kernel[grid](*args, **constants)`` as Triton does it: launch, return the compiled kernel."""

    arg_names = ["x_ptr", "n", "out_ptr", "BLOCK"]

    def __init__(self) -> None:
        self.launches: list = []

    def __getitem__(self, grid):
        def bind(*args, num_warps, **constants):
            self.launches.append(("bind", grid[0], args, constants))
            return _Compiled(self.launches)
        return bind


@pytest.fixture
def kernel(monkeypatch):
    monkeypatch.setattr(launcher, "INTERPRET", False)
    monkeypatch.setattr(launcher, "current_stream", lambda: 77)
    return _Kernel()


def test_first_call_binds_then_launches_raw_addresses(kernel) -> None:
    fast = launcher.FastLauncher(kernel, changing=("x_ptr", "n"))
    x, out = torch.zeros(64), torch.zeros(64)
    fast(8, "setup", (x, 32, out), {"BLOCK": 128}, 4)
    assert kernel.launches[-1][0] == "bind"
    y = torch.zeros(64)
    fast(8, "setup", (y, 48, out), {"BLOCK": 128}, 4)
    # Same setup, same specialisation: the compiled launcher gets addresses and the new ints.
    assert kernel.launches[-1] == ("fast", 8, 77, (y.data_ptr(), 48, out.data_ptr(), 128))
    assert len(kernel.launches) == 2


def test_new_specialisation_or_setup_binds_again(kernel) -> None:
    fast = launcher.FastLauncher(kernel, changing=("x_ptr", "n"))
    base, out = torch.zeros(64), torch.zeros(64)
    fast(8, "setup", (base, 32, out), {"BLOCK": 128}, 4)
    fast(8, "setup", (base[1:], 32, out), {"BLOCK": 128}, 4)    # address no longer 16-byte aligned
    fast(8, "setup", (base, 1, out), {"BLOCK": 128}, 4)         # n == 1 is a specialisation
    fast(8, "other", (base, 32, out), {"BLOCK": 256}, 4)        # another setup
    assert [entry[0] for entry in kernel.launches] == ["bind"] * 4
    fast(8, "setup", (base[1:], 32, out), {"BLOCK": 128}, 4)    # each is known from now on
    fast(8, "setup", (base, 1, out), {"BLOCK": 128}, 4)
    assert [entry[0] for entry in kernel.launches[4:]] == ["fast", "fast"]
    assert kernel.launches[-2][3][0] == base[1:].data_ptr()


def test_kinds_follow_triton_specialisation() -> None:
    assert launcher._kinds([16]) != launcher._kinds([17])
    assert launcher._kinds([1]) != launcher._kinds([17])
    assert launcher._kinds([2**31]) != launcher._kinds([2**31 - 16])
    assert launcher._kinds([32, 48]) == launcher._kinds([64, 80])


def test_next_power_of_2_is_tritons() -> None:
    import triton

    assert [launcher.next_power_of_2(v) for v in range(1, 5000)] == [triton.next_power_of_2(v) for v in range(1, 5000)]
    assert launcher.next_power_of_2(0) == 1


def test_every_argument_changing_keys_on_grid_and_constants(kernel) -> None:
    """``changing=None`` (the normal-mode kernels): every argument is converted per call and the
    setup is the grid, warps and constexprs."""
    fast = launcher.FastLauncher(kernel)
    x, out = torch.zeros(64), torch.zeros(64)
    fast(8, None, (x, 32, out), {"BLOCK": 128}, 4)
    other = torch.zeros(64)
    fast(8, None, (x, 48, other), {"BLOCK": 128}, 4)
    assert kernel.launches[-1] == ("fast", 8, 77, (x.data_ptr(), 48, other.data_ptr(), 128))
    fast(16, None, (x, 48, other), {"BLOCK": 128}, 4)   # another grid
    fast(8, None, (x, 48, other), {"BLOCK": 256}, 4)    # another constexpr
    assert [entry[0] for entry in kernel.launches] == ["bind", "fast", "bind", "bind"]


@pytest.mark.parametrize("registers,warps,shared,expected", [
    # Nsight Compute's "Block Limit Registers" on an H200 for our kernels (2026-11-24 runs 2-5):
    (128, 16, 0, 1),     # the old low-latency dispatch
    (45, 16, 0, 2),      # its receive half alone (run 3)
    (85, 16, 0, 1),      # the low-latency combine
    (95, 16, 0, 1),      # the per-token dispatch
    # CUDA's rules beyond those readings:
    (95, 8, 0, 2),       # registers bound at 8 warps (24 x 1024 of 64 x 1024)
    (32, 4, 0, 16),      # small programs: threads bound them (2048 / 128)
    (32, 1, 0, 32),      # and the 32-block limit
    (64, 4, 100_000, 2),  # shared memory bound
])
def test_programs_per_multiprocessor(registers: int, warps: int, shared: int, expected: int) -> None:
    """The occupancy arithmetic against Nsight Compute's readings (docs/benchmarks/2026-11-24-h200x1,
    ncu details of runs 3 and 5) and CUDA's documented limits."""
    assert launcher.programs_per_multiprocessor(registers, warps, shared) == expected


def test_constants_factory_is_called_only_for_a_new_setup(kernel) -> None:
    """``constants`` may be a function: a repeated launch of a known setup never calls it."""
    fast = launcher.FastLauncher(kernel, changing=("x_ptr", "n"))
    made = []

    def constants() -> dict:
        made.append(1)
        return {"BLOCK": 128}

    x, out = torch.zeros(64), torch.zeros(64)
    fast(8, "setup", (x, 32, out), constants, 4)
    fast(8, "setup", (torch.zeros(64), 48, out), constants, 4)
    assert len(made) == 1
    assert kernel.launches[0] == ("bind", 8, (x, 32, out), {"BLOCK": 128})
    assert kernel.launches[-1][0] == "fast" and kernel.launches[-1][3][-1] == 128   # the constexpr in the raw list
    fast(8, "other", (x, 32, out), constants, 4)
    assert len(made) == 2


def test_checked_launches_refuse_a_fixed_argument_that_changed(kernel, monkeypatch) -> None:
    """With TRITONEP_CHECK_LAUNCHES, a setup key that misses an argument is an error, not a
    launch with the first call's value."""
    monkeypatch.setattr(launcher, "CHECK_LAUNCHES", True)
    fast = launcher.FastLauncher(kernel, changing=("x_ptr",))
    x, out = torch.zeros(64), torch.zeros(64)
    fast(8, "setup", (x, 32, out), {"BLOCK": 128}, 4)
    fast(8, "setup", (torch.zeros(64), 32, out), {"BLOCK": 128}, 4)   # only x changed: fine
    with pytest.raises(RuntimeError, match="argument n changed from 32 to 48"):
        fast(8, "setup", (x, 48, out), {"BLOCK": 128}, 4)
