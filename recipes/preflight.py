"""What a run can be refused for, checked before any model, data or host memory is allocated,
so that a mistake is one `error:` line naming the key or file (exit code 2), not a traceback
after set-up.

Every rank calls `check_run` first thing (recipes/train.py). A single process also loads the
tokenizer and parses every data record (`thorough`). With several ranks the launcher does that
once instead (`check_launch`, from recipes/launch.py), so a mistake is printed once, before any
rank starts; the ranks still find a data file changed in between while tokenizing, before they
build a model. The launch of several ranks also adds flags: mode "single" becomes "fsdp2".
"""

import errno
import importlib.util
import logging
import math
import os
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from models.kernels import resolve_kernels
from protocols.model_spec import ModelArgs
from recipes.checkpoint import FORMAT_VERSION, read_meta
from recipes.config import (ConfigError, JobConfig, parse_config, resolve_model, resolve_resume_dir,
                            run_config)
from slidedp.gpu_update import check_gpu_updates
from slidedp.speculative import check_speculative
from recipes.baselines.memory import baseline_footprint
from slidedp.plan.memory import (REFUSE_ABOVE, Kernel, MemoryEstimate, estimate_device_memory,
                                 estimate_memory)

logger = logging.getLogger(__name__)

MULTI_RANK_MODE = "fsdp2"
"""What a launch of several ranks runs when the configuration says "single"."""


@dataclass(frozen=True)
class CheckedRun:
    """What the checks resolved, for the run to use."""

    name: str
    """The model's flavor name (or "custom (<dir>)")."""
    args: ModelArgs
    """The architecture."""
    run_meta: dict[str, Any]
    """What a resumed run must share with the saved one (recorded in meta.json)."""
    resume_dir: Path | None
    """The step directory to resume from, if any."""


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_world(config: JobConfig, *, world: int) -> None:
    if config.parallelism.mode == "single" and world > 1:
        raise ConfigError(f'parallelism.mode = "single" runs one process, but WORLD_SIZE={world}; '
                          f'use "fsdp2" or "slidedp" (./run_train.sh picks "{MULTI_RANK_MODE}")')


def check_slidedp_options(config: JobConfig, args: ModelArgs, *, world: int) -> None:
    """With parallelism.mode = "slidedp", the [slidedp] options the runtime can serve for the
    model `args` on `world` ranks (the planner checks these as a run does)."""
    if config.parallelism.mode != "slidedp":
        return
    try:
        check_gpu_updates(config.slidedp, grad_accum_steps=config.training.grad_accum_steps,
                          n_layers=args.n_layers, world=world)
        check_speculative(config.slidedp, grad_accum_steps=config.training.grad_accum_steps,
                          n_layers=args.n_layers)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_mode_options(config: JobConfig, args: ModelArgs, *, world: int) -> None:
    """Options of one mode only where that mode runs (for the model `args` on `world` ranks);
    for "deepspeed",
    the package is installed (found, not imported: that takes seconds) and the run asks nothing
    the mode does not do."""
    mode = config.parallelism.mode
    if config.parallelism.fsdp_cpu_offload and mode != "fsdp2":
        raise ConfigError(f'parallelism.fsdp_cpu_offload applies to parallelism.mode = "fsdp2", '
                          f'not "{mode}"')
    check_slidedp_options(config, args, world=world)
    if mode != "deepspeed":
        return
    if importlib.util.find_spec("deepspeed") is None:
        from recipes.baselines.zero_offload import deepspeed_missing

        raise ConfigError(deepspeed_missing())
    for key, value in (("checkpoint.save_dir", config.checkpoint.save_dir),
                       ("checkpoint.resume_from", config.checkpoint.resume_from),
                       ("training.init_on_meta", config.training.init_on_meta)):
        if value:
            raise ConfigError(f'{key}: not supported with parallelism.mode = "deepspeed" (a '
                              "throughput baseline: no saves, no resume, no meta init)")


