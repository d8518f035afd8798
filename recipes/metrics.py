"""Per-step metrics: throughput and memory counters, written by rank 0 to metrics.jsonl, to a
TensorBoard run folder of its own, and as a progress line.

Definitions (docs/DESIGN.md §7.1): tokens/s is the step's global tokens over its wall time;
model FLOPs per token are the model args' `flops_per_token(seq_len)` = 6·N (all parameters) +
causal attention 6·L·seq·(heads·head_dim), recomputation not counted; TFLOP/s per GPU and MFU exist only
on CUDA devices (a CPU run has neither a GPU nor its peak, so they are not reported there); MFU
is against the device's datasheet dense BF16 peak (DENSE_BF16_TFLOPS), None for a GPU not in it.

A resumed run continues its predecessor's records: metrics.jsonl keeps the rows up to the step it
resumes from (rewritten atomically, so a crash leaves the old file or the new one), and its
TensorBoard events go to the same run folder with the events past that step purged.
"""

import json
import logging
import os
import platform
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from slidedp.cpu_adam import host_cores

logger = logging.getLogger(__name__)

DENSE_BF16_TFLOPS = {"H100 PCIe": 756.0, "H100 NVL": 835.0, "H200 NVL": 835.0, "H100": 989.0,
                     "H200": 989.0, "A800": 312.0, "A100": 312.0, "4090": 165.0}
"""Datasheet dense BF16 tensor TFLOP/s (no sparsity) by a part of the name torch gives the
device, the first that matches: the MFU denominator (docs/DESIGN.md §7.1). "H100" and "H200"
alone are the SXM parts."""

_GIB = 2**30


