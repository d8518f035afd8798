"""The training entry point, one process per GPU under torchrun (see run_train.sh):

    python -m recipes.train --job.config_file X [--section.key=value ...]

The loop is mode-agnostic: it draws micro-batches, counts the step's global target tokens, asks
the backend of `parallelism.mode` for one optimizer step, logs and saves (in the background). A
run resumed from a save (checkpoint.resume_from, see recipes/checkpoint.py) continues exactly
where it stopped. Configuration errors are reported as one line (`error: ...`, exit code 2)
before any work starts, and so is a run folder that another run holds (recipes/run_lock.py).
Ctrl-C stops every rank after the same step, with a save: one line, exit code 130
(recipes/interrupt.py). Faults: a step with a non-finite loss or gradient skips its update
(recipes/nonfinite.py), and the ranks end together when their launcher or one of them dies
(recipes/liveness.py).
"""

import logging
import os
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from models.loss import IGNORE_INDEX
from protocols.backend import Batch, StepResult, TrainBackend
from protocols.model_spec import ModelArgs, spec_of
from recipes.checkpoint import TRAIN_STATE, CheckpointSaver, HFExport, read_meta, remove_saves
from recipes.config import ConfigError, JobConfig, parse_config, run_config
from recipes.interrupt import EXIT_CODE, catch_interrupt, interrupt_requested, stopped_line
from recipes.liveness import exit_with_launcher, watching_peers
from recipes.lr_schedule import LRSchedule
from recipes.metrics import MetricsLogger, gpu_name, memory, new_run_name, throughput
from recipes.nonfinite import NonFinitePolicy, NonFiniteStop
from recipes.model import build_kernels
from recipes.parallelize import build_backend
from recipes.preflight import (CheckedRun, check_no_earlier_run, check_run, data_error,
                               load_checked_tokenizer)
from recipes.run_lock import FolderInUse, FolderLock, lock_run_folders
from slidedp.nodes import ReplicaDiverged

logger = logging.getLogger("recipes")


class SyntheticBatches:
    """Uniform random tokens, every position a target. Global sample g comes from its own
    generator seeded by (seed, g), and rank r takes samples r, r + W, ... of each global
    micro-batch (as PackedDataLoader does), so any world size sees the same global batches.
    The position is the number of micro-batches drawn, the same on every rank."""

    def __init__(self, *, vocab_size: int, seq_len: int, local_batch_size: int, dp_rank: int,
                 dp_world: int, seed: int) -> None:
        self.vocab_size, self.seq_len, self.local_batch_size = vocab_size, seq_len, local_batch_size
        self.dp_rank, self.dp_world, self.seed = dp_rank, dp_world, seed
        self.drawn = 0

    def _batch(self, index: int) -> Batch:
        generator = torch.Generator()
        first = index * self.local_batch_size * self.dp_world
        rows = []
        for i in range(self.local_batch_size):
            generator.manual_seed((self.seed << 32) + first + i * self.dp_world + self.dp_rank)
            rows.append(torch.randint(self.vocab_size, (self.seq_len + 1,), generator=generator))
        tokens = torch.stack(rows)
        return tokens[:, :-1], tokens[:, 1:]

    def __iter__(self) -> Iterator[Batch]:
        while True:
            batch = self._batch(self.drawn)
            self.drawn += 1
            yield batch

    def state_dict(self) -> dict:
        return {"micro_batches": self.drawn}

    def load_state_dict(self, sd: dict) -> None:
        self.drawn = sd["micro_batches"]


class BatchSource(Protocol):
    """This rank's infinite stream of micro-batches, resumable at step boundaries (its state is
    the same on every rank): SyntheticBatches or recipes.data.PackedDataLoader."""

    def __iter__(self) -> Iterator[Batch]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, sd: dict) -> None: ...


