"""Per-step metrics: throughput and memory counters, written by rank 0 to metrics.jsonl, TensorBoard
and a compact log line.

FLOPs are counted as DESIGN.md defines them: `QwenArgs.flops_per_token(seq_len)` = 6·N (all
parameters) + causal attention 6·L·seq·(heads·head_dim) per token; recomputation is not counted.
"""

import json
import logging
import resource
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

PEAK_BF16_TFLOPS = 779.0
"""Measured BF16 GEMM throughput of one H200 (DESIGN.md section 3): the MFU denominator."""

_GIB = 2**30


def throughput(*, global_tokens: int, step_time: float, flops_per_token: float, world: int,
               on_cuda: bool) -> dict[str, float | None]:
    """Global tokens/s, model TFLOP/s per GPU and MFU (None off CUDA) of one step."""
    tokens_per_s = global_tokens / step_time
    tflops = flops_per_token * tokens_per_s / world / 1e12
    return {"tokens_per_s": tokens_per_s, "tflops_per_gpu": tflops,
            "mfu": tflops / PEAK_BF16_TFLOPS if on_cuda else None}


def memory(device: torch.device) -> dict[str, float | None]:
    """Peak device memory since start (allocated and reserved by the caching allocator; None on
    the CPU) and the peak resident set size of this process, in GiB."""
    on_cuda = device.type == "cuda"
    return {
        "peak_mem_alloc_gib": torch.cuda.max_memory_allocated(device) / _GIB if on_cuda else None,
        "peak_mem_reserved_gib": torch.cuda.max_memory_reserved(device) / _GIB if on_cuda else None,
        # ru_maxrss is in KiB on Linux.
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / _GIB,
    }


def format_line(step: int, m: dict[str, Any]) -> str:
    """One compact log line of the headline metrics."""
    parts = [f"step {step:>5}", f"loss {m['loss']:.4f}", f"lr {m['lr']:.2e}",
             f"gnorm {m['grad_norm']:.3f}", f"{m['tokens_per_s']:,.0f} tok/s",
             f"{m['tflops_per_gpu']:.3g} TFLOP/s/gpu"]
    if m["mfu"] is not None:
        parts.append(f"mfu {100 * m['mfu']:.1f}%")
    if m["peak_mem_alloc_gib"] is not None:
        parts.append(f"mem {m['peak_mem_alloc_gib']:.1f}/{m['peak_mem_reserved_gib']:.1f} GiB")
    parts += [f"rss {m['peak_rss_gib']:.2f} GiB", f"{m['step_time_s']:.3f} s"]
    if "checkpoint_blocked_s" in m:
        parts.append(f"save held the step {m['checkpoint_blocked_s']:.2f} s")
    if m.get("update_skipped"):
        parts.append("update skipped (not finite)")
    return " | ".join(parts)


class MetricsLogger:
    """Writes every step to metrics.jsonl and TensorBoard, prints every `log_freq` steps; only
    where `enabled` (rank 0), so other ranks can call it unconditionally."""

    def __init__(self, dump_folder: str, *, enabled: bool, log_freq: int, last_step: int,
                 jsonl: bool, tensorboard: bool, append: bool = False) -> None:
        """`append`: continue an existing metrics.jsonl (a resumed run) instead of starting it."""
        self.enabled, self.log_freq, self.last_step = enabled, log_freq, last_step
        self.jsonl_file = self.writer = None
        if not enabled:
            return
        folder = Path(dump_folder)
        folder.mkdir(parents=True, exist_ok=True)
        if jsonl:
            self.jsonl_file = open(folder / "metrics.jsonl", "a" if append else "w")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # tensorboard loads only when used

            self.writer = SummaryWriter(log_dir=str(folder / "tb"))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self.jsonl_file is not None:
            self.jsonl_file.write(json.dumps({"step": step, **metrics}) + "\n")
            self.jsonl_file.flush()
        if self.writer is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, step)
        if step == 1 or step % self.log_freq == 0 or step == self.last_step:
            logger.info(format_line(step, metrics))
            if self.writer is not None:
                self.writer.flush()

    def close(self) -> None:
        if self.jsonl_file is not None:
            self.jsonl_file.close()
        if self.writer is not None:
            self.writer.close()
