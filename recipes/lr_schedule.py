"""Learning-rate schedule as a pure function of the step: every backend (including SlideDP's CPU
optimizer, which has no torch LRScheduler) asks it for a number."""

import math
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class LRSchedule:
    """Linear warmup to `lr`, then linear or cosine decay to `min_lr_factor * lr` at `total_steps`
    (or constant). Steps count from 1, as the training loop logs them."""

    lr: float
    total_steps: int
    warmup_steps: int = 0
    decay_type: Literal["linear", "cosine", "none"] = "cosine"
    min_lr_factor: float = 0.0

    def lr_at(self, step: int) -> float:
        if step <= self.warmup_steps:
            return self.lr * step / self.warmup_steps  # never 0: step >= 1
        decay_steps = self.total_steps - self.warmup_steps
        if self.decay_type == "none" or decay_steps <= 0:
            return self.lr
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        if self.decay_type == "linear":
            factor = 1.0 - progress
        else:
            factor = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.lr * (self.min_lr_factor + (1.0 - self.min_lr_factor) * factor)
