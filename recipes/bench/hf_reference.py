"""The compute-only reference on Hugging Face's model: transformers' Qwen3/Qwen2 with or without
liger-kernel's patches, the peer our fused kernels are measured against (issue: fused kernels).

    python -m recipes.bench.hf_reference --flavor qwen3-4B --batches 1,2,4 --liger --out runs.jsonl

Random weights built on the GPU in BF16 from our flavor's config.json (models/hf_checkpoint.py);
forward + backward with the model's own loss (liger's fused linear + cross-entropy when patched),
gradients dropped each step as in recipes/bench/throughput.py's reference; the median of `--steps`
after `--warmup`. Rows have mode "hf" and the same columns as throughput.py's, so
`python -m recipes.bench.report` puts them in one table; as there, each records its
timed steps' losses and gradient norms (recipes/bench/rows.py), and the bench exits non-zero
after its last row when one is invalid.
"""

import argparse
import statistics
import time

import torch

from models.hf_checkpoint import to_hf_config
from protocols.model_spec import get_flavor
from recipes.baselines.eager import clip_grad_norm
from recipes.bench.rows import emit, exit_if_invalid, training
from recipes.metrics import memory, throughput


def _model(flavor: str, *, liger: bool, attention: str) -> torch.nn.Module:
    import transformers  # a test dependency; imported here so --help needs nothing

    cfg = to_hf_config(get_flavor(flavor))
    if liger:
        # The patch replaces the module classes: apply it before the model is built.
        import liger_kernel.transformers as lk
        patch = {"qwen3": lk.apply_liger_kernel_to_qwen3, "qwen2": lk.apply_liger_kernel_to_qwen2}
        patch[cfg["model_type"]]()
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config._attn_implementation = attention
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model.to(torch.bfloat16).train()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="qwen3-4B")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batches", default="1,2,4")
    p.add_argument("--liger", action="store_true", help="patch liger-kernel's RMSNorm, RoPE, "
                   "SwiGLU and fused linear + cross-entropy into the model")
    p.add_argument("--attention", default="sdpa", help="transformers' attn_implementation")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--launch", type=int, default=1,
                   help="which launch of the same point this is (recipes/bench/headline.py)")
    p.add_argument("--out", default="")
    a = p.parse_args()
    model = _model(a.flavor, liger=a.liger, attention=a.attention)
    args = get_flavor(a.flavor)
    params, written = list(model.parameters()), []
    for batch in map(int, a.batches.split(",")):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        gen = torch.Generator(device="cuda").manual_seed(0)
        times, losses, norms = [], [], []
        for i in range(a.warmup + a.steps):
            tokens = torch.randint(0, args.vocab_size, (batch, a.seq), device="cuda", generator=gen)
            start = time.perf_counter()
            loss = model(input_ids=tokens, labels=tokens).loss  # per target token
            loss.backward()
            # As the reference's: one fused reduction, the proof that backward was finite.
            norm = clip_grad_norm(params, max_norm=0.0, sharded=False)
            for param in params:
                param.grad = None
            torch.cuda.synchronize()
            if i >= a.warmup:
                times.append(time.perf_counter() - start)
                losses.append(loss.item())
                norms.append(norm)
        step_time = statistics.median(times)
        row = {"mode": "hf", "label": "liger" if a.liger else "plain", "flavor": a.flavor,
               "route": "", "kernels": "liger" if a.liger else "torch",
               "attention_op": a.attention, "ac": "none", "world": 1, "seq": a.seq,
               "local_batch": batch, "accum": 1, "launch": a.launch, "sync": "step",
               "step_time_s": step_time,
               **throughput(global_tokens=batch * a.seq, step_time=step_time,
                            flops_per_token=args.flops_per_token(a.seq), world=1,
                            gpu=torch.cuda.get_device_name()),
               **memory(torch.device("cuda")),
               **training(losses, norms, [False] * len(losses))}  # no update to skip
        emit("bench", row, a.out)
        written.append(row)
    exit_if_invalid(written, a.out)


if __name__ == "__main__":
    main()
