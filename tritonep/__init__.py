"""tritonep: expert-parallel dispatch and combine, DeepEP's API, Triton kernels.

``import tritonep as deep_ep`` gives the names DeepEP users program against.
"""

import torch

from . import utils
from .buffer import Buffer
from .checks import InputError
from .config import Config
from .event import EventOverlap

topk_idx_t = torch.int64

__all__ = ["Buffer", "Config", "EventOverlap", "InputError", "topk_idx_t", "utils"]
__version__ = "0.1.0"
