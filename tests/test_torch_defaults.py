"""Nothing in tritonep may depend on torch's default device or dtype.

Callers (DeepEP's tests, serving stacks) run ``torch.set_default_device('cuda')`` and
``torch.set_default_dtype(torch.bfloat16)`` before building a Buffer. Checked three ways:

* statically: every tensor factory call in ``tritonep/`` names its device and dtype;
* by running: Buffer calls in rank workers whose default device is ``meta`` and default dtype
  bf16 must give the same results as under torch's defaults. A tensor made on the default
  device lands on ``meta`` there, and mixing it with real tensors or reading it raises, so the
  CPU tests catch what ``set_default_device('cuda')`` breaks on GPUs (pinned host words made
  without ``device="cpu"``, host copies of counts, ...). The NVLink backend runs under Triton's
  interpreter, through the same case code its GPU tests use. Buffer's calls and hooks run with
  torch-function handling off (buffer._without_torch_function), which also switches the
  default-device mode off inside them: there the run checks the results and the scan above
  the code; the constructor, which runs with the mode on, is checked by both;
* DeepEP's ``utils`` helpers give the same results under those defaults.
"""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch
from low_latency_cases import LowLatencyCase, compare_low_latency
from nvlink_cases import Case, compare_case
from torch_defaults import pool_options, torch_defaults

import tritonep as deep_ep
from tritonep import utils
from tritonep.core import fp8
from tritonep.rank_pool import RankPool

LIBRARY = pathlib.Path(deep_ep.__file__).parent
FACTORIES = {"tensor", "as_tensor", "asarray", "scalar_tensor", "empty", "empty_strided", "zeros", "ones", "full",
             "arange", "range", "linspace", "logspace", "eye", "rand", "randn", "randint", "randperm"}
LEGACY_CONSTRUCTORS = {"Tensor", "FloatTensor", "DoubleTensor", "HalfTensor", "BFloat16Tensor", "LongTensor",
                       "IntTensor", "ShortTensor", "ByteTensor", "CharTensor", "BoolTensor"}