def check_seq_len(seq_len: int, args: ModelArgs) -> None:
    """training.seq_len within the positions the model takes (ModelArgs.max_positions: a RoPE
    scaling raises them)."""
    if seq_len > args.max_positions():
        advice = ("raise model.rope_scaling_factor" if args.rope_scaling else
                  'set model.rope_scaling_type = "yarn" and model.rope_scaling_factor')
        raise ConfigError(f"training.seq_len = {seq_len} exceeds the model's "
                          f"{args.describe_positions()}: {advice}, or lower training.seq_len")


def _check_hf_dir(hf_dir: str, args: ModelArgs) -> None:
    from safetensors import SafetensorError

    from models.hf_checkpoint import check_hf_tensors  # safetensors only when needed

    try:
        check_hf_tensors(hf_dir, args)
    except (OSError, ValueError, SafetensorError) as e:
        raise ConfigError(f"model.hf_dir: {e}") from None


def load_checked_tokenizer(config: JobConfig, args: ModelArgs):
    """The data's tokenizer and EOS id; one line if it is missing, unreadable or larger than the
    model's vocabulary."""
    from recipes.tokenizer import load_tokenizer  # tokenizers only for files

    key = "model.tokenizer_dir" if config.model.tokenizer_dir else "model.hf_dir"
    directory = config.model.tokenizer_dir or config.model.hf_dir
    try:
        tokenizer, eos_id = load_tokenizer(directory)
    except Exception as e:  # tokenizers raises plain Exceptions for a malformed file
        raise ConfigError(f"{key}: {directory}: {e}") from None
    if tokenizer.get_vocab_size() > args.vocab_size:
        raise ConfigError(f"{key}: {directory} has {tokenizer.get_vocab_size()} tokens, more than "
                          f"the model's vocab_size {args.vocab_size}")
    return tokenizer, eos_id


def data_error(e: Exception) -> ConfigError:
    """A recipes.documents.DataError as the one-line error naming the key."""
    return ConfigError(f"training.dataset_path: {e}")


def _check_data(config: JobConfig, *, thorough: bool) -> None:
    from recipes.documents import DataError, read_documents, resolve_data_files

    try:
        resolve_data_files(config.training.dataset_path)  # exist, supported, not empty
        if thorough:
            for _ in read_documents(config.training.dataset_path):
                pass
    except DataError as e:
        raise data_error(e) from None


def run_meta(config: JobConfig, name: str, args: ModelArgs, *, world: int) -> dict[str, Any]:
    """What a resumed run must share with the saved one. `global_batch` (samples per step) is
    compared only where the save recorded it (saves from before it was recorded resume too)."""
    tr = config.training
    return {"mode": config.parallelism.mode, "world_size": world, "flavor": name,
            "num_params": args.num_params(), "seed": tr.seed,
            "global_batch": tr.local_batch_size * tr.grad_accum_steps * world}


def check_resumable(directory: Path, *, meta: dict[str, Any], steps: int) -> None:
    """The saved run has this run's shape, and has steps left to train (`steps`:
    training.steps)."""
    try:
        saved = read_meta(directory)
    except (OSError, ValueError) as e:
        raise ConfigError(f"checkpoint.resume_from: {directory}: unreadable meta.json "
                          f"({e})") from None
    for key, value in {"format_version": FORMAT_VERSION, **meta}.items():
        if key == "global_batch" and key not in saved:
            continue
        if saved.get(key) != value:
            hint = (" (samples per step: training.local_batch_size x grad_accum_steps x ranks; "
                    "another global batch changes the run)" if key == "global_batch" else "")
            raise ConfigError(f"checkpoint.resume_from: {directory} was saved with {key} = "
                              f"{saved.get(key)!r}, this run has {value!r}{hint}; resume with "
                              "the same")
    if saved.get("step", 0) >= steps:
        raise ConfigError(f"checkpoint.resume_from: {directory} is at step {saved['step']}, "
                          f"training.steps is {steps}: nothing is left to train (raise "
                          "training.steps to train on)")


