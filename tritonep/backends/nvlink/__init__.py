"""NVLink transport: Triton kernels over torch symmetric memory, for ranks of one node."""

from .backend import NvlinkBackend

__all__ = ["NvlinkBackend"]
