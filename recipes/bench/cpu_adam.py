"""CPU AdamW throughput: the fused SlideDP kernel vs torch's fused AdamW plus casts vs a memory copy.

    python -m recipes.bench.cpu_adam --params 200e6 --threads 1,2,4,8,16,32 [--json out.json]

(a) `slidedp.cpu_adam.adam_update`: BF16 gradient in, FP32 p/m/v updated, BF16 params out, one pass.
(b) what a runtime needs around torch.optim.AdamW(fused=True): cast the BF16 gradient to FP32, step,
    cast the params to BF16.
(c) a STREAM-like copy of an FP32 buffer with torch, as the host's attainable bandwidth.
(d) the same kernel on a BF16 master (the MegaTrain-style runtime): FP32 gradient sum in, BF16 params
    widened, updated and rounded back in place, FP32 m/v updated, one pass.
(e) the same kernel with BF16 moments (slidedp.moments_dtype = "bfloat16"): as (a), m/v read and
    written as BF16.
(f) the same kernel with 8-bit moments (slidedp.moments_dtype = "8bit"): as (a), m/v dequantized
    from byte codes and requantized (torchao's AdamW8bit format).
(g) with --torchao: torchao's own AdamW8bit (block 128, its torch.compile'd step on torch's
    threads) on the same parameters, as the reference (f) is compared against, and how far (f)'s
    params and codes are from it after a few identical steps.
GB/s for (a) and (b) count the same useful traffic, 28 bytes/param; (c) counts read + write; (d) 24;
(e) 20; (f) and (g) 16 (plus two FP32 scales per 128).
"""

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from recipes.metrics import cpu_name
from slidedp import cpu_adam
from slidedp.plan.probe_machine import thread_counts

ADAM_BYTES_PER_PARAM = 28  # read p, m, v (12) + bf16 g (2); write p, m, v (12) + bf16 p (2)
COPY_BYTES_PER_ELEM = 8  # fp32 read + write
BF16_MASTER_BYTES_PER_PARAM = 24  # read + write bf16 p (4), m, v (16); read fp32 g (4)
BF16_MOMENTS_BYTES_PER_PARAM = 20  # read + write p (8), bf16 m, v (8); bf16 g in (2), bf16 p out (2)
MOMENTS_8BIT_BYTES_PER_PARAM = 16  # read + write p (8), m, v codes (4); bf16 g in (2), bf16 p out (2)
HYPER = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
"""adam_update's hyper-parameters in every timed step here and in recipes/bench/stream.py."""


