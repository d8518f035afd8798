"""Activation bytes per token per transformer block, by kernels and activation policy.

    python -m recipes.bench.activations --flavor qwen3-4B --seq 4096 --kernels torch,liger \\
        --policies "keep,recompute,selective,segments(qkv+attention_core),recompute@offload=1" \\
        --out activations.jsonl

Per policy the row has what SlideDP measures at start (slidedp/activations/cost.py: GPU and host
bytes per token and per micro-batch, replay FLOPs per token at --seq) and, on CUDA, a check of
that measurement at the full (batch, seq): one block in BF16 runs forward the way SlideDP runs
it (its weights in one buffer as references, offload on its stream), and what stays allocated
after the forward and its copies to the host (the caching allocator's count, less the block's
output, which is the next block's input) is divided by batch x seq. Its backward runs too.
"""

import argparse
from dataclasses import asdict

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from models.kernels import resolve_kernels
from models.meta import on_meta
from protocols.model_spec import get_flavor, spec_of
from recipes.bench.rows import emit
from slidedp.activations import (BlockSegments, Offloader, WeightRefs, as_streamed, block_input,
                                 measure_costs, parse_policy)
from slidedp.streams import Streams
from slidedp.traffic import Traffic


def allocated_per_token(policy, block: nn.Module, args, kernels, *, batch: int, seq: int,
                        host_bytes: int, device: torch.device) -> float:
    """GPU bytes per token one block keeps after its forward under `policy` (CUDA only)."""
    flat, weights = as_streamed(block)
    streams = Streams(device)
    offloader = Offloader(streams, Traffic())
    offloader.pool.allocate(host_bytes)
    refs = WeightRefs([flat], lambda unit: flat)
    with on_meta():
        segments = BlockSegments(spec_of(args).block_cls(args, kernels))
    rope = spec_of(args).rope_tables(args, seq, device)
    x = torch.randn(batch, seq, args.dim, device=device, dtype=torch.bfloat16)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    grads = []
    with offloader.forward_of(0, policy.offload) as offload, refs.during_forward_of(0, offload):
        out = policy.forward(segments, block_input(x, grads), weights, rope)
    torch.cuda.synchronize(device)
    kept = torch.cuda.memory_allocated(device) - before - out.numel() * out.element_size()
    offloader.prefetch(0)
    torch.autograd.backward(get_gradient_edge(out), torch.ones_like(out))
    offloader.release(0)
    offloader.clear()
    return kept / (batch * seq)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="qwen3-4B")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--kernels", default="torch,liger", help="comma list of [model] kernels")
    p.add_argument("--policies", default="keep,recompute,selective",
                   help="comma list of activation policies (slidedp.activation's forms)")
    p.add_argument("--out", default="")
    a = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args = get_flavor(a.flavor)
    policies = [parse_policy(spec, key="--policies") for spec in a.policies.split(",")]
    for name in a.kernels.split(","):
        kernels = resolve_kernels(name, device_type=device.type)
        costs = measure_costs(policies, args, kernels, device=device, seq_len=a.seq)
        block = None
        if device.type == "cuda":
            spec = spec_of(args)
            block = spec.block_cls(args, kernels).to(device=device, dtype=torch.bfloat16)
            with torch.no_grad():
                for pname, param in block.named_parameters():
                    spec.init_parameter(pname, param)
        for policy in policies:
            cost = costs[policy]
            gpu, host = cost.gpu.at(a.batch, a.seq), cost.host.at(a.batch, a.seq)
            row = {"flavor": a.flavor, "seq": a.seq, "batch": a.batch, "kernels": kernels.name,
                   **asdict(cost), "gpu_bytes_per_token": gpu / (a.batch * a.seq),
                   "host_bytes_per_token": host / (a.batch * a.seq),
                   "gib_per_sequence_all_blocks": gpu / a.batch * args.n_layers / 2**30}
            if block is not None:
                row["alloc_bytes_per_token"] = allocated_per_token(
                    policy, block, args, kernels, batch=a.batch, seq=a.seq, host_bytes=host,
                    device=device)
            emit("activations", row, a.out)


if __name__ == "__main__":
    main()
