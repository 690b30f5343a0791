"""One dispatch/combine case run twice, NVLink backend vs CPU backend, compared.

Run on every rank of a RankPool, many cases per run (``compare_cases``). The NVLink side runs
on the pool's own group: NCCL with one GPU per rank, or gloo with CPU tensors under
``TRITON_INTERPRET=1`` (the same kernels in Triton's interpreter). The oracle is always the CPU
backend on a gloo group of its own over CPU copies of the same inputs, computed a case ahead in
a thread (case_batches.py); the comparison runs where the NVLink side's results are. Dispatch
must match bit for bit (rows, scales, ids, weights, counts, prefix matrix), and combine as far
as its rounding allows (``combine_rounding``): exactly on the GPU without a bias.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from case_batches import oracle_group, run_batch
from deep_ep_user import identity_combine

import tritonep as deep_ep
from tritonep import utils
from tritonep.core.replay import Replay, ReplayTable

_state: dict = {}


@dataclass
class Case:
    seed: int
    tokens: tuple[int, ...]        # tokens per rank
    hidden: int
    num_experts: int
    num_topk: int
    fp8: bool = False
    num_worst_tokens: int = 0
    expert_alignment: int = 1
    bias: bool = False
    routing: str = "random"        # random | skewed | one_rank | none
    column_major_scales: bool = False
    num_sms: int = 8
    # The cached dispatch and the combine are each made this many times with the handle, on
    # inputs scaled by powers of two (exactly, in bf16 and in fp8 scales); from the second call
    # on, the NVLink backend repeats the learnt launches (normal_repeat.py).
    repeats: int = 1


@contextlib.contextmanager
def environment(settings: dict[str, str]) -> Iterator[None]:
    """``settings`` in ``os.environ`` inside the block; each variable as it was after."""
    previous = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


def make_buffer(group: dist.ProcessGroup, backend: str, env: dict[str, str] | None = None,
               **kwargs) -> deep_ep.Buffer:
    """A Buffer on ``backend`` (``TRITONEP_BACKEND``), with ``env`` set while it is built."""
    with environment({"TRITONEP_BACKEND": backend, **(env or {})}):
        return deep_ep.Buffer(group, **kwargs)


def shared_buffers(group: dist.ProcessGroup, nvl_bytes: int) -> tuple[deep_ep.Buffer, deep_ep.Buffer]:
    """Build (once per pool) the NVLink buffer and a CPU-backend buffer on the oracle's gloo group."""
    if "nvlink" not in _state or _state["nvl_bytes"] < nvl_bytes:
        _state.pop("nvlink", None)   # the old Buffer's memory goes before the new one is made
        _state["nvlink"] = make_buffer(group, "nvlink", num_nvl_bytes=nvl_bytes)
        _state["nvl_bytes"] = nvl_bytes
        if "cpu" not in _state:
            _state["cpu"] = make_buffer(oracle_group(group), "collective")
    return _state["nvlink"], _state["cpu"]


def release_buffers(group: dist.ProcessGroup) -> None:
    """Drop the Buffers ``shared_buffers`` keeps on this rank (the next call makes new ones)."""
    _state.clear()


