"""Session 9: test_gpu_masks[drop_last] at R ranks sharing one GPU, round by round, with times,
warnings and a stack dump of any rank stuck for 100 s."""
import faulthandler
import sys
import time
import warnings

sys.path.insert(0, "tests")
import torch  # noqa: E402
from low_latency_cases import LowLatencyCase, compare_low_latency, symmetric_masks  # noqa: E402
from torch_defaults import pool_options  # noqa: E402

from tritonep.launch import RankPool  # noqa: E402


def run(group, case, variant):
    faulthandler.dump_traceback_later(100, exit=False)
    warnings.simplefilter("always")
    start = time.time()
    with warnings.catch_warnings(record=True) as caught:
        problems = compare_low_latency(group, case)
    return dict(rank=group.rank(), seconds=round(time.time() - start, 1), problems=problems[:6],
                warnings=[str(w.message)[:200] for w in caught][:4])


def main():
    R, variant = int(sys.argv[1]), sys.argv[2]
    none = ((),) * R
    masks = {"drop_last": (none, symmetric_masks(R, (R - 1,)), none, symmetric_masks(R, (R - 1,)), none, none),
             "drop_last_short": (none, symmetric_masks(R, (R - 1,))),
             "none": (none,) * 3}[variant]
    tokens = tuple(128 if r % 2 == 0 else 100 for r in range(R))
    case = LowLatencyCase(seed=60, tokens=tokens, T=128, hidden=7168, num_experts=288 if 288 % R == 0 else 32 * R,
                          num_topk=8, hook=False, calls=len(masks), masks=masks, combine_masks=())
    t = time.time()
    with RankPool(R, use_gpu=True, timeout=float(sys.argv[3]), **pool_options(use_gpu=True)) as pool:
        print(f"pool of {R} up in {time.time() - t:.1f} s", flush=True)
        for result in pool.run(run, case, variant):
            print(result, flush=True)


if __name__ == "__main__":
    main()
