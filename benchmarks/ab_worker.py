"""The one-rank A/B (``ab.py``) in a process of its own: both packages, their calls interleaved.

    python -m benchmarks.ab_worker --baseline DIR --rounds N --json PATH [shape options]

It imports this checkout's tritonep and, under another name, the one in ``DIR`` (the folder that
holds ``tritonep/``): a copy of that package named ``tritonep_baseline`` whose import statements
name it so (the package imports its own modules by absolute name: loaded as it is, the baseline
would run this checkout's modules). It makes a one-rank process group (NCCL on GPU 0, gloo with
``--cpu``) and measures each call of each package through the public API only (``Buffer``, ``Config``,
``Buffer.get_low_latency_rdma_size_hint``, ``utils``): GPU time (``timing.median_us``: one call
at a time, L2 flushed, median) and host CPU time per call (back to back). The two packages take
turns call shape by call shape and round by round, in one process on one core: a host's speed
drifts by tens of per cent within minutes and between processes, which a comparison of two
processes measured minutes apart cannot tell from a change of the code.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable

import torch
import torch.distributed as dist

from . import inputs, timing

# An import statement of the package itself: ``from tritonep...`` / ``import tritonep...``.
_OWN_IMPORT = re.compile(r"^(\s*)(from|import)\s+tritonep(?=[\s.])", re.MULTILINE)
BASELINE_NAME = "tritonep_baseline"


def copy_as_baseline(baseline: str, folder: str) -> str:
    """``baseline``'s tritonep copied to ``folder`` as the package ``tritonep_baseline``, its
    import statements renamed (line for line, so Triton reads its kernels' source as written)."""
    target = os.path.join(folder, BASELINE_NAME)
    shutil.copytree(os.path.join(os.path.realpath(baseline), "tritonep"), target,
                    ignore=shutil.ignore_patterns("__pycache__"))
    for directory, _, files in os.walk(target):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                with open(path) as f:
                    source = f.read()
                with open(path, "w") as f:
                    f.write(_OWN_IMPORT.sub(rf"\1\2 {BASELINE_NAME}", source))
    return target


def import_both(baseline: str, link_folder: str) -> dict[str, object]:
    """{"new": this checkout's tritonep, "baseline": the one in ``baseline``, as ``tritonep_baseline``},
    each checked to come from where it should."""
    checkout = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    sys.path.insert(0, checkout)
    copy = copy_as_baseline(baseline, link_folder)
    sys.path.insert(0, link_folder)
    packages = {"new": importlib.import_module("tritonep"), "baseline": importlib.import_module(BASELINE_NAME)}
    for which, root in (("new", checkout), ("baseline", link_folder)):
        found = os.path.dirname(os.path.dirname(os.path.realpath(packages[which].__file__)))
        if found != os.path.realpath(root):
            raise RuntimeError(f"the {which} tritonep came from {found}, not from {root}")
    for name, module in list(sys.modules.items()):
        if name.startswith(BASELINE_NAME) and not os.path.realpath(module.__file__).startswith(os.path.realpath(copy)):
            raise RuntimeError(f"the baseline's module {name} came from {module.__file__}")
    return packages


def check_origin(package: object, buffers: list) -> None:
    """Each Buffer, and the backend it made (imported when the first Buffer is built), is
    ``package``'s own code."""
    for buffer in buffers:
        for item in (buffer, buffer.backend):
            if not type(item).__module__.startswith(package.__name__ + "."):
                raise RuntimeError(f"a {package.__name__} Buffer runs {type(item).__module__}")


def one_rank_group(gpu: bool) -> dist.ProcessGroup:
    """A one-rank process group made in this process: NCCL on GPU 0, or gloo."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    device = {"device_id": torch.device("cuda", 0)} if gpu else {}
    if gpu:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if gpu else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            **device)
    return dist.group.WORLD


def calls(tritonep: object, group: dist.ProcessGroup, args: argparse.Namespace,
          device: torch.device) -> tuple[dict[str, Callable[[], object]], list]:
    """The calls the A/B times, by row name, and the Buffers they use (to destroy)."""
    N, H, E, K = args.tokens, args.hidden, args.experts, args.topk
    T, E_LL = args.ll_tokens, args.ll_experts
    x, topk_idx, topk_weights = inputs.routing(N, H, E, K, 0, device)
    normal = tritonep.Buffer(group, inputs.nvl_bytes(N, H, 1), explicitly_destroy=True)
    config = tritonep.Config(args.num_sms)
    per_rank, _, per_expert, in_rank, _ = normal.get_dispatch_layout(topk_idx, E)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)

    def fresh() -> object:
        return normal.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, config=config, **layout)

    recv_x, _, _, _, handle, _ = fresh()
    x_fp8 = tritonep.utils.per_token_cast_to_fp8(x)
    decode = tritonep.Buffer(group, 0, tritonep.Buffer.get_low_latency_rdma_size_hint(T, H, 1, E_LL),
                             low_latency_mode=True, explicitly_destroy=True)
    x_ll, idx_ll, weights_ll = inputs.decode_batch(T, H, E_LL, K, 0, device)
    packed, _, ll_handle, _, _ = decode.low_latency_dispatch(x_ll, idx_ll, T, E_LL)
    expert_out = inputs.expert_output(packed[0].shape, 0, device)
    table = {
        "layout": lambda: normal.get_dispatch_layout(topk_idx, E),
        "fresh dispatch": fresh,
        "cached dispatch bf16": lambda: normal.dispatch(x, handle=handle, config=config),
        "cached dispatch fp8": lambda: normal.dispatch(x_fp8, handle=handle, config=config),
        "combine": lambda: normal.combine(recv_x, handle, config=config),
        "low-latency dispatch": lambda: decode.low_latency_dispatch(x_ll, idx_ll, T, E_LL),
        "low-latency dispatch, hook": lambda: decode.low_latency_dispatch(x_ll, idx_ll, T, E_LL,
                                                                           return_recv_hook=True)[4](),
        "low-latency combine": lambda: decode.low_latency_combine(expert_out, idx_ll, weights_ll, ll_handle),
        "low-latency combine, hook": lambda: decode.low_latency_combine(expert_out, idx_ll, weights_ll, ll_handle,
                                                                         return_recv_hook=True)[2](),
    }
    return table, [normal, decode]


def measure(baseline: str, args: argparse.Namespace) -> dict[str, list[dict]]:
    """Per package, ``args.rounds`` reports of every row (the form ``ab.compare`` takes)."""
    gpu = torch.cuda.is_available() and not args.cpu
    with tempfile.TemporaryDirectory() as link_folder:
        packages = import_both(baseline, link_folder)
        roots = {"new": os.path.dirname(os.path.dirname(os.path.realpath(packages["new"].__file__))),
                 "baseline": os.path.realpath(baseline)}
        group = one_rank_group(gpu)
        device = torch.device("cuda", 0) if gpu else torch.device("cpu")
        tables, buffers = {}, []
        for which, tritonep in packages.items():
            tables[which], made = calls(tritonep, group, args, device)
            check_origin(tritonep, made)
            buffers += made
        yardstick = torch.zeros(16, device=device)
        measured: dict[str, list[dict]] = {which: [] for which in packages}
        for round_ in range(args.rounds):
            # The order swaps every round, so that neither package always runs on a warmer host.
            order = ["new", "baseline"] if round_ % 2 == 0 else ["baseline", "new"]
            reports = {which: {"package": roots[which],
                               "tritonep": os.path.join(roots[which], "tritonep", "__init__.py"),
                               "buffer_module": packages[which].Buffer.__module__,
                               "device": torch.cuda.get_device_name() if gpu else "cpu", "rows": {}}
                       for which in order}
            for which in order:
                reports[which]["torch add_ (host yardstick)"] = timing.back_to_back_host_us(lambda: yardstick.add_(1))
            for name in tables["new"]:
                for which in order:
                    fn = tables[which][name]
                    reports[which]["rows"][name] = {"gpu_us": timing.median_us(group, fn, args.iters),
                                                    "host_us": timing.back_to_back_host_us(fn)}
            for which in order:
                measured[which].append(reports[which])
        for buffer in buffers:
            buffer.destroy()
        dist.destroy_process_group()
    return measured


def parser() -> argparse.ArgumentParser:
    """The worker's options; ``ab.py`` passes the bench's values on."""
    options = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    options.add_argument("--baseline", required=True)
    options.add_argument("--rounds", type=int, required=True)
    options.add_argument("--json", required=True)
    options.add_argument("--cpu", action="store_true")
    for name in ("tokens", "hidden", "experts", "topk", "num-sms", "ll-tokens", "ll-experts", "iters"):
        options.add_argument(f"--{name}", type=int, required=True)
    return options


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    report = measure(args.baseline, args)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
