"""Forward + backward time of causal GQA attention per SDPA backend, at a model's shapes.

    python -m recipes.bench.attention --flavor qwen3-4B --seq 4096 --batches 1,4 --out attn.jsonl
    python -m recipes.bench.attention --fastest attn.jsonl      # the fastest row's backend

Each row: the backend asked for, the aten kernel that ran (a backend that cannot take the call
is reported as such), the median time of forward + backward over `--iters` runs after a warm-up
(CUDA events), its TFLOP/s, and the output's relative error against FP32 math attention on the
same inputs (skipped where that reference's score matrix would not fit: beyond some 32K tokens).
This is what `[model] attention = "auto"`'s order is based on (the attention row of
docs/PERFORMANCE.md's table); the rows at a long length give the step-time model its attention
rate there (model_check predict --attention-rows).
"""

import argparse
import json
import statistics
from dataclasses import replace
from typing import get_args

import torch
import torch.nn.functional as F

from models.kernels import TORCH_KERNELS, AttentionChoice, sdpa_backend_used
from protocols.model_spec import get_flavor
from recipes.bench.cuda_timing import cuda_times
from recipes.bench.rows import emit

BACKENDS = ("cudnn", "flash", "efficient")
"""Measured by default; "auto" (the run's default order) may be asked for too."""
REFERENCE_BYTES = 32 << 30
"""Largest FP32 score matrix of the math reference (batch x heads x seq^2 x 4 bytes)."""


def measure(flavor: str, *, seq: int, batch: int, iters: int, warmup: int = 2,
            backends: tuple[str, ...] = BACKENDS) -> list[dict]:
    args = get_flavor(flavor)
    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(0)

    def randn(heads: int) -> torch.Tensor:
        return torch.randn(batch, heads, seq, args.head_dim, device=device, dtype=torch.bfloat16,
                           generator=g).requires_grad_()

    q, k, v = randn(args.n_heads), randn(args.n_kv_heads), randn(args.n_kv_heads)
    dout = torch.randn(batch, args.n_heads, seq, args.head_dim, device=device, dtype=torch.bfloat16,
                       generator=g)
    ref = None
    if batch * args.n_heads * seq * seq * 4 <= REFERENCE_BYTES:
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True,
                                             enable_gqa=True)
    rows = []
    for backend in backends:
        kernels = replace(TORCH_KERNELS, attention=backend)
        row = {"flavor": flavor, "seq": seq, "batch": batch, "backend": backend}
        try:
            row["attention_op"] = sdpa_backend_used(
                kernels, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads, head_dim=args.head_dim,
                seq_len=seq, device=device)
            if ref is not None:
                out = kernels.sdpa(q, k, v)
                row["rel_err_vs_fp32"] = ((out.float() - ref).norm() / ref.norm()).item()
                del out

            def step():
                kernels.sdpa(q, k, v).backward(dout)

            times = cuda_times(step, repeats=iters, warmup=warmup)
            row["fwd_bwd_ms"] = 1e3 * statistics.median(times)
            # Causal attention FLOPs: forward 2 matmuls, backward 5, each half of seq^2 x head_dim.
            flops = 7 * 2 * batch * args.n_heads * seq * seq * args.head_dim / 2
            row["tflops"] = flops / row["fwd_bwd_ms"] / 1e9
        except RuntimeError as e:  # this backend cannot take the call at these shapes
            row["error"] = str(e).splitlines()[0][:200]
        rows.append(row)
        q.grad = k.grad = v.grad = None
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="qwen3-4B")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batches", default="1,4")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2, help="untimed runs first")
    p.add_argument("--backends", default=",".join(BACKENDS),
                   help="comma list of SDPA backends ([model] attention values, auto included)")
    p.add_argument("--out", default="")
    p.add_argument("--fastest", metavar="ROWS",
                   help="print the backend of the fastest row of this file, measure nothing")
    a = p.parse_args()
    if a.fastest:
        rows = [json.loads(line) for line in open(a.fastest) if line.strip()]
        timed = [r for r in rows if "tflops" in r]
        if not timed:
            raise SystemExit(f"error: {a.fastest}: no timed row")
        print(max(timed, key=lambda r: r["tflops"])["backend"])
        return
    unknown = set(a.backends.split(",")) - set(get_args(AttentionChoice))
    if unknown:
        p.error(f"unknown backend {sorted(unknown)[0]!r} (backends: {', '.join(get_args(AttentionChoice))})")
    for batch in (int(b) for b in a.batches.split(",")):
        for row in measure(a.flavor, seq=a.seq, batch=batch, iters=a.iters, warmup=a.warmup,
                           backends=tuple(a.backends.split(","))):
            emit("attention", row, a.out)


if __name__ == "__main__":
    main()
