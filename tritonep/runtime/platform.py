"""Where the kernels run: on GPUs, or on CPUs under Triton's interpreter (``TRITON_INTERPRET=1``).

Read once at import, as Triton itself does: the interpreter replaces inline PTX with its own
atomics, so kernels take ``GPU=GPU_KERNELS`` as a constexpr, and host code allocates on the CPU.
"""

from __future__ import annotations

import os

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
GPU_KERNELS = not INTERPRET
