"""The GPU-resident baselines behind the TrainBackend seam: `single` (one process, one device) and
`fsdp2` (torch FSDP2, one process per device; `parallelism.fsdp_cpu_offload` keeps its sharded
parameters, gradients and optimizer state in host memory with FSDP2's `CPUOffloadPolicy`).

Both keep FP32 master weights and train with torch AdamW. The loss of every micro-batch is its
token-loss sum divided by the step's global target-token count, and FSDP2's gradient reduction
is a plain sum, so the gradient is exactly the single-process gradient of the global batch.
Activation checkpointing: recipes/baselines/activation_checkpoint.py.
"""

import gc
import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch import nn

from models.meta import on_meta
from protocols.backend import Batch, StepResult
from protocols.model_spec import ModelArgs, spec_of
from recipes.baselines.activation_checkpoint import apply_activation_checkpointing
from recipes.config import JobConfig
from recipes.model import build_kernels, build_model


def clip_grad_norm(parameters: list[nn.Parameter], *, max_norm: float, sharded: bool) -> float:
    """Global L2 norm of the gradients before clipping; clips in place when max_norm > 0.
    Sharded (DTensor) gradients give a partial norm that full_tensor() reduces over ranks."""
    with_grad = [p for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in with_grad])
    if sharded:
        norm = norm.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(with_grad, max_norm, norm)
    return norm.item()


@torch.no_grad()
def _create_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the (zero) moments and step counts now, through one step with zero gradients and
    lr 0 that leaves every parameter bit for bit as it is, then reset the counts. Otherwise
    torch.distributed.checkpoint's get_state_dict creates them itself with such a step and
    keeps its count of 1: a save before the first applied update (all earlier steps skipped
    as non-finite) would shift every later update's bias correction."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    for p in params:
        optimizer.state[p]["step"].zero_()


def _eager_param_groups(model: nn.Module) -> dict[str, list[str]]:
    """Parameter names per transformer block (and the rest), the units the Hugging Face export
    reads back one at a time."""
    groups: dict[str, list[str]] = {}
    for name, _ in model.named_parameters():
        parts = name.split(".")
        key = ".".join(parts[:2]) if parts[0] == "layers" else "root"
        groups.setdefault(key, []).append(name)
    return groups


@contextmanager
def _single_process_dcp_allowed() -> Iterator[None]:
    """torch.distributed.checkpoint warns at every call made without a process group, which
    mode single does on purpose."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class EagerBackend:
    """A model resident in device memory trained with torch AdamW; `sharded`: its parameters are
    FSDP2 DTensors and every rank holds a shard of the same model."""

    def __init__(self, model: nn.Module, config: JobConfig, *, device: torch.device,
                 autocast: bool, sharded: bool) -> None:
        self.model, self.device = model, device
        self.autocast, self.sharded = autocast, sharded
        self.max_norm = config.training.max_norm
        self.chunk_tokens = config.training.loss_chunk_tokens
        opt = config.optimizer
        self.params = list(model.parameters())
        self.optimizer = torch.optim.AdamW(
            self.params, lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps,
            # Fused on GPU runs, as torchtitan does; with FSDP2's CPU offload the parameters are
            # on the CPU and take torch's fused CPU kernel.
            weight_decay=opt.weight_decay, fused=True if device.type == "cuda" else None)
        _create_adam_state(self.optimizer)
        self.guard = config.training.nonfinite != "off"
        self.steps_done = 0  # train_step calls, skipped ones included (the loop's step)
        self._host_copy: dict | None = None  # the snapshot's CPU buffers, reused by every save

    def _forward_context(self):
        if self.autocast:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def train_step(self, micro_batches: list[Batch], *, lr: float,
                   global_target_tokens: int) -> StepResult:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        for input_ids, labels in micro_batches:
            input_ids = input_ids.to(self.device, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
            with self._forward_context():
                loss = self.model.loss_sum(self.model(input_ids), labels,
                                           chunk_tokens=self.chunk_tokens)
            (loss / global_target_tokens).backward()
            loss_sum += loss.detach()
        grad_norm = clip_grad_norm(self.params, max_norm=self.max_norm, sharded=self.sharded)
        if self.sharded:
            dist.all_reduce(loss_sum)
        loss = loss_sum.item()
        # Both are global, so every rank takes the same decision.
        skipped = self.guard and not (math.isfinite(grad_norm) and math.isfinite(loss))
        if not skipped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_done += 1
        return StepResult(loss_sum=loss, grad_norm=grad_norm, skipped=skipped)

    def named_master_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self.model.named_parameters():
            yield name, param.detach().full_tensor() if self.sharded else param.detach()

    def _checkpoint_state(self) -> dict:
        """Model and optimizer state by parameter name (DTensor shards under FSDP2), the form
        torch.distributed.checkpoint saves, reshards and loads in place."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state, "steps_done": self.steps_done}

    def snapshot_state(self, group: dist.ProcessGroup | None) -> Callable[[str], None]:
        """A copy of the state in host memory (what torch's async_save stages), written by
        torch.distributed.checkpoint; the copy costs the step, the write does not."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        state = self._checkpoint_state()
        if self._host_copy is None:
            self._host_copy = _create_cpu_state_dict(state, pin_memory=self.device.type == "cuda")
        snapshot = _copy_state_dict(state, self._host_copy)  # synchronous: the copy is complete

        def write(path: str) -> None:
            with _single_process_dcp_allowed():
                dcp.save(snapshot, checkpoint_id=path, process_group=group)

        return write

    def saved_master_parameters(self, path: str) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors from the saved (possibly sharded) checkpoint, one block at a time."""
        import torch.distributed.checkpoint as dcp

        shapes = {name: p.shape for name, p in self.model.named_parameters()}
        for names in _eager_param_groups(self.model).values():
            part = {"model": {n: torch.empty(shapes[n], dtype=torch.float32) for n in names}}
            with _single_process_dcp_allowed():
                dcp.load(part, checkpoint_id=path, no_dist=True)
            yield from part["model"].items()

    def load_state(self, path: str) -> int:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self._checkpoint_state()  # the live tensors, loaded into in place
        with _single_process_dcp_allowed():
            dcp.load(state, checkpoint_id=path)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        self.steps_done = state["steps_done"]
        return self.steps_done

    def close(self) -> None:
        del self.optimizer, self.params, self.model
        if self.sharded:
            _release_dtensor_caches()
            gc.collect()  # FSDP2's modules sit in reference cycles that hold the mesh too
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _release_dtensor_caches() -> None:
    """Empty DTensor's module-level caches, which keep every DeviceMesh FSDP2 used, and with it
    the process group, alive for the life of the process. destroy_process_group() joins a group's
    threads only once nothing references it; left referenced, gloo's threads run into interpreter
    exit, where one that needs the GIL aborts the rank ("terminate called without an active
    exception"). Private functions of torch (no public one exists): those a torch lacks are
    skipped, and the tests check that no gloo thread is left after destroy_process_group()."""
    from torch.distributed.tensor import _collective_utils, _redistribute, debug

    for clear in (getattr(debug, "_clear_fast_path_sharding_prop_cache", None),
                  getattr(_redistribute, "clear_redistribute_planner_cache", None),
                  getattr(getattr(_redistribute, "_gen_transform_infos", None), "cache_clear", None),
                  getattr(getattr(getattr(_collective_utils, "MeshTopoInfo", None), "build_from_mesh",
                                  None), "cache_clear", None)):
        if clear is not None:
            clear()