def device_memory(config: JobConfig, args: ModelArgs, *, world: int,
                  kernels: Kernel = "torch") -> MemoryEstimate:
    """One rank's estimated device bytes under `config`'s mode: SlideDP's model
    (slidedp/plan/memory.py), or a baseline's footprint (recipes/baselines/memory.py) with the
    same activation and logits model."""
    if config.parallelism.mode == "slidedp":
        return estimate_device_memory(run_config(config), args, world=world, kernels=kernels)
    return estimate_memory(baseline_footprint(config, args, world=world), config.training, args,
                           kernels=kernels)


def largest_fitting_batch(config: JobConfig, args: ModelArgs, *, world: int, capacity: int,
                          kernels: Kernel = "torch") -> int:
    """The largest training.local_batch_size whose estimate fits `capacity` (0 if none does)."""
    def fits(batch: int) -> bool:
        trial = replace(config, training=replace(config.training, local_batch_size=batch))
        return device_memory(trial, args, world=world, kernels=kernels).total <= capacity

    low, high = 0, config.training.local_batch_size  # fits(low) holds, or low == 0
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


FRAGMENTS_WARN_ABOVE = 0.8
"""An estimate above this share of the device warns under torch's default CUDA allocator: the
fragments it caches can take the headroom of a step that fits by its allocations."""


def allocator_warning(estimate: int, capacity: int, alloc_conf: str | None) -> str | None:
    """What to say before a run whose `estimate` bytes leave little of `capacity` while the
    allocator (`alloc_conf`, PYTORCH_CUDA_ALLOC_CONF) is not growing its segments in place."""
    if "expandable_segments:True" in (alloc_conf or ""):
        return None
    if estimate <= capacity * FRAGMENTS_WARN_ABOVE:
        return None
    return (f"device memory: about {_gib(estimate)} of {_gib(capacity)} per device with torch's "
            "default CUDA allocator, whose cached fragments can leave too little for a step that "
            "fits; set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (run_train.sh does)")


def check_device_memory(config: JobConfig, args: ModelArgs, *, world: int, capacity: int,
                        kernels: Kernel = "torch") -> MemoryEstimate:
    """Refuse when the estimate (device_memory) clearly exceeds one device's
    `capacity` bytes, with the numbers and what to change; else the estimate."""
    est = device_memory(config, args, world=world, kernels=kernels)
    if est.total <= capacity * REFUSE_ABOVE:
        return est
    mode = config.parallelism.mode
    parts = est.parts(_gib)
    fits = largest_fitting_batch(config, args, world=world, capacity=capacity, kernels=kernels)
    if fits:
        advice = (f"training.local_batch_size = {fits} fits (raise training.grad_accum_steps "
                  "for the same global batch)")
    elif est.resident + est.gradients > capacity:
        advice = 'the weights and optimizer state alone do not fit: use parallelism.mode = ' \
                 '"slidedp", or "fsdp2" over more ranks'
    else:
        advice = "lower training.seq_len or training.loss_chunk_tokens"
    if mode == "slidedp" and config.slidedp.activation == "keep":
        advice += ', or set slidedp.activation = "recompute"'
    elif mode != "slidedp" and config.activation_checkpoint.mode == "none":
        advice += ', or set activation_checkpoint.mode = "full"'
    raise ConfigError(f'parallelism.mode = "{mode}" with training.local_batch_size = '
                      f"{config.training.local_batch_size} x seq_len {config.training.seq_len} "
                      f"needs about {_gib(est.total)} per device ({parts}), the device has "
                      f"{_gib(capacity)}: {advice}")