def make_inputs(case: Case, rank: int, num_ranks: int) -> dict:
    generator = torch.Generator().manual_seed(case.seed * 1000 + rank)
    n, k, e = case.tokens[rank], case.num_topk, case.num_experts
    # dtype and device explicit: GPU runs may set other torch defaults (tests/torch_defaults.py).
    cpu32 = dict(generator=generator, dtype=torch.float32, device="cpu")
    x = torch.randn(n, case.hidden, **cpu32).to(torch.bfloat16)
    scores = torch.rand(n, e, **cpu32)
    if case.routing == "skewed":
        scores[:, : max(1, e // 8)] += 2.0          # most tokens prefer the first rank's experts
    elif case.routing == "one_rank":
        scores[:, e // num_ranks:] = -1.0           # every expert choice lands on rank 0
    topk_idx = scores.topk(k, dim=1).indices
    if case.routing == "none":
        topk_idx.fill_(-1)
    else:
        topk_idx[torch.rand(n, k, **cpu32) < 0.1] = -1
    inputs = {"x": x, "topk_idx": topk_idx, "topk_weights": torch.rand(n, k, **cpu32)}
    # Cast once, on the CPU: both backends must then move identical fp8 bytes and scales.
    inputs["dispatch_x"] = utils.per_token_cast_to_fp8(x) if case.fp8 else x
    if case.fp8 and case.column_major_scales:
        data, scales = inputs["dispatch_x"]
        inputs["dispatch_x"] = (data, scales.t().contiguous().t())   # same values, strides (1, N)
    if case.bias:
        inputs["bias"] = torch.randn(n, case.hidden, **cpu32).to(torch.bfloat16)
    return inputs


def _run(buffer: deep_ep.Buffer, case: Case, inputs: dict, device: torch.device) -> dict:
    topk_idx, topk_weights = inputs["topk_idx"].to(device), inputs["topk_weights"].to(device)
    per_rank, per_node, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, case.num_experts)
    dispatch_x = _to_device(inputs["dispatch_x"], device)
    config = deep_ep.Config(case.num_sms)
    recv_x, recv_idx, recv_weights, per_expert_list, handle, _ = buffer.dispatch(
        dispatch_x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        topk_idx=topk_idx, topk_weights=topk_weights, expert_alignment=case.expert_alignment,
        num_worst_tokens=case.num_worst_tokens, config=config)
    real = int(handle.rank_prefix_matrix[-1, buffer.rank])
    result = {
        "layout": (per_rank, per_expert, in_rank),
        "recv_x": [t[:real] for t in recv_x] if case.fp8 else recv_x[:real],
        "recv_idx": recv_idx, "recv_weights": recv_weights, "per_expert": per_expert_list,
        "prefix": handle.rank_prefix_matrix,
    }
    for call in range(case.repeats):
        cached_x = buffer.dispatch(_scaled(dispatch_x, 2.0 ** call), handle=handle, config=config)[0]
        result[f"cached_x{call or ''}"] = [t[:real] for t in cached_x] if case.fp8 else cached_x[:real]
    # The experts' output: the rows received (dequantised), halved, then halved again per call.
    # Powers of two scale bf16 exactly, so the bf16 product is the float32 one rounded.
    rows = utils.per_token_cast_back(*recv_x) if case.fp8 else recv_x
    bias = inputs["bias"].to(device) if case.bias else None
    for call in range(case.repeats):
        combined, combined_weights, _ = buffer.combine(rows * 2.0 ** -(call + 1), handle,
                                                       topk_weights=recv_weights, bias=bias, config=config)
        result[f"combined{call or ''}"], result[f"combined_weights{call or ''}"] = combined, combined_weights
    return result


def _scaled(x: torch.Tensor | tuple[torch.Tensor, torch.Tensor], factor: float) -> object:
    """``x`` times ``factor`` (a power of two: exact); fp8 data keeps its bytes, its scales
    (strides kept) are scaled."""
    if factor == 1.0:
        return x
    if isinstance(x, tuple):
        return x[0], x[1] * factor
    return x * factor


@contextlib.contextmanager
def count_replays() -> Iterator[dict[str, int]]:
    """Count, in this thread (an oracle thread may run CPU-backend calls beside it), the calls
    that replays served (a replay that returns None sends its call to the general path and is
    not counted), by the replay key's kind: "cached_dispatch" and "combine" (a handle's table,
    V1's or V2's), "low_latency" (a Buffer's)."""
    taken = {"cached_dispatch": 0, "combine": 0, "low_latency": 0}
    learn = ReplayTable.learn
    counting_thread = threading.get_ident()

    class Counted:
        """The replay, counting the calls it serves; its attributes are the replay's (a
        low-latency replay is completed by later general calls)."""

        def __init__(self, replay: Replay, kind: str) -> None:
            self.replay, self.kind = replay, kind

        def __call__(self, *args: object) -> object:
            result = self.replay(*args)
            taken[self.kind] += result is not None
            return result

        def __getattr__(self, name: str) -> object:
            return getattr(self.replay, name)

    def counting_learn(table: ReplayTable, key: Hashable, replay: Replay | None) -> None:
        if replay is not None and not isinstance(replay, Counted) and threading.get_ident() == counting_thread:
            # ElasticBuffer keys the same kinds as "v2_cached_dispatch", "v2_combine".
            replay = Counted(replay, key[0].removeprefix("v2_") if isinstance(key[0], str) else "low_latency")
        learn(table, key, replay)

    ReplayTable.learn = counting_learn   # type: ignore[method-assign]
    try:
        yield taken
    finally:
        ReplayTable.learn = learn   # type: ignore[method-assign]


def _to_device(value, device: torch.device):
    """Moves keep strides (a column-major scales tensor stays column-major)."""
    if isinstance(value, tuple):
        return tuple(v.t().to(device).t() if v.dim() == 2 and v.stride(0) == 1 and v.shape[1] > 1 else v.to(device)
                     for v in value)
    return value.to(device)


def to_device(value, device: torch.device):
    """Tensors in ``value`` (nested lists, tuples and dicts) moved to ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value


def combine_rounding(device: torch.device, bias: bool) -> tuple[int, int]:
    """(toward zero, away from zero): how many bf16 steps an NVLink combine's rows may lie from
    the CPU backend's, which rounds the float32 sum of each token's terms to nearest even.

    Both backends sum a token's copies in float32 and round once to bf16. Without a bias the
    copies are one bf16 value v (every rank sends back the row it received), and n * v is exact
    in float32 in any order. With a bias the additions may round, by their order, which neither
    backend promises (the kernel adds the bias, then ranks 0..R-1; the CPU backend the bias,
    then index_add_ in send order): sums of bf16 terms round in float32 only where the terms are
    some 2**13 apart in magnitude, and then by float32 ulps of a sum the largest term dominates,
    one bf16 step at most. On the GPU the kernel rounds to nearest even, as torch does. Triton's
    interpreter casts float32 to bf16 by truncating: there a result is the CPU backend's or one
    step nearer zero, with a bias too (truncating a sum a few float32 ulps from another never
    lands beyond the other's nearest bf16 value, nor more than one step short of it).
    """
    if device.type != "cuda":
        return 1, 0
    return (1, 1) if bias else (0, 0)


def _bf16_order(values: torch.Tensor) -> torch.Tensor:
    """bf16 ``values`` as int32 numbers in the same order, neighbouring bf16 values one apart
    (the bits are sign and magnitude; both zeros become 0)."""
    bits = values.view(torch.int16).to(torch.int32)
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def bf16_mismatch(got: torch.Tensor, expected: torch.Tensor, rounding: tuple[int, int]) -> str:
    """"" if bf16 ``got`` lies from ``expected`` at most ``rounding`` = (toward zero, away from
    zero) steps in each value, else what is wrong."""
    if got.shape != expected.shape:
        return f"got {tuple(got.shape)} expected {tuple(expected.shape)}"
    if torch.equal(got, expected):   # the common case, in one pass
        return ""
    got_order, expected_order = _bf16_order(got), _bf16_order(expected)
    # Steps from expected toward zero (negative: away from it); from 0 every step is away.
    toward_zero = torch.where(expected_order == 0, -got_order.abs(),
                              (expected_order - got_order) * expected_order.sign())
    toward, away = rounding
    if bool(((toward_zero <= toward) & (toward_zero >= -away)).all()):
        return ""
    nearer, farther = max(int(toward_zero.max()), 0), max(int(-toward_zero.min()), 0)
    return f"up to {nearer} bf16 steps nearer zero and {farther} farther than expected ({toward} and {away} allowed)"


def _mismatches(name: str, got, expected, rounding: tuple[int, int] = (0, 0)) -> list[str]:
    """Equal (bytes for fp8), or bf16 values at most ``rounding`` steps apart (``bf16_mismatch``)."""
    if isinstance(expected, torch.Tensor):
        if rounding != (0, 0):
            mismatch = bf16_mismatch(got, expected, rounding)
            return [f"{name}: {mismatch}"] if mismatch else []
        if got.shape != expected.shape:
            return [f"{name}: got {tuple(got.shape)} expected {tuple(expected.shape)}"]
        got, expected = (t.view(torch.uint8) if t.dtype.itemsize == 1 else t for t in (got, expected))
        if torch.equal(got, expected):
            return []
        return [f"{name}: {int((got != expected).sum())} of {expected.numel()} values differ"]
    if isinstance(expected, (list, tuple)) and expected and isinstance(expected[0], torch.Tensor):
        return [m for i, (g, e) in enumerate(zip(got, expected)) for m in _mismatches(f"{name}[{i}]", g, e, rounding)]
    return [] if got == expected else [f"{name}: got {got} expected {expected}"]


def compare_cases(group: dist.ProcessGroup, cases: list[Case], nvl_bytes: int = 1 << 24,
                  tuning: dict | None = None) -> tuple[list[list[str]], list[dict]]:
    """The mismatches on this rank of each case (empty when the backends agree), and each
    case's timings (``case_batches.run_batch``). ``tuning``: changes to the NVLink backend's
    ``Tuning`` for these cases (kernel shapes, paths)."""
    nvlink, cpu = shared_buffers(group, nvl_bytes)

    def compare(case: Case, oracle_result: tuple[dict, dict]) -> list[str]:
        default = nvlink.backend.tuning
        nvlink.backend.tuning = dataclasses.replace(default, **(tuning or {}))
        try:
            with count_replays() as taken:
                problems = run_and_compare(nvlink, case, oracle_result)
        finally:
            nvlink.backend.tuning = default
        problems += copy_tails_left(nvlink)
        # On the GPUs every call after the first of each kind repeats (the interpreter learns none).
        wanted = {"cached_dispatch": case.repeats - 1,
                  "combine": case.repeats - 1 if not case.bias else 0, "low_latency": 0}
        if nvlink.device.type == "cuda" and taken != wanted:
            problems.append(f"replays taken {taken}, expected {wanted}")
        return problems

    return run_batch(group, cases, cpu_oracle(cpu, group), compare)


def compare_case(group: dist.ProcessGroup, case: Case, nvl_bytes: int = 1 << 24,
                 tuning: dict | None = None) -> list[str]:
    """``compare_cases`` for one case: its mismatches on this rank."""
    return compare_cases(group, [case], nvl_bytes, tuning)[0][0]


def copy_tails_left(buffer: deep_ep.Buffer) -> list[str]:
    """What this rank's copy-engine combine tail words and finish count hold once its combines
    are done (its outputs read back): they must be back at 0, or the next combine's reducers
    would take the old row counts for rows already there. No peer writes them before this rank's
    next call: a peer's next copies wait for this rank's release of its reduction."""
    if buffer.device.type == "cuda":
        torch.cuda.synchronize()
    memory = buffer.backend.memory
    first = memory.signals.combine_copy_tail
    words = memory.signal_words()[first: memory.signals.combine_copy_finished + 1].tolist()
    return [f"copy-engine tail words and finish count left at {words}"] if any(words) else []


def cpu_oracle(cpu: deep_ep.Buffer, group: dist.ProcessGroup) -> Callable[[Case], tuple[dict, dict]]:
    """``run_batch``'s oracle on this rank of ``group``: a case's inputs (``make_inputs``) and
    the CPU backend's results on them, from ``cpu`` (a Buffer on ``oracle_group``)."""
    rank, num_ranks = group.rank(), group.size()

    def oracle(case: Case) -> tuple[dict, dict]:
        inputs = make_inputs(case, rank, num_ranks)
        return inputs, _run(cpu, case, inputs, torch.device("cpu"))

    return oracle


def run_and_compare(buffer: deep_ep.Buffer, case: Case, oracle_result: tuple[dict, dict]) -> list[str]:
    """The case's calls on ``buffer`` with the oracle's inputs, compared with the oracle's
    results (``cpu_oracle``): the mismatches on this rank."""
    inputs, expected = oracle_result
    got = _run(buffer, case, inputs, buffer.device)
    return _case_mismatches(case, got, to_device(expected, buffer.device), buffer.device)


def _case_mismatches(case: Case, got: dict, expected: dict, device: torch.device) -> list[str]:
    """What of ``got`` (the results on ``device``) differs from ``expected`` (the CPU backend's,
    moved there): everything bit for bit, combined rows within ``combine_rounding``."""
    # combined_weights: each slot is summed from recv_weights, which are 0 on every rank but
    # the one with the slot's expert, so both backends give the weight itself, exactly.
    rounding = combine_rounding(device, case.bias)
    return [m for key in expected for m in _mismatches(
        key, got[key], expected[key], rounding if key.startswith("combined") and "weights" not in key else (0, 0))]


def round_trip(buffer: deep_ep.Buffer, num_tokens: int, hidden: int, seed: int, routing: str = "random",
                topk_idx: torch.Tensor | None = None) -> tuple[torch.Tensor, bool]:
    """A fresh dispatch of bf16 rows (``make_inputs``: top-2 of 4 experts per rank, ``routing``)
    and a combine of the rows as received: every rank a token reached returns it unchanged, so
    the combined row must be the token times the number of ranks its experts are on (counted
    from ``topk_idx`` on the CPU, not from the buffer's layout, which a dispatch and combine
    wrong alike would match). Returns (recv_x, whether it was, as exactly as the combine
    rounds). ``topk_idx`` overrides the routing."""
    R, device = buffer.group_size, buffer.device
    # make_inputs reads only this rank's entry of ``tokens`` (ranks may pass different counts).
    case = Case(seed=seed, tokens=(num_tokens,) * R, hidden=hidden, num_experts=4 * R, num_topk=2, routing=routing)
    inputs = make_inputs(case, buffer.rank, R)
    x, topk_weights = inputs["x"].to(device), inputs["topk_weights"].to(device)
    if topk_idx is None:
        topk_idx = inputs["topk_idx"].to(device)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, case.num_experts)
    recv_x, _, _, _, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=topk_idx, topk_weights=topk_weights, config=deep_ep.Config(4))
    combined = buffer.combine(recv_x, handle, config=deep_ep.Config(4))[0]
    expected = identity_combine(inputs["x"], topk_idx, case.num_experts, R)
    return recv_x, not bf16_mismatch(combined.cpu(), expected, combine_rounding(device, bias=False))