def gpu_name(device: torch.device) -> str | None:
    """The name torch gives a CUDA device; None for any other device."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def ran_on(device: torch.device) -> dict[str, str | int | None]:
    """What a measured row ran on: the GPU's name, the host CPU's model, the cores this
    process may use and the CUDA allocator's settings (None: torch's default). Machines of one
    kind differ in their hosts (the host-bound steps move with them), so a row names its own; a
    point that fits with expandable segments can fail on the default allocator's fragments."""
    return {"gpu": gpu_name(device), "host_cpu": cpu_name(), "host_cores": host_cores(),
            "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else its architecture."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def peak_bf16_tflops(gpu: str) -> float | None:
    """The datasheet dense BF16 TFLOP/s of the GPU named `gpu`; None if the table lacks it."""
    return next((peak for part, peak in DENSE_BF16_TFLOPS.items() if part in gpu), None)


def throughput(*, global_tokens: int, step_time: float, flops_per_token: float, world: int,
               gpu: str | None) -> dict[str, float | None]:
    """Global tokens/s of one step; on a GPU (`gpu`: its name) also TFLOP/s per GPU, peak, MFU."""
    tokens_per_s = global_tokens / step_time
    if gpu is None:
        return {"tokens_per_s": tokens_per_s}
    tflops = flops_per_token * tokens_per_s / world / 1e12
    peak = peak_bf16_tflops(gpu)
    return {"tokens_per_s": tokens_per_s, "tflops_per_gpu": tflops, "peak_bf16_tflops": peak,
            "mfu": None if peak is None else tflops / peak}


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


def format_duration(seconds: float) -> str:
    """A short human duration: 42s, 12m05s, 3h07m, 2d04h."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def format_line(step: int, m: dict[str, Any], *, total_steps: int, eta_s: float) -> str:
    """The progress line: step/total, percent, the headline metrics and the time left."""
    width = len(str(total_steps))
    parts = [f"step {step:>{width}}/{total_steps} {100 * step / total_steps:5.1f}%",
             f"loss {m['loss']:.4f}", f"lr {m['lr']:.2e}", f"gnorm {m['grad_norm']:.3f}",
             f"{m['tokens_per_s']:,.0f} tok/s"]
    if "tflops_per_gpu" in m:
        parts.append(f"{m['tflops_per_gpu']:.3g} TFLOP/s/gpu")
    if "mfu" in m:
        parts.append("mfu unknown (no datasheet BF16 peak for this GPU)" if m["mfu"] is None
                     else f"mfu {100 * m['mfu']:.1f}%")
    if m["peak_mem_alloc_gib"] is not None:
        parts.append(f"mem {m['peak_mem_alloc_gib']:.1f}/{m['peak_mem_reserved_gib']:.1f} GiB")
    parts += [f"rss {m['peak_rss_gib']:.2f} GiB", f"{m['step_time_s']:.3f} s/step"]
    if "checkpoint_blocked_s" in m:
        parts.append(f"save held the step {m['checkpoint_blocked_s']:.2f} s")
    if m.get("update_skipped"):
        parts.append("update skipped (not finite)")
    parts.append(f"eta {format_duration(eta_s)}")
    return " | ".join(parts)


class Progress:
    """The time left of a run of `total_steps`: the mean wall time per step since the first step
    this process ran (its warm-up excluded; saves and logging included), times the steps left.
    Until a second step has ended, the first step's own time stands in for the mean."""

    def __init__(self, total_steps: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.total_steps, self.clock = total_steps, clock
        self._first: tuple[int, float] | None = None  # (step, clock) at the end of the first step

    def eta_s(self, step: int, step_time: float) -> float:
        """Seconds left after `step` ended (call once per step, as it ends)."""
        now = self.clock()
        if self._first is None:
            self._first = (step, now)
        first_step, first_end = self._first
        per_step = (now - first_end) / (step - first_step) if step > first_step else step_time
        return per_step * (self.total_steps - step)


def new_run_name(label: str) -> str:
    """A TensorBoard run name for a run starting now: `<YYYYmmdd-HHMMSS>-<label>`."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{label}"


def keep_rows_through(path: Path, step: int) -> int:
    """Rewrite the metrics.jsonl at `path` with only its rows of steps <= `step`, one per step
    (a step logged twice keeps its later row); returns how many lines were dropped, a line
    that is not a complete record (cut short by a crash) included. Atomic: the rows go to a
    temporary file that replaces `path` only once it is complete."""
    if not path.exists():
        return 0
    lines = path.read_text().splitlines()
    rows: dict[int, str] = {}
    for line in lines:
        try:
            row_step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            continue
        if isinstance(row_step, int) and row_step <= step:
            rows[row_step] = line
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.writelines(rows[s] + "\n" for s in sorted(rows))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(lines) - len(rows)


class MetricsLogger:
    """Writes every step to metrics.jsonl and TensorBoard (<dump_folder>/tb/<run name>) and prints
    the progress line at the first step, every `log_freq` steps and at the last; only where
    `enabled` (rank 0), so other ranks can call it unconditionally.

    A fresh run (`start_step` 0) starts metrics.jsonl anew and gets a TensorBoard folder of its
    own (`run_name`, made unique with a suffix if taken). A run resumed after `start_step` passes
    the run name its checkpoint recorded: metrics.jsonl keeps its rows up to `start_step` and is
    appended to, and the TensorBoard folder is continued with the events of later steps purged,
    so every step appears once in both."""

    def __init__(self, dump_folder: str, *, enabled: bool, log_freq: int, total_steps: int,
                 jsonl: bool, tensorboard: bool, run_name: str, start_step: int = 0) -> None:
        self.enabled, self.log_freq, self.total_steps = enabled, log_freq, total_steps
        self.run_name, self.start_step = run_name, start_step
        self.progress = Progress(total_steps)
        self.jsonl_file = self.writer = None
        if not enabled:
            return
        folder = Path(dump_folder)
        folder.mkdir(parents=True, exist_ok=True)
        if jsonl:
            path = folder / "metrics.jsonl"
            if start_step:
                dropped = keep_rows_through(path, start_step)
                if dropped:
                    logger.info("%s: dropped %d rows past step %d, where this run resumes",
                                path, dropped, start_step)
            self.jsonl_file = open(path, "a" if start_step else "w")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # tensorboard loads only when used

            runs = folder / "tb"
            if not start_step:
                self.run_name = _unused_name(runs, run_name)
            # purge_step: TensorBoard hides the events an earlier process of this run wrote at
            # or after it (the steps between the checkpoint and a crash).
            self.writer = SummaryWriter(log_dir=str(runs / self.run_name),
                                        purge_step=start_step + 1 if start_step else None)
            logger.info("TensorBoard run %s (tensorboard --logdir %s)", runs / self.run_name, runs)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Record one step: `metrics` holds at least what `format_line` prints."""
        if not self.enabled:
            return
        eta_s = self.progress.eta_s(step, metrics["step_time_s"])
        if self.jsonl_file is not None:
            self.jsonl_file.write(json.dumps({"step": step, **metrics}) + "\n")
            self.jsonl_file.flush()
        if self.writer is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, step)
        if step == self.start_step + 1 or step % self.log_freq == 0 or step == self.total_steps:
            logger.info(format_line(step, metrics, total_steps=self.total_steps, eta_s=eta_s))
            if self.writer is not None:
                self.writer.flush()

    def close(self) -> None:
        if self.jsonl_file is not None:
            self.jsonl_file.close()
        if self.writer is not None:
            self.writer.close()


def _unused_name(runs: Path, name: str) -> str:
    """`name`, or `name-2`, `name-3`, ... if a run folder of that name exists already."""
    candidate, n = name, 1
    while (runs / candidate).exists():
        n += 1
        candidate = f"{name}-{n}"
    return candidate
