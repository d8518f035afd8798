"""The training loop proper, mode-agnostic: per step it draws the micro-batches, counts the
step's global loss targets and asks the backend for one optimizer step at the learning rate of
the run's schedule."""

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from models.loss import IGNORE_INDEX
from protocols.backend import Batch, StepResult, TrainBackend
from recipes.config import JobConfig
from recipes.interrupt import interrupt_requested
from recipes.lr_schedule import LRSchedule


def build_lr_schedule(config: JobConfig) -> LRSchedule:
    sched = config.lr_scheduler
    return LRSchedule(lr=config.optimizer.lr, total_steps=config.training.steps,
                      warmup_steps=sched.warmup_steps, decay_type=sched.decay_type,
                      min_lr_factor=sched.min_lr_factor)


def _step_counts(micro_batches: list[Batch], *, device: torch.device) -> tuple[int, bool]:
    """The step's loss targets over all ranks, and whether any rank got a Ctrl-C: the flag rides
    the all-reduce the targets need anyway, so every rank sees the same answer at no extra cost."""
    targets = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in micro_batches)
    counts = torch.tensor([targets, interrupt_requested()], dtype=torch.int64, device=device)
    if dist.is_initialized():
        dist.all_reduce(counts)
    targets, interrupted = counts.tolist()
    return targets, interrupted > 0


@dataclass
class StepOutcome:
    """One optimizer step as the loop saw it."""

    step: int
    lr: float
    target_tokens: int
    """Loss targets of the step over all ranks and micro-batches."""
    result: StepResult
    step_time: float
    """Seconds, from drawing the micro-batches to the backend's return."""
    interrupted: bool
    """A rank got a Ctrl-C before the step began: every rank stops after it."""

    @property
    def loss(self) -> float:
        return self.result.loss_sum / max(self.target_tokens, 1)


def train_steps(backend: TrainBackend, batches: Iterable[Batch], schedule: LRSchedule, *,
                steps: int, grad_accum_steps: int, device: torch.device,
                start_step: int = 0) -> Iterator[StepOutcome]:
    """The loop proper: per step after `start_step` (the step a resumed run reached), draw the
    micro-batches, count the global targets (and agree on a Ctrl-C), step."""
    batches = iter(batches)
    for step in range(start_step + 1, steps + 1):
        start = time.perf_counter()
        micro_batches = [next(batches) for _ in range(grad_accum_steps)]
        target_tokens, interrupted = _step_counts(micro_batches, device=device)
        lr = schedule.lr_at(step)
        result = backend.train_step(micro_batches, lr=lr, global_target_tokens=target_tokens)
        yield StepOutcome(step=step, lr=lr, target_tokens=target_tokens, result=result,
                          step_time=time.perf_counter() - start, interrupted=interrupted)
