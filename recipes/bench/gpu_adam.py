"""GPU AdamW throughput: the one-pass kernel of slidedp/gpu_adamw.py against torch's fused AdamW
with the cast and the copy around it (what the GPU updates ran before), on one GPU.

    python -m recipes.bench.gpu_adam [--params 400e6] [--repeats 20] [--json out.json]

Both update the same FP32 parameters and moments from a BF16 gradient and leave the new weights
in BF16 (`adamw_step`, `torch_adamw_step`), with a clipping divisor and a found_inf flag on the
device as the runtime passes them. Each figure is the median (and minimum) of `repeats` timed
calls after two warm-up calls, by CUDA events. GB/s count the same useful traffic for both, 28
bytes/param (read the BF16 gradient and FP32 p, m, v; write p, m, v and the BF16 copy), and
beside it the bytes each moves: 28 and 40 (the cast writes and reads an FP32 gradient, the copy
reads FP32 p again).
"""

import argparse
import json
import statistics
import sys

import torch

from recipes.bench.cuda_timing import cuda_times
from slidedp.gpu_adamw import adamw_step, torch_adamw_step

USEFUL_BYTES = 28
MOVED_BYTES = {"one-pass kernel": 28, "torch fused + cast + copy": 40}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=400e6, help="parameters per call")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", default="", help="also write the rows to this file")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: recipes.bench.gpu_adam needs a CUDA GPU", file=sys.stderr)
        return 2
    n, device = int(a.params), torch.device("cuda", 0)
    state = [torch.randn(n, device=device), torch.zeros(n, device=device),
             torch.zeros(n, device=device)]
    grad = torch.randn(n, device=device).bfloat16()
    out = torch.empty(n, dtype=torch.bfloat16, device=device)
    divisor, found_inf = torch.tensor(2.0, device=device), torch.tensor(0.0, device=device)
    kw = dict(out=out, lr=1e-5, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8, step=1,
              divisor=divisor, found_inf=found_inf)
    rows = []
    for name, step in (("one-pass kernel", adamw_step), ("torch fused + cast + copy", torch_adamw_step)):
        times = cuda_times(lambda: step(*state, grad, **kw), repeats=a.repeats)
        median = statistics.median(times)
        rows.append({"what": name, "device": torch.cuda.get_device_name(device), "params": n,
                     "median_s": median, "min_s": min(times),
                     "useful_gbs": USEFUL_BYTES * n / median / 1e9,
                     "moved_gbs": MOVED_BYTES[name] * n / median / 1e9})
        print(f"{name:<28} {median * 1e3:8.2f} ms (min {min(times) * 1e3:.2f}), "
              f"{rows[-1]['useful_gbs']:7.0f} GB/s of the update's 28 B/param, "
              f"{rows[-1]['moved_gbs']:7.0f} GB/s moved", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
