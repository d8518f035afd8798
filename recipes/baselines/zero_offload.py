"""DeepSpeed ZeRO-Offload (`parallelism.mode = "deepspeed"`, the [deepspeed] section), run as its
users run it: the real `deepspeed` package (pip install '.[deepspeed]'), our model code, data,
sequence length and global batch.

DeepSpeed holds the BF16 weights on the GPUs (ZeRO-2: every rank all of them; ZeRO-3: a shard,
gathered block by block), reduces the BF16 gradients over the ranks and copies each rank's
partition to host memory, where DeepSpeedCPUAdam updates the FP32 master weights and Adam
moments after backward; the updated weights are copied back. The configuration it gets is
`deepspeed_config` (bf16, gradient clipping at training.max_norm, the optimizer offloaded to the
CPU, AdamW with our [optimizer] values). DeepSpeedCPUAdam runs on OpenMP threads of the calling
thread: torchrun leaves OMP_NUM_THREADS=1, so the threads per rank are set explicitly
(deepspeed.cpu_threads). A step with a NaN/Inf gradient is skipped by DeepSpeed itself (its bf16
`check_grad_overflow`, on unless training.nonfinite = "off").

Gradients: each rank's loss is its token-loss sum over the step's global target count, and
DeepSpeed averages over ranks and micro-batches, so the loss handed to its backward is scaled by
ranks x micro-batches: the update is that of the single-process global batch, as in fsdp2.

Not supported (refused at start by recipes/preflight.py): saves and resumes (this mode is a
throughput peer), training.init_on_meta.
"""

import gc
import inspect
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from protocols.backend import Batch, StepResult
from protocols.model_spec import ModelArgs
from recipes.baselines.activation_checkpoint import apply_activation_checkpointing
from recipes.config import JobConfig
from recipes.model import build_kernels, build_model

DEEPSPEED_VERSION = "0.19.8"
"""The release this mode is written and measured with (pyproject.toml's extra pins it)."""


def deepspeed_missing() -> str:
    """Empty if deepspeed imports, else the one-line reason (checked before anything is built)."""
    try:
        import deepspeed  # noqa: F401
    except ImportError as e:
        return (f'parallelism.mode = "deepspeed" needs the deepspeed package ({e}): '
                f"pip install deepspeed=={DEEPSPEED_VERSION} (or '.[deepspeed]')")
    return ""


def cpu_adam_threads(config: JobConfig) -> int:
    """deepspeed.cpu_threads, or (0) this rank's share of the CPUs it may run on."""
    from slidedp.cpu_adam import default_num_threads

    return config.deepspeed.cpu_threads or default_num_threads()


def deepspeed_config(config: JobConfig, *, world: int) -> dict[str, Any]:
    """The DeepSpeed JSON configuration of this run (what a user writes into ds_config.json)."""
    training, opt, ds = config.training, config.optimizer, config.deepspeed
    zero: dict[str, Any] = {
        "stage": ds.zero_stage,
        "offload_optimizer": {"device": "cpu", "pin_memory": ds.pin_memory},
        "overlap_comm": ds.overlap_comm,
        "contiguous_gradients": True,
        "reduce_bucket_size": ds.reduce_bucket_size,
    }
    if ds.zero_stage == 2:
        zero["allgather_bucket_size"] = ds.reduce_bucket_size
    return {
        "train_micro_batch_size_per_gpu": training.local_batch_size,
        "gradient_accumulation_steps": training.grad_accum_steps,
        "train_batch_size": training.local_batch_size * training.grad_accum_steps * world,
        "gradient_clipping": training.max_norm,
        "bf16": {"enabled": True, "check_grad_overflow": training.nonfinite != "off"},
        # With the optimizer offloaded to the CPU, DeepSpeed builds DeepSpeedCPUAdam for it
        # (adamw_mode: decoupled weight decay, as torch AdamW).
        "optimizer": {"type": "AdamW",
                      "params": {"lr": opt.lr, "betas": [opt.beta1, opt.beta2], "eps": opt.eps,
                                 "weight_decay": opt.weight_decay}},
        "zero_optimization": zero,
        "steps_per_print": 2**31 - 1,  # the loop prints the progress
        "wall_clock_breakdown": False,
    }


class _LossModel(nn.Module):
    """The model with its loss inside forward, so that DeepSpeed's hooks see every parameter the
    step uses: the output head is read by loss_sum, not through a submodule's forward, so under
    ZeRO-3 it is registered as an external parameter to be gathered."""

    def __init__(self, model: nn.Module, *, chunk_tokens: int, zero_stage: int) -> None:
        super().__init__()
        self.model, self.chunk_tokens = model, chunk_tokens
        if zero_stage == 3:
            from deepspeed.runtime.zero.partition_parameters import register_external_parameter

            register_external_parameter(self, model.head_weight())

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model.loss_sum(self.model(tokens), labels, chunk_tokens=self.chunk_tokens)


