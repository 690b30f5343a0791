"""tritonep: expert-parallel dispatch and combine, DeepEP's API, Triton kernels.

``import tritonep as deep_ep`` gives the names DeepEP users program against: V1's ``Buffer`` and
V2's ``ElasticBuffer`` / ``EPHandle``, two front ends over the same engines.
"""

import torch

from tritonep import utils
from tritonep.backends.nvlink.sizes import nvl_bytes_for
from tritonep.core.checks import InputError
from tritonep.core.config import Config
from tritonep.core.event import EventOverlap
from tritonep.v1.buffer import Buffer
from tritonep.v2.buffer import ElasticBuffer, get_logical_domain_size, get_physical_domain_size
from tritonep.v2.event import EventHandle
from tritonep.v2.handle import EPHandle

topk_idx_t = torch.int64

__all__ = ["Buffer", "Config", "EPHandle", "ElasticBuffer", "EventHandle", "EventOverlap", "InputError",
           "get_logical_domain_size", "get_physical_domain_size", "nvl_bytes_for", "topk_idx_t", "utils"]
__version__ = "0.1.0"