def slidedp_host_bytes(config: JobConfig, args: ModelArgs, *, world: int,
                       bf16_shadow: bool | None = None, nodes: int = 1) -> int:
    """The exact bytes of SlideDP's shared host state for `config` (with `bf16_shadow` instead
    of slidedp.bf16_shadow if given): the regions HostStatePlan.for_run picks; on `nodes` that
    shard it (slidedp.nodes_state = "sharded"), one node's part."""
    from slidedp.host_state import HostStatePlan, host_state_bytes
    from slidedp.layout import node_layout

    training, cfg = config.training, config.slidedp
    if bf16_shadow is not None:
        cfg = replace(cfg, bf16_shadow=bf16_shadow)
    plan = HostStatePlan.for_run(cfg, grad_accum_steps=training.grad_accum_steps,
                                 max_norm=training.max_norm, nonfinite=training.nonfinite)
    layout, shards = node_layout(args, ranks=world // nodes, nodes=nodes,
                                 sharded=cfg.nodes_state == "sharded")
    return host_state_bytes(layout, plan, shards)


def check_host_memory(config: JobConfig, args: ModelArgs, *, world: int, on_cpu: bool,
                      available: int, total: int, nodes: int = 1) -> None:
    """SlideDP's shared host state (exact) against `available` bytes (MemAvailable, unless
    slidedp.check_host_memory is off), then everything the ranks hold on the host (estimated:
    the shared state, the FP32 model that single, fsdp2 and deepspeed build on the CPU first,
    the state that FSDP2's CPU offload and DeepSpeed's optimizer offload keep there, and on the
    CPU the devices' estimate) against `total` bytes (MemTotal). `world` ranks on `nodes`."""
    training, shared = config.training, 0
    n, mode = args.num_params(), config.parallelism.mode
    if mode == "slidedp":
        shared = slidedp_host_bytes(config, args, world=world, nodes=nodes)
        if shared > available and config.slidedp.check_host_memory:
            without = slidedp_host_bytes(config, args, world=world, bf16_shadow=False,
                                         nodes=nodes)
            shadow = (f"set slidedp.bf16_shadow = false ({without / n:.1f} B/param), "
                      if without < shared else "")
            raise ConfigError(f"slidedp: the host state needs {_gib(shared)} "
                              f"({shared / n:.1f} B/param), MemAvailable is {_gib(available)}: "
                              f"{shadow}use a smaller model, or set slidedp.check_host_memory = "
                              "false on machines whose memory grows on demand")
    if on_cpu:
        per_rank = device_memory(config, args, world=world).total
    elif mode != "slidedp" and not training.init_on_meta:
        per_rank = n * 4  # the FP32 model every rank builds on the CPU first
    else:
        per_rank = 0
    if (mode == "fsdp2" and config.parallelism.fsdp_cpu_offload) or mode == "deepspeed":
        per_rank += math.ceil(n * 16 / world)  # the offloaded FP32 shards, gradients, Adam state
    need = shared + world * per_rank
    if need > total * REFUSE_ABOVE:
        raise ConfigError(f"host memory: {world} rank(s) of parallelism.mode = "
                          f'"{config.parallelism.mode}" need about {_gib(need)} of host memory '
                          f"({_gib(shared)} shared + {_gib(per_rank)} per rank), the host has "
                          f"{_gib(total)}: lower training.local_batch_size or training.seq_len, "
                          "or use a smaller model")


def _check_memory(config: JobConfig, args: ModelArgs, *, world: int, device: torch.device) -> None:
    from slidedp.host_state import available_host_bytes, total_host_bytes

    check_host_memory(config, args, world=world, on_cpu=device.type == "cpu",
                      available=available_host_bytes(), total=total_host_bytes(),
                      nodes=world // int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    if device.type == "cuda":
        capacity = torch.cuda.get_device_properties(device).total_memory
        kernels = resolve_kernels(config.model.kernels, device_type="cuda").name
        est = check_device_memory(config, args, world=world, capacity=capacity, kernels=kernels)
        alloc_conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        if warning := allocator_warning(est.total, capacity, alloc_conf):
            logger.warning(warning)


def _check_writable(key: str, directory: str) -> None:
    """Write a file into the directory, or into its nearest existing parent if it does not
    exist yet: an output folder that cannot be written fails now, not at the first save after
    hours of training. Nothing is created: the run creates its folders when it locks them, so
    a run refused before then leaves none (and ranks checking at once do not race)."""
    path = Path(directory)
    where = next(p for p in (path, *path.parents) if p.exists())
    try:
        if not where.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(where))
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as e:
        raise ConfigError(f"{key}: cannot write to {directory} ({e.strerror or e})") from None


