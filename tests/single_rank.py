"""A process group of one rank inside the pytest process, and a guard that fails a test when a
bad call reaches the transport: what the error tests of both front ends share."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch.distributed as dist
from torch_defaults import default_dtype, torch_defaults

from tritonep import InputError


def one_rank_group(prefix: str) -> Iterator[dist.ProcessGroup]:
    """A gloo group of world size 1 in this process, for a module-scoped fixture to yield from.
    The in-process cases run under the default dtype TRITONEP_TEST_DEFAULT_DTYPE asks for, like
    the rank workers (torch_defaults.py)."""
    created = False
    if not dist.is_initialized():
        store_file = tempfile.NamedTemporaryFile(prefix=prefix, delete=False)
        store_file.close()
        os.unlink(store_file.name)
        dist.init_process_group("gloo", store=dist.FileStore(store_file.name, 1), rank=0, world_size=1)
        created = True
    if dist.get_world_size() != 1:
        pytest.skip("a process group of another size is already initialised in this process")
    with torch_defaults(default_dtype()):
        yield dist.group.WORLD
    if created:
        dist.destroy_process_group()


class NoCommunication:
    """Stands in for a Buffer's backend during a bad call: reaching the transport fails the test."""

    ALLOWED = frozenset({"device", "comm_stream", "rank", "num_ranks", "buffer_id", "group"})

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        if name in self.ALLOWED:
            return getattr(self._real, name)
        raise AssertionError(f"backend.{name} was reached: a bad call must be rejected before any communication")


def raises_naming(name: str, call: Callable[[Any], object], fragments: tuple[str, ...], context: Any) -> None:
    """``call(context)`` raises an InputError whose message holds every fragment."""
    with pytest.raises(InputError) as info:
        call(context)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{name}: message {message!r} lacks {fragment!r}"