def timed_runs(fn: Callable[[], None], repeats: int) -> list[float]:
    """The seconds of each of `repeats` calls of `fn`, after one warm-up (pool threads, page
    faults)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _median_seconds(fn: Callable[[], None], repeats: int) -> float:
    return statistics.median(timed_runs(fn, repeats))


class Workload:
    """The buffers, shared by the three contenders (only their speed is measured)."""

    def __init__(self, n: int):
        self.n = n
        self.param = torch.randn(n) * 0.02
        self.exp_avg = torch.zeros(n)
        self.exp_avg_sq = torch.zeros(n)
        self.grad = torch.randn(n, dtype=torch.bfloat16)
        self.bf16_out = torch.empty(n, dtype=torch.bfloat16)
        self.steps = 0
        self.torch_param = torch.nn.Parameter(self.param)  # same storage
        self.torch_param.grad = torch.empty(n)
        self.torch_opt = torch.optim.AdamW([self.torch_param], lr=1e-4, weight_decay=0.1, fused=True)
        self.copy_src = torch.randn(n)
        self.copy_dst = torch.empty(n)
        self.bf16_master = self.param.bfloat16()
        self.fp32_grad = self.grad.float()
        self.bf16_moments = {"exp_avg": torch.zeros(n, dtype=torch.bfloat16),
                             "exp_avg_sq": torch.zeros(n, dtype=torch.bfloat16)}
        k = cpu_adam.moment_scales(n)
        self.moments_8bit = {"exp_avg": torch.zeros(n, dtype=torch.uint8), "exp_avg_sq": torch.zeros(n, dtype=torch.uint8),
                             "exp_avg_scale": torch.zeros(k), "exp_avg_sq_scale": torch.zeros(k)}

    def _kernel_step(self, param: torch.Tensor, grad: torch.Tensor, threads: int,
                     bf16_out: torch.Tensor | None = None,
                     moments: dict[str, torch.Tensor] | None = None) -> None:
        """One step; `moments` are adam_update's moment arguments (default: the FP32 ones)."""
        self.steps += 1
        moments = moments or {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        cpu_adam.adam_update(param, grad, **moments, step=self.steps, **HYPER, bf16_out=bf16_out,
                             num_threads=threads)

    def ours(self, threads: int) -> None:
        self._kernel_step(self.param, self.grad, threads, bf16_out=self.bf16_out)

    def ours_in_shadow(self, threads: int) -> None:
        """The runtime's layout with a BF16 shadow: the gradient waits in the shadow, which the
        update overwrites with the weights (slidedp/holds.py)."""
        self._kernel_step(self.param, self.bf16_out, threads, bf16_out=self.bf16_out)

    def torch_fused(self) -> None:
        self.torch_param.grad.copy_(self.grad)
        self.torch_opt.step()
        self.bf16_out.copy_(self.torch_param.detach())

    def copy(self) -> None:
        self.copy_dst.copy_(self.copy_src)

    def bf16_master_update(self, threads: int) -> None:
        self._kernel_step(self.bf16_master, self.fp32_grad, threads)

    def bf16_moments_update(self, threads: int) -> None:
        self._kernel_step(self.param, self.grad, threads, bf16_out=self.bf16_out,
                          moments=self.bf16_moments)

    def moments_8bit_update(self, threads: int) -> None:
        self._kernel_step(self.param, self.grad, threads, bf16_out=self.bf16_out, moments=self.moments_8bit)


def torchao_8bit(n: int, repeats: int, steps: int = 5) -> dict[str, float]:
    """torchao's AdamW8bit (block 128) against our 8-bit moments: its median step time on
    torch's threads, and after `steps` identical steps from one start (lr 1e-3, gradients spread
    over six decades) the largest |param difference| in lr and the share of differing codes."""
    from torchao.optim import AdamW8bit

    gen = torch.Generator().manual_seed(0)
    start = torch.randn(n, generator=gen)
    grads = [(torch.randn(n, generator=gen) * torch.logspace(-6, 0, n)[torch.randperm(n, generator=gen)])
             for _ in range(steps)]
    hyper = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    param = torch.nn.Parameter(start.clone())
    opt = AdamW8bit([param], block_size=cpu_adam.MOMENT_BLOCK, **hyper)
    ours = Workload(n)
    ours.param.copy_(start)
    for g in grads:
        param.grad = g.clone()
        opt.step()
        ours.steps += 1
        cpu_adam.adam_update(ours.param, g, **ours.moments_8bit, step=ours.steps, lr=hyper["lr"],
                             beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    state = opt.state[param]
    codes_differ = sum(float((state[name].codes.view(-1) != ours.moments_8bit[name]).float().mean())
                       for name in ("exp_avg", "exp_avg_sq")) / 2
    max_param_diff_lr = float((param.detach() - ours.param).abs().max()) / hyper["lr"]
    seconds = _median_seconds(opt.step, repeats)
    return {"torchao_gparams": n / seconds / 1e9, "torchao_gbs": n * MOMENTS_8BIT_BYTES_PER_PARAM / seconds / 1e9,
            "max_param_diff_lr": max_param_diff_lr, "codes_differ": codes_differ}


def run(n: int, counts: list[int], repeats: int) -> list[dict[str, float]]:
    work = Workload(n)
    rows = []
    for threads in counts:
        torch.set_num_threads(threads)
        ours = _median_seconds(lambda: work.ours(threads), repeats)
        fused = _median_seconds(work.torch_fused, repeats)
        copy = _median_seconds(work.copy, repeats)
        bf16_master = _median_seconds(lambda: work.bf16_master_update(threads), repeats)
        bf16_moments = _median_seconds(lambda: work.bf16_moments_update(threads), repeats)
        moments_8bit = _median_seconds(lambda: work.moments_8bit_update(threads), repeats)
        rows.append({
            "threads": threads,
            "ours_gparams": n / ours / 1e9,
            "ours_gbs": n * ADAM_BYTES_PER_PARAM / ours / 1e9,
            "torch_gparams": n / fused / 1e9,
            "torch_gbs": n * ADAM_BYTES_PER_PARAM / fused / 1e9,
            "copy_gbs": n * COPY_BYTES_PER_ELEM / copy / 1e9,
            "bf16_master_gparams": n / bf16_master / 1e9,
            "bf16_master_gbs": n * BF16_MASTER_BYTES_PER_PARAM / bf16_master / 1e9,
            "bf16_moments_gparams": n / bf16_moments / 1e9,
            "bf16_moments_gbs": n * BF16_MOMENTS_BYTES_PER_PARAM / bf16_moments / 1e9,
            "moments_8bit_gparams": n / moments_8bit / 1e9,
            "moments_8bit_gbs": n * MOMENTS_8BIT_BYTES_PER_PARAM / moments_8bit / 1e9,
        })
        rows[-1]["ours_over_torch"] = fused / ours
        rows[-1]["ours_over_copy"] = rows[-1]["ours_gbs"] / rows[-1]["copy_gbs"]
    return rows


def markdown(rows: list[dict[str, float]]) -> str:
    lines = [
        "| threads | ours Gparam/s | ours GB/s | torch fused+casts Gparam/s | torch GB/s | copy GB/s "
        "| ours / torch | ours / copy | BF16 master Gparam/s | BF16 master GB/s "
        "| BF16 moments Gparam/s | BF16 moments GB/s | 8-bit moments Gparam/s | 8-bit moments GB/s |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(f"| {r['threads']} | {r['ours_gparams']:.2f} | {r['ours_gbs']:.1f} | {r['torch_gparams']:.2f} "
                     f"| {r['torch_gbs']:.1f} | {r['copy_gbs']:.1f} | {r['ours_over_torch']:.2f}x "
                     f"| {r['ours_over_copy']:.0%} | {r['bf16_master_gparams']:.2f} | {r['bf16_master_gbs']:.1f} "
                     f"| {r['bf16_moments_gparams']:.2f} | {r['bf16_moments_gbs']:.1f} "
                     f"| {r['moments_8bit_gparams']:.2f} | {r['moments_8bit_gbs']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=200e6, help="parameters per update")
    parser.add_argument("--threads", default=",".join(map(str, thread_counts(cpu_adam.host_cores()))),
                        help="comma-separated thread counts")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per point (median reported)")
    parser.add_argument("--json", help="also write the results to this path")
    parser.add_argument("--torchao", action="store_true",
                        help="also time torchao's AdamW8bit and compare our 8-bit moments with it")
    args = parser.parse_args()
    n = int(args.params)
    counts = [int(t) for t in args.threads.split(",")]
    meta = {"params": n, "isa": cpu_adam.active_isa(), "torch": torch.__version__, "cpu": cpu_name(),
            "cores": cpu_adam.host_cores()}
    print(f"CPU AdamW, {n / 1e6:.0f}M params, ISA {meta['isa']}, torch {meta['torch']}, {meta['cores']} cores")
    rows = run(n, counts, args.repeats)
    print(markdown(rows))
    if args.torchao:
        torch.set_num_threads(max(counts))
        meta["torchao"] = torchao_8bit(n, args.repeats)
        t = meta["torchao"]
        print(f"torchao AdamW8bit ({max(counts)} torch threads): {t['torchao_gparams']:.2f} Gparam/s, "
              f"{t['torchao_gbs']:.1f} GB/s; ours after 5 identical steps: params within "
              f"{t['max_param_diff_lr']:.3f} lr, {t['codes_differ']:.4%} of codes differ")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