def check_no_earlier_run(config: JobConfig) -> None:
    """A new run where an earlier one left its records or saves would replace its metrics and
    mix its saves with the earlier ones (`latest` could then name the earlier run's): refused,
    naming what is there and the ways on. The caller holds the folders' locks, so no live run
    is writing them (that is FolderInUse's error)."""
    found = []
    metrics = Path(config.job.dump_folder) / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size:
        found.append(f"{metrics}")
    if config.checkpoint.save_dir:
        saves = sorted(p.name for p in Path(config.checkpoint.save_dir).glob("step-*"))
        if saves:
            found.append(f"{len(saves)} save(s) in {config.checkpoint.save_dir} "
                         f"({', '.join(saves[:3])}{', ...' if len(saves) > 3 else ''})")
    if found:
        raise ConfigError(f"an earlier run is in these folders ({'; '.join(found)}): resume it "
                          "with --checkpoint.resume_from=latest, use another --job.dump_folder "
                          "(and checkpoint.save_dir), or replace it with --job.overwrite")


def check_run(config: JobConfig, *, world: int, device: torch.device,
              thorough: bool) -> CheckedRun:
    """Every check, cheapest first; the output folders are created last. `thorough`: also load
    the tokenizer and parse every data record (a bad one is found in seconds rather than after
    tokenizing all before it, and before any rank starts), where the ranks would otherwise find
    them while tokenizing."""
    check_world(config, world=world)
    name, args = resolve_model(config)
    check_mode_options(config, args, world=world)
    check_seq_len(config.training.seq_len, args)
    if config.model.hf_dir:
        _check_hf_dir(config.model.hf_dir, args)
    if config.training.dataset == "files":
        if thorough:
            load_checked_tokenizer(config, args)
        _check_data(config, thorough=thorough)
    meta = run_meta(config, name, args, world=world)
    resume_dir = resolve_resume_dir(config.checkpoint) if config.checkpoint.resume_from else None
    if resume_dir is not None:
        check_resumable(resume_dir, meta=meta, steps=config.training.steps)
    _check_memory(config, args, world=world, device=device)
    _check_writable("job.dump_folder", config.job.dump_folder)
    if config.checkpoint.save_dir:
        _check_writable("checkpoint.save_dir", config.checkpoint.save_dir)
    return CheckedRun(name=name, args=args, run_meta=meta, resume_dir=resume_dir)


def launch_flags(config: JobConfig, *, nproc: int) -> list[str]:
    """Flags a launch of `nproc` ranks adds to the configuration."""
    if config.parallelism.mode == "single" and nproc > 1:
        return [f"--parallelism.mode={MULTI_RANK_MODE}"]
    return []


def _launch_device(nproc: int) -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if nproc > torch.cuda.device_count():
        raise ConfigError(f"NGPU={nproc} ranks, but this machine has {torch.cuda.device_count()} "
                          "GPUs")
    return torch.device("cuda", 0)


def check_launch(argv: list[str], *, nproc: int, nodes: int = 1) -> list[str]:
    """The thorough checks of a launch of `nproc` ranks on each of `nodes` nodes with the flags
    `argv`; returns the flags the launch adds (launch_flags), or raises the ConfigError that
    refuses it."""
    config = parse_config(argv)
    flags = launch_flags(config, nproc=nproc * nodes)
    if flags:
        config = parse_config([*argv, *flags])
    check_run(config, world=nproc * nodes, device=_launch_device(nproc), thorough=True)
    return flags
