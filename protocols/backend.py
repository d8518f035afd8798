"""The seam between the training loop and a parallelism mode (single, fsdp2, slidedp)."""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Iterator, Protocol

import torch
import torch.distributed as dist

Batch = tuple[torch.Tensor, torch.Tensor]
"""(input_ids, labels), both int64 of shape (local_batch, seq_len), on the CPU."""


@dataclass
class StepResult:
    """What one optimizer step reports back to the loop."""

    loss_sum: float
    """Sum of token losses over all ranks and micro-batches (divide by global target tokens)."""
    grad_norm: float
    """Global L2 norm of the (averaged) gradient before clipping."""
    extra: dict[str, float] = field(default_factory=dict)
    """Mode-specific counters (bytes moved, exposed times, ...), logged as they are."""
    skipped: bool = False
    """The loss or gradient norm was not finite and the update was skipped: weights, Adam
    moments and Adam's step count are as before the step (training.nonfinite)."""


class TrainBackend(Protocol):
    """A parallelism mode: owns the model weights and optimizer state."""

    def train_step(self, micro_batches: list[Batch], *, lr: float,
                   global_target_tokens: int) -> StepResult:
        """Forward+backward over the micro-batches, then one AdamW step (with clipping), unless
        the guard is on and the global loss or gradient norm is not finite: then no update.
        Loss is normalized by `global_target_tokens` (all ranks, all micro-batches)."""
        ...

    def named_master_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full FP32 master weights by model parameter name, for saving. Every rank must call
        it (it may communicate); only rank 0 is guaranteed to receive full tensors."""
        ...

    def snapshot_state(self, group: dist.ProcessGroup | None) -> Callable[[str], None]:
        """Fix the state after the last step for saving; returns the function that writes this
        rank's part of it (exact FP32 weights, optimizer state, step counts) into an existing
        directory. The function may run on another thread while training goes on and still
        writes exactly that state; `group` (gloo, for that thread's collectives) or None.
        Every rank calls both."""
        ...

    def saved_master_parameters(self, path: str) -> Iterator[tuple[str, torch.Tensor]]:
        """Full FP32 master weights by model parameter name, read back from a directory that
        every rank's snapshot writer has completed (for the Hugging Face export; one rank)."""
        ...

    def load_state(self, path: str) -> int:
        """Restore what a snapshot wrote (same mode and world size); returns the step reached.
        Every rank calls it; the next train_step continues as if never interrupted."""
        ...

    def close(self) -> None:
        """Release memory, shared mappings and threads."""
        ...
