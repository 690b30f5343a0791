"""tritonep: expert-parallel dispatch and combine, DeepEP's API, Triton kernels.

``import tritonep as deep_ep`` gives the names DeepEP users program against.
"""

import torch

from tritonep import utils
from tritonep.core.checks import InputError
from tritonep.core.config import Config
from tritonep.core.event import EventOverlap
from tritonep.v1.buffer import Buffer
from tritonep.v1.sizes import nvl_bytes_for

topk_idx_t = torch.int64

__all__ = ["Buffer", "Config", "EventOverlap", "InputError", "nvl_bytes_for", "topk_idx_t", "utils"]
__version__ = "0.1.0"
