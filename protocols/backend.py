"""The seam between the training loop and a parallelism mode (single, fsdp2, slidedp)."""

from dataclasses import dataclass, field
from typing import Iterator, Protocol

import torch

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


class TrainBackend(Protocol):
    """A parallelism mode: owns the model weights and optimizer state."""

    def train_step(self, micro_batches: list[Batch], *, lr: float,
                   global_target_tokens: int) -> StepResult:
        """Forward+backward over the micro-batches, then one AdamW step (with clipping).
        Loss is normalized by `global_target_tokens` (all ranks, all micro-batches)."""
        ...

    def named_master_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full FP32 master weights by model parameter name, for saving. Every rank must call
        it (it may communicate); only rank 0 is guaranteed to receive full tensors."""
        ...

    def save_state(self, path: str) -> None:
        """Write the exact FP32 weights, optimizer state and step count into the existing
        directory `path`. Every rank calls it and writes its own part."""
        ...

    def load_state(self, path: str) -> int:
        """Restore what save_state wrote (same mode and world size); returns the step reached.
        Every rank calls it; the next train_step continues as if never interrupted."""
        ...

    def close(self) -> None:
        """Release memory, shared mappings and threads."""
        ...