def build_batches(config: JobConfig, args: ModelArgs, *, dp_rank: int,
                  dp_world: int) -> BatchSource:
    """This rank's infinite stream of (input_ids, labels) micro-batches. A bad tokenizer or data
    record is a ConfigError naming it (file:line), raised before any model is built."""
    training = config.training
    shape = dict(seq_len=training.seq_len, local_batch_size=training.local_batch_size,
                 dp_rank=dp_rank, dp_world=dp_world, seed=training.seed)
    if training.dataset == "synthetic":
        return SyntheticBatches(vocab_size=args.vocab_size, **shape)
    from recipes.data import PackedDataLoader  # tokenizers/pyarrow only for files
    from recipes.documents import DataError

    tokenizer, eos_id = load_checked_tokenizer(config, args)
    try:
        return PackedDataLoader(training.dataset_path, tokenizer, eos_id=eos_id, **shape)
    except DataError as e:
        raise data_error(e) from None


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


def hf_exporter(config: JobConfig, args: ModelArgs) -> HFExport:
    """The Hugging Face export of a save: the model's config (the source model's, if it was
    fine-tuned from one) and tokenizer with the weights."""
    hf_dir = config.model.hf_dir

    def export(tensors: Iterator[tuple[str, torch.Tensor]], out: Path) -> None:
        from models.hf_checkpoint import load_config_json, save_hf_checkpoint

        save_hf_checkpoint(tensors, args, out,
                           copy_tokenizer_from=config.model.tokenizer_dir or hf_dir or None,
                           source_config=load_config_json(hf_dir) if hf_dir else None)

    return export


def restore_data_position(data: BatchSource, directory: Path, meta: dict) -> None:
    """The data position saved in `directory` (its `meta`), or a ConfigError where this run's
    loader cannot continue it (the data files or seq_len changed). It runs before the backend
    is built and the records are cut back to the save, so a refused resume touches nothing."""
    try:
        data.load_state_dict(meta["data"])
    except ValueError as e:
        raise ConfigError(f"checkpoint.resume_from: {directory}: {e}") from None


def load_backend_state(backend: TrainBackend, directory: Path, meta: dict) -> int:
    """Restore the backend's state saved in `directory` (its `meta`); returns its step."""
    step = backend.load_state(str(directory / TRAIN_STATE))
    if step != meta["step"]:
        raise ValueError(f"{directory}: the backend state is at step {step}, meta.json says "
                         f"{meta['step']}")
    return step


def _describe_model(name: str, args: ModelArgs) -> str:
    n = args.num_params()
    published = spec_of(args).published_billions.get(name)
    versus = f", published {published}B" if published is not None else ""
    return (f"model {name}: {n:,} parameters ({n / 1e9:.2f}B{versus}), {args.n_layers} layers, "
            f"{args.describe_positions()}")


def _log_kernels(config: JobConfig, args: ModelArgs, *, device: torch.device) -> None:
    """Which kernels the model computes with, and on CUDA the SDPA kernel that runs."""
    kernels = build_kernels(config, device=device)
    line = kernels.describe()
    if device.type == "cuda":
        from models.kernels import sdpa_backend_used

        line += " -> " + sdpa_backend_used(kernels, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads,
                                           head_dim=args.head_dim, seq_len=config.training.seq_len,
                                           device=device)
    logger.info("%s", line)
    if kernels.note:
        logger.info("%s", kernels.note)


def _describe_compute(config: JobConfig) -> str:
    """What the devices compute in: training.dtype, except in SlideDP, whose GPU window holds
    BF16 weights whatever training.dtype says, and DeepSpeed, configured for BF16 (said only
    where the two differ)."""
    dtype = config.training.dtype
    if config.parallelism.mode not in ("slidedp", "deepspeed") or dtype == "bf16":
        return f"{dtype} compute"
    return f"bf16 compute (training.dtype = {dtype!r} applies to single and fsdp2)"


def process_group_backend(config: JobConfig, device: torch.device) -> str:
    """NCCL on GPUs (with gloo for the CPU tensors of FSDP2's CPU offload: its gradient norm is
    reduced on the host), gloo on the CPU."""
    if device.type != "cuda":
        return "gloo"
    return "cuda:nccl,cpu:gloo" if config.parallelism.fsdp_cpu_offload else "nccl"


def init_distributed(config: JobConfig, device: torch.device, *, world: int) -> None:
    """The default process group: torchrun's env:// rendezvous, or a one-rank group in-process
    (FSDP2, DeepSpeed and SlideDP need one even alone)."""
    backend = process_group_backend(config, device)
    device_id = device if device.type == "cuda" else None
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, device_id=device_id)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=world,
                                device_id=device_id)


