"""A kernel's Triton cache key is the same in every process, whatever that process hashed first
(``tritonep/runtime/cache_keys.py``): the GPU suite's warming pool and each rank then share
their builds, and a user's processes share Triton's disk cache.

Two fresh interpreters hash the same kernels, one in the order below and one in reverse. With
Triton's own ``cache_key`` the internode kernels and the normal-mode count exchange come out
different (their helpers share constexpr globals); with ``stable_cache_key``, which tritonep's
kernels (``kernel_names.jit``) give Triton as their ``cache_key``, they must not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

KERNELS = [
    ("tritonep.backends.internode.dispatch_kernel", "node_receive_kernel"),
    ("tritonep.backends.internode.dispatch_kernel", "network_send_kernel"),
    ("tritonep.backends.internode.combine_kernel", "final_reduce_kernel"),
    ("tritonep.backends.nvlink.low_latency.combine_kernel", "low_latency_combine_kernel"),
    ("tritonep.backends.nvlink.low_latency.dispatch_kernel", "low_latency_dispatch_kernel"),
    ("tritonep.backends.nvlink.normal.notify_kernel", "notify_dispatch_kernel"),
    ("tritonep.backends.nvlink.normal.dispatch_kernel", "dispatch_kernel"),
]

_HASH_IN_ORDER = """
import importlib, json, sys
kernels = [getattr(importlib.import_module(module), name) for module, name in json.loads(sys.argv[1])]
print(json.dumps({kernel.fn.__name__: kernel.cache_key for kernel in kernels}))   # what Triton reads
"""


def _keys(order: list) -> dict:
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    result = subprocess.run([sys.executable, "-c", _HASH_IN_ORDER, json.dumps(order)], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_kernel_keys_do_not_depend_on_the_order_kernels_are_hashed_in() -> None:
    forward, backward = _keys(KERNELS), _keys(KERNELS[::-1])
    assert forward == backward