def build_single_backend(config: JobConfig, args: ModelArgs, *,
                         device: torch.device) -> EagerBackend:
    """FP32 weights on one device; BF16 compute through autocast."""
    model = build_model(args, seed=config.training.seed, hf_dir=config.model.hf_dir,
                        kernels=build_kernels(config, device=device))
    apply_activation_checkpointing(model, mode=config.activation_checkpoint.mode)
    return EagerBackend(model.to(device), config, device=device,
                        autocast=config.training.dtype == "bf16", sharded=False)


@torch.no_grad()
def _init_sharded_weights(model: nn.Module, *, seed: int) -> None:
    """Random init of FSDP2-sharded parameters: every rank draws each full parameter on its
    device from the same seeded stream and keeps its shard. The result does not depend on the
    world size and, on the CPU, equals build_model's. (DTensor's own random ops are not used:
    on CPU meshes they give every rank the same shard.)"""
    from torch.distributed.tensor import distribute_tensor

    torch.manual_seed(seed)
    for name, param in model.named_parameters():
        full = torch.empty(param.shape, dtype=param.dtype, device=param.to_local().device)
        spec_of(model.args).init_parameter(name, full)
        shard = distribute_tensor(full, param.device_mesh, param.placements,
                                  src_data_rank=None)  # None: slice locally, no scatter
        param.to_local().copy_(shard.to_local())  # into host memory under CPU offload


def build_fsdp2_backend(config: JobConfig, args: ModelArgs, *, device: torch.device) -> EagerBackend:
    """FSDP2 over all ranks of the default process group: one shard group per block plus the
    root (embedding, final norm, head); BF16 all-gathers and FP32 gradient reduce-scatters.
    With parallelism.fsdp_cpu_offload, FSDP2's CPUOffloadPolicy: the FP32 shards, their
    gradients and Adam's state stay in host memory, each block is copied to the GPU for its
    all-gather and its reduced gradient back, and AdamW steps on the CPU after backward."""
    # Imported here: torch.distributed.fsdp takes seconds to import, which other modes skip.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy,
                                        OffloadPolicy, fully_shard)

    training = config.training
    kernels = build_kernels(config, device=device)
    if training.init_on_meta:
        with on_meta():
            model = spec_of(args).model_cls(args, kernels)
    else:
        model = build_model(args, seed=training.seed, hf_dir=config.model.hf_dir, kernels=kernels)
    apply_activation_checkpointing(model, mode=config.activation_checkpoint.mode)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    if training.dtype == "bf16":
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp_policy = MixedPrecisionPolicy()
    offload = config.parallelism.fsdp_cpu_offload
    # Pinned host shards make the copies asynchronous; pinning needs a GPU.
    offload_policy = (CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload
                      else OffloadPolicy())
    for i, block in enumerate(model.layers):
        # The last block's parameters are needed again right away by backward: keep them.
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy,
                    reshard_after_forward=i < len(model.layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy)
    if training.init_on_meta:
        model.to_empty(device="cpu" if offload else device)
        _init_sharded_weights(model, seed=training.seed)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # The loss is already normalized by the global token count: reduce by a plain sum,
            # not FSDP's default mean over ranks. Sum-only also avoids PREMUL_SUM (gloo lacks it).
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return EagerBackend(model, config, device=device, autocast=False, sharded=True)