def _lock_run_folders(config: JobConfig, *, rank: int, resuming: bool) -> list[FolderLock]:
    """Rank 0 locks the run's folders before anything is written, then, for a new run, checks
    that no earlier run left records or saves there (unless job.overwrite); with a process group
    every rank then raises the same one-line ConfigError (FolderInUse if another run holds a
    folder)."""
    locks, error, in_use = [], "", False
    if rank == 0:
        try:
            locks = lock_run_folders({"job.dump_folder": config.job.dump_folder,
                                      "checkpoint.save_dir": config.checkpoint.save_dir})
            if not resuming and not config.job.overwrite:
                check_no_earlier_run(config)
        except ConfigError as e:
            error, in_use = str(e), isinstance(e, FolderInUse)
    if dist.is_initialized():
        box = [error, in_use]
        dist.broadcast_object_list(box, src=0)
        error, in_use = box
    if error:
        for lock in reversed(locks):
            lock.release()
        raise FolderInUse(error) if in_use else ConfigError(error)
    return locks


def _autopolicy(config: JobConfig, checked: CheckedRun, backend, *, rank: int, world: int,
                device: torch.device) -> None:
    """AutoPolicy (slidedp/plan/live.py) on the run's own backend, before the first step
    and before a resume loads its state: it measures with lr = 0 and resets the optimizer, and
    its choice is written for slidedp.policy_file."""
    from slidedp.plan.live import select_live
    from slidedp.plan.policy_file import POLICY_FILE_NAME

    select_live(backend, run_config(config), checked.args, flavor=checked.name, device=device,
                rank=rank, world=world, group=dist.group.WORLD if world > 1 else None,
                out=str(Path(config.job.dump_folder) / POLICY_FILE_NAME), log=logger.info)


def train(config: JobConfig) -> int | None:
    """Run the training `config` describes; returns the step it stopped after if a Ctrl-C
    stopped it (its save complete), None once it trained every step."""
    exit_with_launcher()
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank{rank}] %(asctime)s %(message)s", datefmt="%H:%M:%S")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # Before anything is allocated; with several ranks the launcher read the data already.
    checked = check_run(config, world=world, device=device, thorough=world == 1)
    if config.parallelism.mode != "single":
        init_distributed(config, device, world=world)
    locks = []
    try:
        locks = _lock_run_folders(config, rank=rank,  # held until the run ends
                                  resuming=checked.resume_dir is not None)
        if (rank == 0 and config.job.overwrite and checked.resume_dir is None
                and config.checkpoint.save_dir):
            for path in remove_saves(config.checkpoint.save_dir):
                logger.info("deleted %s (job.overwrite: a save of the run this one replaces)",
                            path)
        # A stop at a Ctrl-C ends like a run done: every rank waits for rank 0's save to complete.
        with watching_peers(rank=rank, world=world, expected=(ConfigError, NonFiniteStop, ReplicaDiverged)):
            return _run(config, checked, rank=rank, world=world, device=device)
    finally:
        for lock in reversed(locks):  # a folder the run created and left unused goes
            lock.release()
        if dist.is_initialized():
            dist.destroy_process_group()


