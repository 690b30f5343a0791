"""kernel_cache: a listed kernel compiled by the warming processes is the one Triton's JIT then
finds in its disk cache. Compiled for sm90 on the CPU: Triton needs no GPU to compile."""

from __future__ import annotations

import json
import os

import triton
import triton.language as tl
from kernel_cache import entry, listed_ranks, warm_in_background, warming_order
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature, get_full_name, serialize_specialization_data

import tritonep  # noqa: F401 - the kernels' package is importable where the tests run

TARGET = GPUTarget("cuda", 90, 32)


@triton.jit
def scaled_copy(src, dst, count, factor, BLOCK: tl.constexpr, SCALE: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    values = tl.load(src + offsets, mask=offsets < count)
    if SCALE:
        values = values * factor
    tl.store(dst + offsets, values, mask=offsets < count)


def jit_inputs(kernel, *args, **kwargs) -> tuple[ASTSource, dict, str]:
    """What Triton's JIT makes of a launch on an sm90 GPU, done as its ``run`` does: the source
    and options it compiles, and the specialisation data its compile hooks are given."""
    import torch
    from triton import knobs

    kwargs = dict(kwargs, debug=kernel.debug or knobs.runtime.debug,
                  instrumentation_mode=knobs.compilation.instrumentation_mode)
    backend = make_backend(TARGET)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    args = [torch.empty(64, dtype=torch.float32) if arg == "tensor" else arg for arg in args]
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    data = serialize_specialization_data(get_full_name(kernel.fn), signature, constexprs, attrs, options,
                                         (str(specialization), str(options)))
    return ASTSource(kernel, signature, constexprs, attrs), options.__dict__, data


def _cached_files(directory) -> set[str]:
    return {str(path.relative_to(directory)) for path in directory.rglob("*") if path.is_file()}


def test_listed_kernels_are_what_the_jit_finds_in_the_cache(tmp_path, monkeypatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))   # the warming processes inherit it
    source, options, data = jit_inputs(scaled_copy, "tensor", "tensor", 1000, 0.5, BLOCK=128, SCALE=True,
                                       num_warps=4)
    line = entry(TARGET, data)
    other = line.replace('"name": "test_kernel_cache.scaled_copy"', '"name": "test_kernel_cache.gone"')
    kernel_list = tmp_path / "gpu_kernels.jsonl"
    kernel_list.write_text("\n".join([line, line, other]) + "\n")   # a repeat, and a kernel since removed
    warming = warm_in_background(kernel_list, workers=2)
    assert warming.wait().startswith("kernel list: the tests waited ")   # (TRITONEP_TEST_WAIT_FOR_KERNELS=1)
    assert all(future.done() for future in warming.futures)
    assert warming.stop() == "kernel list: 1 of 2 kernels compiled ahead on 2 processes, 1 no longer accepted"
    compiled = _cached_files(cache)
    assert any(name.endswith(".cubin") for name in compiled), compiled
    # What the JIT compiles for that launch is now a cache hit: nothing new is written.
    triton.compile(source, target=TARGET, options=options)
    assert _cached_files(cache) == compiled
    # Another specialisation (SCALE off) is not in the list: compiled anew.
    source, options, _ = jit_inputs(scaled_copy, "tensor", "tensor", 1000, 0.5, BLOCK=128, SCALE=False,
                                    num_warps=4)
    triton.compile(source, target=TARGET, options=options)
    assert _cached_files(cache) > compiled
    assert os.environ["TRITON_CACHE_DIR"] == str(cache)


def test_warming_takes_the_sessions_rank_count_first() -> None:
    def line(name: str, num_ranks: int | None) -> str:
        names = ["x_ptr", "n"] + ([] if num_ranks is None else ["NUM_RANKS"])
        data = {"name": name, "signature": {n: "constexpr" if n == "NUM_RANKS" else "i32" for n in names},
                "constant_keys": [[2]] if num_ranks is not None else [], "constant_vals":
                [{"constexpr": num_ranks}] if num_ranks is not None else [], "attrs_keys": [], "attrs_vals": []}
        return json.dumps({"target": ["cuda", 90, 32], "kernel": data})

    four, two, plain, four_again = line("a", 4), line("b", 2), line("c", None), line("d", 4)
    assert [listed_ranks(x) for x in (four, two, plain)] == [4, 2, None]
    lines = [four, two, plain, four, four_again]
    assert warming_order(lines, 2) == [two, plain, four, four_again]
    assert warming_order(lines, 4) == [four, plain, four_again, two]
    assert warming_order(lines, None) == [four, two, plain, four_again]
