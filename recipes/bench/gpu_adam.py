"""GPU AdamW throughput: the one-pass kernel of slidedp/gpu_adamw.py against torch's fused AdamW
with the cast and the copy around it (what the GPU updates ran before), on one GPU.

    python -m recipes.bench.gpu_adam [--params 400e6] [--repeats 20] [--json out.json]
    python -m recipes.bench.gpu_adam --overlap [--programs 0 32 66 132] [--warps 4 16]

Both update the same FP32 parameters and moments from a BF16 gradient and leave the new weights
in BF16 (`adamw_step`, `torch_adamw_step`), with a clipping divisor and a found_inf flag on the
device as the runtime passes them. Each figure is the median (and minimum) of `repeats` timed
calls after two warm-up calls, by CUDA events. GB/s count the same useful traffic for both, 28
bytes/param (read the BF16 gradient and FP32 p, m, v; write p, m, v and the BF16 copy), and
beside it the bytes each moves: 28 and 40 (the cast writes and reads an FP32 gradient, the copy
reads FP32 p again).

--overlap asks whether the update can hide under the forward's GEMMs, as a resident unit's update
runs beside the next forward (slidedp/gpu_update.py): a chain of BF16 GEMMs of a Qwen3-4B MLP's
shape (`--gemm`, 4 sequences of 4096 tokens) is timed alone, then with the one-pass update of
`--params` on a second stream at each grid cap (`--programs`, 0: a program a block) and program
size (`--warps`). Each row's `exposed_s` is what the pair took beyond the chain alone: the
update's cost to a step whose forward hides it as well as this pair does.
"""

import argparse
import json
import statistics
import sys

import torch

from recipes.bench.cuda_timing import cuda_times
from slidedp.gpu_adamw import WARPS, adamw_step, torch_adamw_step

USEFUL_BYTES = 28
MOVED_BYTES = {"one-pass kernel": 28, "torch fused + cast + copy": 40}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=400e6, help="parameters per call")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", default="", help="also write the rows to this file")
    p.add_argument("--overlap", action="store_true", help="time the update beside GEMMs")
    p.add_argument("--gemm", type=int, nargs=3, default=[16384, 2560, 9728],
                   metavar=("M", "K", "N"), help="the chain's GEMM: (M, K) @ (K, N) in BF16")
    p.add_argument("--gemm-calls", type=int, default=20, help="GEMMs in the chain")
    p.add_argument("--programs", type=int, nargs="+", default=[0, 16, 33, 66, 132, 264])
    p.add_argument("--warps", type=int, nargs="+", default=[4, 16])
    a = p.parse_args(argv)
    if min(a.programs) < 0 or set(a.warps) - set(WARPS):
        print(f"error: --programs must be >= 0 and --warps among {WARPS}", file=sys.stderr)
        return 2
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
    rows = overlap_rows(a, state, grad, kw) if a.overlap else []
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


def overlap_rows(a: argparse.Namespace, state: list[torch.Tensor], grad: torch.Tensor,
                 kw: dict) -> list[dict]:
    """The update beside a GEMM chain on another stream, per grid cap and program size."""
    m, k, n = a.gemm
    device = grad.device
    x, w = (torch.randn(*shape, device=device, dtype=torch.bfloat16) for shape in ((m, k), (k, n)))
    y = torch.empty(m, n, device=device, dtype=torch.bfloat16)
    side = torch.cuda.Stream(device)

    def chain():
        for _ in range(a.gemm_calls):
            torch.mm(x, w, out=y)

    def pair(programs: int, warps: int):
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            adamw_step(*state, grad, **kw, programs=programs, warps=warps)
        chain()
        torch.cuda.current_stream(device).wait_stream(side)

    chain_s = statistics.median(cuda_times(chain, repeats=a.repeats))
    tflops = 2 * m * k * n * a.gemm_calls / chain_s / 1e12
    print(f"GEMM chain alone {chain_s * 1e3:8.2f} ms ({tflops:.0f} TFLOP/s)", flush=True)
    rows = []
    for warps in a.warps:
        for programs in a.programs:
            alone = statistics.median(cuda_times(
                lambda: adamw_step(*state, grad, **kw, programs=programs, warps=warps),
                repeats=a.repeats))
            both = statistics.median(cuda_times(lambda: pair(programs, warps),
                                                repeats=a.repeats))
            rows.append({"what": "update beside GEMMs",
                         "device": torch.cuda.get_device_name(device), "params": grad.numel(),
                         "programs": programs, "warps": warps,
                         "gemm": [m, k, n, a.gemm_calls], "chain_s": chain_s,
                         "update_s": alone, "pair_s": both, "exposed_s": both - chain_s})
            print(f"programs {programs:4d} warps {warps:2d}: update alone {alone * 1e3:7.2f} "
                  f"ms, beside the chain {both * 1e3:8.2f} ms, exposed "
                  f"{(both - chain_s) * 1e3:7.2f} ms", flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
