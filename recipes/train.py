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
from pathlib import Path

import torch
import torch.distributed as dist

from protocols.model_spec import ModelArgs, spec_of
from recipes.batches import build_batches
from recipes.checkpoint import CheckpointSaver, read_meta, remove_saves
from recipes.config import ConfigError, JobConfig, parse_config, run_config
from recipes.interrupt import EXIT_CODE, catch_interrupt, stopped_line
from recipes.liveness import exit_with_launcher, watching_peers
from recipes.loop import build_lr_schedule, train_steps
from recipes.metrics import MetricsLogger, gpu_name, memory, new_run_name, throughput
from recipes.nonfinite import NonFinitePolicy, NonFiniteStop
from recipes.model import build_kernels
from recipes.parallelize import build_backend
from recipes.preflight import CheckedRun, check_no_earlier_run, check_run
from recipes.process_group import init_distributed
from recipes.run_lock import FolderInUse, FolderLock, lock_run_folders
from recipes.run_saves import hf_exporter, load_backend_state, restore_data_position
from slidedp.nodes import ReplicaDiverged

logger = logging.getLogger("recipes")


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