def _torch_calls(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
            yield node


def test_library_factory_calls_name_device_and_dtype() -> None:
    problems = []
    for path in sorted(LIBRARY.rglob("*.py")):
        where = path.relative_to(LIBRARY.parent)
        for call in _torch_calls(path):
            keywords = {k.arg: k.value for k in call.keywords}
            name = call.func.attr
            if name in LEGACY_CONSTRUCTORS:
                problems.append(f"{where}:{call.lineno}: torch.{name}(...) follows the default device")
            if name not in FACTORIES or None in keywords:   # **kwargs: checked where they are built
                continue
            missing = [k for k in ("device", "dtype") if k not in keywords]
            if missing:
                problems.append(f"{where}:{call.lineno}: torch.{name}(...) without {' and '.join(missing)}")
            pinned = keywords.get("pin_memory")
            device = keywords.get("device")
            if pinned is not None and not (isinstance(device, ast.Constant) and device.value == "cpu"):
                problems.append(f"{where}:{call.lineno}: a pinned tensor must say device=\"cpu\"")
    assert not problems, "\n".join(problems)


def test_element_sizes_do_not_allocate() -> None:
    """``torch.empty((), dtype=d).element_size()`` follows the default device: use ``d.itemsize``."""
    offenders = [f"{path.relative_to(LIBRARY.parent)}:{call.lineno}"
                 for path in sorted(LIBRARY.rglob("*.py")) for call in _torch_calls(path)
                 if call.func.attr == "empty" and call.args and isinstance(call.args[0], ast.Tuple)
                 and not call.args[0].elts]
    assert not offenders, offenders


# ----------------------------------------------------------------------------- in rank workers
def under_defaults(group, dtype_name: str, device: str, fn, *args):
    """Run ``fn(group, *args)`` with torch's default dtype and device changed, then restore them."""
    with torch_defaults(getattr(torch, dtype_name), device):
        assert torch.get_default_dtype() == getattr(torch, dtype_name)
        assert torch.get_default_device().type == device
        return fn(group, *args)


def collective_flow(group) -> dict:
    """Most of the Buffer API on the collective backend; every result as a CPU tensor or list."""
    R, rank = group.size(), group.rank()
    E, N, H, K, T = 4 * R, 12, 512, 3, 12
    generator = torch.Generator().manual_seed(11 + rank)
    cpu32 = dict(generator=generator, dtype=torch.float32, device="cpu")
    x = torch.randn(N, H, **cpu32).to(torch.bfloat16)
    topk_idx = torch.rand(N, E, **cpu32).topk(K, dim=1).indices
    topk_idx[0, 0] = -1
    weights = torch.rand(N, K, **cpu32)
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, R, E)
    # DeepEP V1's positional order, as a user's call would give it.
    buffer = deep_ep.Buffer(group, 1 << 20, rdma, True, 2, True, False, False, True, False, None)
    out: dict = {}
    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
    assert per_rdma is None
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=weights,
                                                                  expert_alignment=4, **layout)
    out.update(layout=(per_rank, per_expert, in_rank), recv=(recv_x, recv_idx, recv_w), counts=counts,
               prefix=handle.rank_prefix_matrix)
    fp8_x = utils.per_token_cast_to_fp8(x)
    recv_fp8, *_ = buffer.dispatch(fp8_x, handle=handle)
    out["cached_fp8"] = recv_fp8
    worst = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=weights, num_worst_tokens=N * R, **layout)
    out["worst"] = worst[:4]
    combined, combined_w, _ = buffer.combine(recv_x, handle, topk_weights=recv_w, bias=(x, x))
    out["combined"] = (combined, combined_w)
    for use_fp8, round_scale, use_ue8m0 in ((True, False, False), (True, True, True), (False, False, False)):
        stats = torch.zeros(E // R, dtype=torch.int32, device="cpu")
        packed, count, ll_handle, _, hook = buffer.low_latency_dispatch(
            x, topk_idx, T, E, cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8, round_scale=round_scale,
            use_ue8m0=use_ue8m0, return_recv_hook=True)
        hook()
        # Rows past each expert's count are not written: compare the valid ones only.
        valid = torch.arange(R * T, dtype=torch.int64, device="cpu")[None, :] < count[:, None]
        data, scales = packed if use_fp8 else (packed, None)
        valid_rows = [data[valid].view(torch.uint8)] + ([] if scales is None else [scales[valid]])
        out[f"ll_dispatch_{use_fp8}_{use_ue8m0}"] = (valid_rows, count, ll_handle[0], ll_handle[1], stats)
    rows = packed.float().mul(0.5).to(torch.bfloat16)
    out["ll_combine"] = buffer.low_latency_combine(rows, topk_idx, weights, ll_handle)[0]
    buffer.get_next_low_latency_combine_buffer(ll_handle).copy_(rows)
    out["ll_combine_zero_copy"] = buffer.low_latency_combine(rows, topk_idx, weights, ll_handle, zero_copy=True)[0]
    assert torch.equal(out["ll_combine"], out["ll_combine_zero_copy"])
    view = buffer.get_local_buffer_tensor(torch.float32, torch.Size((4, 8)), offset=64)
    view.fill_(rank + 0.5)
    out["local_view"] = buffer.get_local_buffer_tensor(torch.float32, torch.Size((4, 8)), offset=64)
    buffer.destroy()
    return _to_cpu(out)


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.to("cpu", copy=True)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def _same(a, b, where: str = "") -> list[str]:
    if isinstance(a, torch.Tensor):
        ok = (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
              and torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a,
                              b.view(torch.uint8) if b.dtype.itemsize == 1 else b))
        return [] if ok else [f"{where}: {a.dtype} {tuple(a.shape)} vs {getattr(b, 'dtype', b)}"]
    if isinstance(a, dict):
        return [m for k in a for m in _same(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: lengths {len(a)} vs {len(b)}"]
        return [m for i, (x, y) in enumerate(zip(a, b)) for m in _same(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"]


@pytest.fixture(scope="module")
def pair():
    with RankPool(2, timeout=300, **pool_options()) as pool:
        yield pool


def test_collective_backend_same_results_under_meta_device_and_bf16(pair: RankPool) -> None:
    plain = pair.run(collective_flow)
    changed = pair.run(under_defaults, "bfloat16", "meta", collective_flow)
    for rank, (a, b) in enumerate(zip(plain, changed)):
        assert not _same(a, b, f"rank {rank}"), _same(a, b, f"rank {rank}")


def test_collective_backend_under_float64_default(pair: RankPool) -> None:
    plain = pair.run(collective_flow)
    changed = pair.run(under_defaults, "float64", "cpu", collective_flow)
    for rank, (a, b) in enumerate(zip(plain, changed)):
        assert not _same(a, b, f"rank {rank}"), _same(a, b, f"rank {rank}")


def test_nvlink_backend_normal_mode_under_meta_device_and_bf16(interpreter_pools) -> None:
    """The case code of the GPU tests, on the NVLink kernels in Triton's interpreter; both the
    NVLink Buffer and its CPU-backend oracle are built under the changed defaults."""
    case = Case(seed=41, tokens=(9, 6), hidden=256, num_experts=8, num_topk=3, fp8=True, num_worst_tokens=20,
                bias=True, column_major_scales=True)
    problems = interpreter_pools(2).run(under_defaults, "bfloat16", "meta", compare_case, case)
    assert all(not p for p in problems), problems
    case = Case(seed=42, tokens=(7, 5), hidden=128, num_experts=4, num_topk=2, expert_alignment=4)
    problems = interpreter_pools(2).run(under_defaults, "bfloat16", "meta", compare_case, case)
    assert all(not p for p in problems), problems


def test_nvlink_backend_low_latency_under_meta_device_and_bf16(interpreter_pools) -> None:
    for case in (LowLatencyCase(seed=43, tokens=(6, 4), T=6, hidden=512, num_experts=4, num_topk=2, round_scale=True,
                                use_ue8m0=True, hook=True, zero_copy=True),
                 LowLatencyCase(seed=44, tokens=(5, 6), T=6, hidden=256, num_experts=4, num_topk=3, use_fp8=False,
                                use_out=True, calls=2)):
        problems = interpreter_pools(2).run(under_defaults, "bfloat16", "meta", compare_low_latency, case)
        assert all(not p for p in problems), (case, problems)


# ----------------------------------------------------------------------------- utils, in this process
def _utils_results() -> dict:
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(6, 512, generator=generator, dtype=torch.float32, device="cpu").to(torch.bfloat16)
    fp8_x, scales = utils.per_token_cast_to_fp8(x)
    ids = torch.tensor([[3, 1, 3, -1], [0, 0, 2, 3]], dtype=torch.int64, device="cpu")
    utils.inplace_unique(ids, 4)
    return {"fp8": fp8_x, "scales": scales, "back": utils.per_token_cast_back(fp8_x, scales),
            "back_ue8m0": utils.per_token_cast_back(*fp8.cast_to_fp8(x, round_scale=True, use_ue8m0=True)),
            "empty_back": utils.per_token_cast_back(fp8_x[:0], scales[:0]),
            "diff": utils.calc_diff(x, utils.per_token_cast_back(fp8_x, scales)),
            "unique": ids, "hash": utils.hash_tensor(x)}


@pytest.mark.parametrize("dtype,device", [(torch.bfloat16, "meta"), (torch.float16, "cpu"), (torch.float64, "meta")])
def test_utils_helpers_same_results_under_other_defaults(dtype: torch.dtype, device: str) -> None:
    plain = _utils_results()
    with torch_defaults(dtype, device):
        changed = _utils_results()
        average, low, high = utils.bench(lambda: None, num_warmups=1, num_tests=3)
    assert not _same(plain, changed), _same(plain, changed)
    assert changed["scales"].dtype == torch.float32 and changed["back"].dtype == torch.bfloat16
    assert 0 <= low <= average <= high