def _run(config: JobConfig, checked: CheckedRun, *, rank: int, world: int,
         device: torch.device) -> int | None:
    training = config.training
    name, args, resume_dir = checked.name, checked.args, checked.resume_dir
    if config.job.description:
        logger.info("%s", config.job.description)
    logger.info("%s", _describe_model(name, args))
    _log_kernels(config, args, device=device)
    batches = build_batches(config, args, dp_rank=rank, dp_world=world)
    step_tokens = training.local_batch_size * training.seq_len * training.grad_accum_steps * world
    logger.info("mode %s on %d x %s, %s, global batch %d tokens (%d x %d seq x %d accum "
                "x %d ranks)", config.parallelism.mode, world, device.type,
                _describe_compute(config),
                step_tokens, training.local_batch_size, training.seq_len,
                training.grad_accum_steps, world)
    torch.manual_seed(training.seed)
    # A resumed run continues the metrics of the run it resumes (its TensorBoard run name is in
    # the save's meta.json; saves from before it was recorded get a new one).
    resume_step, run_name = 0, new_run_name(config.parallelism.mode)
    if resume_dir is not None:
        resumed = read_meta(resume_dir)
        restore_data_position(batches, resume_dir, resumed)
        resume_step, run_name = resumed["step"], resumed.get("run_name", run_name)
    backend = build_backend(config, args, device=device, dp_rank=rank, dp_world=world)
    if config.parallelism.mode == "slidedp" and config.slidedp.autopolicy:
        _autopolicy(config, checked, backend, rank=rank, world=world, device=device)
    schedule = build_lr_schedule(config)
    if config.lr_scheduler.warmup_steps >= training.steps:
        logger.warning("lr_scheduler.warmup_steps = %d is not below training.steps = %d: the "
                       "learning rate never reaches optimizer.lr (%g)",
                       config.lr_scheduler.warmup_steps, training.steps, config.optimizer.lr)
    metrics = MetricsLogger(config.job.dump_folder, enabled=rank == 0,
                            log_freq=config.metrics.log_freq, total_steps=training.steps,
                            jsonl=config.metrics.jsonl,
                            tensorboard=config.metrics.enable_tensorboard,
                            run_name=run_name, start_step=resume_step)
    flops_per_token = args.flops_per_token(training.seq_len)
    ckpt = config.checkpoint
    saver = CheckpointSaver(backend, save_dir=ckpt.save_dir, keep_latest_k=ckpt.keep_latest_k,
                            background=ckpt.async_mode == "async", rank=rank,
                            export_hf=hf_exporter(config, args)) if ckpt.save_dir else None
    nonfinite = NonFinitePolicy(training.nonfinite, limit=training.max_nonfinite_steps,
                                log=rank == 0)
    stopped = None
    try:
        start_step = 0
        if resume_dir is not None:
            start_step = load_backend_state(backend, resume_dir, resumed)
            logger.info("resumed from %s at step %d", resume_dir, start_step)
        for out in train_steps(backend, batches, schedule, steps=training.steps,
                               grad_accum_steps=training.grad_accum_steps, device=device,
                               start_step=start_step):
            saved = {}
            if saver is not None:
                saver.raise_failure()  # of a background save that has ended since
                if (out.step == training.steps or out.interrupted
                        or (ckpt.interval and out.step % ckpt.interval == 0)):
                    meta = {**checked.run_meta, "run_name": metrics.run_name,
                            "data": batches.state_dict()}
                    saved["checkpoint_blocked_s"] = saver.save(out.step, meta)
            metrics.log(out.step, {
                "loss": out.loss, "lr": out.lr, "grad_norm": out.result.grad_norm,
                "target_tokens": out.target_tokens, "update_skipped": out.result.skipped,
                **throughput(global_tokens=step_tokens, step_time=out.step_time,
                             flops_per_token=flops_per_token, world=world,
                             gpu=gpu_name(device)),
                **memory(device), "step_time_s": out.step_time, **saved, **out.result.extra})
            nonfinite.observe(out.step, skipped=out.result.skipped, loss=out.loss,
                              grad_norm=out.result.grad_norm)
            if out.interrupted:
                stopped = out.step
                break
    except BaseException:
        if saver is not None:  # the save in flight still completes, before the state goes
            try:
                saver.wait()
            except RuntimeError as e:
                logger.error("%s", e)
        raise
    else:
        if saver is not None:
            saver.wait()
    finally:
        metrics.close()
        backend.close()
    return stopped


def main(argv: list[str] | None = None) -> int:
    catch_interrupt()  # first: a Ctrl-C during the set-up stops the run after its first step
    rank0 = int(os.environ.get("RANK", 0)) == 0  # every rank ends alike: rank 0 says why
    try:
        config = parse_config(sys.argv[1:] if argv is None else argv)
        stopped = train(config)
    except ConfigError as e:
        if rank0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    except (NonFiniteStop, ReplicaDiverged) as e:  # raised by every rank at the same step
        if rank0:
            print(f"error: {e}", file=sys.stderr)
        return 1
    if stopped is None:
        return 0
    if rank0:
        print(stopped_line(stopped, config.checkpoint.save_dir), file=sys.stderr)
    return EXIT_CODE


if __name__ == "__main__":
    sys.exit(main())
