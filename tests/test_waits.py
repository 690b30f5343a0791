"""The bounded wait on a peer (``tritonep.device.signals.wait_at_least``) and the status word.

A wait gives up at its time-out and records its phase and peer, unless the status word holds an
error already: then the host raises that first error, which explains the time-outs behind it
(ranks whose kernels were queued before another rank raised a deferred error wait for it in
vain). A shrink-mode notice in the status word is no error. The probe kernel runs in Triton's
interpreter, in a child process (this process may have imported the kernels compiled).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

from tritonep.device.signals import NS_PER_INTERPRETER_SPIN, wait_at_least
from tritonep.device.status_codes import MASKED_BIT, PHASE_COMBINE_DATA, PHASE_DISAGREEMENT

PEER = 2
DISAGREEMENT = int(PHASE_DISAGREEMENT) * 65536 + 5
TIMED_OUT = int(PHASE_COMBINE_DATA) * 65536 + PEER + 1


@triton.jit
def wait_kernel(counter_ptr, target, status_ptr, timeout_ns, peer, out_ptr):
    tl.store(out_ptr,
             wait_at_least(counter_ptr, target.to(tl.int64), status_ptr, timeout_ns, PHASE_COMBINE_DATA, peer, False))


def probe() -> dict:
    """{case: [value the wait returned, status word after it]}, interpreted."""
    found = {}
    # (counter, status before, spins before the time-out)
    cases = {"arrived": (7, 0, 100), "timed_out": (3, 0, 100), "error_before": (3, DISAGREEMENT, 100),
             "notice_before": (3, int(MASKED_BIT) + PEER + 1, 100)}
    for name, (counter, status, spins) in cases.items():
        counter_word = torch.tensor([counter], dtype=torch.int64)
        status_word = torch.tensor([status], dtype=torch.int64)
        out = torch.zeros(1, dtype=torch.int64)
        wait_kernel[(1,)](counter_word, 5, status_word, spins * int(NS_PER_INTERPRETER_SPIN), PEER, out)
        found[name] = [int(out), int(status_word)]
    return found


@pytest.fixture(scope="module")
def outcomes() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import json, test_waits as t; " \
           "print(json.dumps(t.probe()))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_wait_returns_what_arrived(outcomes) -> None:
    assert outcomes["arrived"] == [7, 0]


def test_a_wait_that_times_out_records_its_phase_and_peer(outcomes) -> None:
    value, status = outcomes["timed_out"]
    assert value > 1 << 55 and status == TIMED_OUT


def test_a_time_out_keeps_an_error_already_recorded(outcomes) -> None:
    value, status = outcomes["error_before"]
    assert value > 1 << 55 and status == DISAGREEMENT


def test_a_time_out_replaces_a_shrink_notice(outcomes) -> None:
    value, status = outcomes["notice_before"]
    assert value > 1 << 55 and status == TIMED_OUT