class DeepSpeedBackend:
    """A DeepSpeed engine behind the TrainBackend seam (train_step only; see module docstring)."""

    def __init__(self, engine, config: JobConfig, *, device: torch.device, world: int) -> None:
        self.engine, self.device, self.world = engine, device, world
        self.threads = cpu_adam_threads(config)

    def train_step(self, micro_batches: list[Batch], *, lr: float,
                   global_target_tokens: int) -> StepResult:
        engine = self.engine
        for group in engine.optimizer.param_groups:
            group["lr"] = lr
        skipped_before = engine.skipped_steps
        # DeepSpeed divides by its gradient_accumulation_steps and averages over the ranks.
        scale = self.world * len(micro_batches) / global_target_tokens
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        torch.set_num_threads(self.threads)  # DeepSpeedCPUAdam's OpenMP threads (this thread's)
        for input_ids, labels in micro_batches:
            loss = engine(input_ids.to(self.device), labels.to(self.device))
            engine.backward(loss * scale)
            engine.step()  # the update at the last micro-batch (its accumulation boundary)
            loss_sum += loss.detach().float()
        dist.all_reduce(loss_sum)
        grad_norm = engine.get_global_grad_norm()
        grad_norm = float("nan") if grad_norm is None else float(grad_norm)
        return StepResult(loss_sum=loss_sum.item(), grad_norm=grad_norm,
                          skipped=engine.skipped_steps > skipped_before)

    def named_master_parameters(self):
        """The FP32 master weights by model parameter name (gathered on every rank)."""
        from deepspeed.utils import safe_get_full_fp32_param

        for name, param in self.engine.module.model.named_parameters():
            yield name, safe_get_full_fp32_param(param)

    def _refuse(self, *_args, **_kwargs):
        raise NotImplementedError('parallelism.mode = "deepspeed" does not save or resume')

    snapshot_state = saved_master_parameters = load_state = _refuse

    def close(self) -> None:
        """Free the engine and the process group DeepSpeed made for it. Each needs more than
        engine.destroy(): whatever stays referenced keeps its gloo threads past
        destroy_process_group() (tests/rank_exit.py), and one engine a batch in the GPU bench
        would keep every earlier engine's memory."""
        engine = self.engine
        del self.engine
        engine.destroy()
        if engine.zero_optimization_stage() == 3:
            _release_zero3_module(engine.module)
        del engine
        gc.collect()  # the engine sits in reference cycles with its hooks on the module
        _destroy_deepspeed_groups()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _release_zero3_module(module: nn.Module) -> None:
    """Drop what DeepSpeed's ZeRO-3 keeps of the model in module-level state after destroy():
    its stack of modules in forward (the top module, pushed when the hooks are set up, is never
    popped) and the class-wide cache of the parameters each module releases (keyed by module).
    Through the modules' hooks and the parameters' attributes these keep the engine, and the
    process group the parameters name, alive for the life of the process."""
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.partitioned_param_coordinator import \
        PartitionedParameterCoordinator as Coordinator

    ours = set(module.modules())
    stack = parameter_offload.FWD_MODULE_STACK
    stack[:] = [m for m in stack if m not in ours]
    # An lru_cache under DeepSpeed's NVTX wrapper (which keeps no __wrapped__).
    params_to_release = Coordinator._PartitionedParameterCoordinator__params_to_release
    inspect.getclosurevars(params_to_release).nonlocals["func"].cache_clear()


def _destroy_deepspeed_groups() -> None:
    """Destroy DeepSpeed's clone of the world group (the one group this configuration makes:
    no model, expert or sequence parallelism), which deepspeed.utils.groups keeps for the life of
    the process. deepspeed.comm's destroy also drops DeepSpeed's references to it, so the next
    engine makes a new one."""
    import deepspeed.comm
    from deepspeed.utils import groups

    if groups._WORLD_GROUP is not None:
        deepspeed.comm.destroy_process_group(groups._WORLD_GROUP)


def _unbind_default_group() -> None:
    """deepspeed.comm's torch backend, first imported by build_deepspeed_backend (inside the
    process group), binds the default group as its barriers' default argument at import, which
    keeps the group and its threads alive past destroy_process_group(). Its barriers read None
    as the default group at the call."""
    from deepspeed.comm.torch import TorchBackend

    for name in ("barrier", "monitored_barrier"):
        barrier = inspect.unwrap(getattr(TorchBackend, name))
        barrier.__defaults__ = (None, *barrier.__defaults__[1:])


def build_deepspeed_backend(config: JobConfig, args: ModelArgs, *,
                            device: torch.device) -> DeepSpeedBackend:
    """DeepSpeed's engine over the default process group, from the same seeded FP32 model as
    every other mode (its activation checkpointing applied first)."""
    if device.type == "cpu":
        # DeepSpeed's CPU accelerator (gloo, its own shared-memory collectives): the CPU tests.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    _unbind_default_group()
    model = build_model(args, seed=config.training.seed, hf_dir=config.model.hf_dir,
                        kernels=build_kernels(config, device=device))
    apply_activation_checkpointing(model, mode=config.activation_checkpoint.mode)
    module = _LossModel(model, chunk_tokens=config.training.loss_chunk_tokens,
                        zero_stage=config.deepspeed.zero_stage)
    world = dist.get_world_size()
    engine, *_ = deepspeed.initialize(model=module, model_parameters=module.parameters(),
                                      config=deepspeed_config(config, world=world),
                                      dist_init_required=False)
    return DeepSpeedBackend(engine, config, device=device, world=world)
