"""Activation bytes per token per transformer block, by kernels and activation policy.

    python -m recipes.bench.activations --flavor qwen3-4B --seq 4096 --kernels torch,liger \\
        --out activations.jsonl

One block in BF16 on the device runs forward on a (batch, seq, dim) input, the way SlideDP and
the reference run it. Per policy (keep / recompute / selective) the row has what stays allocated
after the forward (the caching allocator's count, less the block's output, which is the next
block's input); under keep it also has the bytes autograd saved (models/activation_memory.py),
weights excluded. Divided by batch x seq: bytes per token per block.
"""

import argparse

import torch
from torch.utils.checkpoint import checkpoint

from models.activation_memory import saved_bytes
from models.flavors import get_flavor
from models.kernels import resolve_kernels
from models.qwen import TransformerBlock, init_parameter, rope_tables
from recipes.bench.rows import emit
from slidedp.activations import save_attention_context

POLICIES = ("keep", "recompute", "selective")


def _forward(block: TransformerBlock, policy: str, x: torch.Tensor, rope) -> torch.Tensor:
    if policy == "keep":
        return block(x, *rope)
    context = {"context_fn": save_attention_context} if policy == "selective" else {}
    return checkpoint(block, x, *rope, use_reentrant=False, **context)


def measure(flavor: str, *, seq: int, batch: int, kernels_name: str,
            device: torch.device) -> list[dict]:
    """One row per policy for one block of `flavor` on `kernels_name`."""
    args = get_flavor(flavor)
    kernels = resolve_kernels(kernels_name, device_type=device.type)
    block = TransformerBlock(args, kernels).to(device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in block.named_parameters():
            init_parameter(name, p)
    rope = rope_tables(args, seq, device)
    tokens = batch * seq
    rows = []
    for policy in POLICIES:
        x = torch.randn(batch, seq, args.dim, device=device, dtype=torch.bfloat16,
                        requires_grad=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
        if policy == "keep":
            saved, out = saved_bytes(block, x, *rope, exclude=block.parameters())
        else:
            saved, out = None, _forward(block, policy, x, rope)
        row = {"flavor": flavor, "seq": seq, "batch": batch, "kernels": kernels.name,
               "policy": policy,
               "saved_bytes_per_token": saved / tokens if saved is not None else None}
        if before is not None:
            torch.cuda.synchronize(device)
            kept = torch.cuda.memory_allocated(device) - before - out.numel() * out.element_size()
            row["alloc_bytes_per_token"] = kept / tokens
        out.sum().backward()  # the policy's backward runs too: it must work, and frees the rest
        rows.append(row)
        del x, out
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="qwen3-4B")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--kernels", default="torch,liger", help="comma list of [model] kernels")
    p.add_argument("--out", default="")
    a = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args = get_flavor(a.flavor)
    for name in a.kernels.split(","):
        for row in measure(a.flavor, seq=a.seq, batch=a.batch, kernels_name=name, device=device):
            per_token = row.get("alloc_bytes_per_token", row["saved_bytes_per_token"])
            row["gib_per_sequence_all_blocks"] = (None if per_token is None else
                                                  per_token * a.seq * args.n_layers / 2**30)
            emit("activations", row, a.out)


if __name__ == "__main__":
    main()
