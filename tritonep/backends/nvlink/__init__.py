"""NVLink transport: Triton kernels over torch symmetric memory, for ranks of one node.

``NvlinkBackend`` is imported on first use, so that ``low_latency_layout`` (plain Python,
used by the front end to size buffers) can be imported without Triton.
"""

from __future__ import annotations

__all__ = ["NvlinkBackend"]


def __getattr__(name: str):
    if name == "NvlinkBackend":
        from tritonep.backends.nvlink.backend import NvlinkBackend

        return NvlinkBackend
    raise AttributeError(name)
