"""The default process group a run's ranks train in: its backend for the devices, and its
rendezvous."""

import os

import torch
import torch.distributed as dist

from recipes.config import JobConfig


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
        # As torchrun would describe this rank: DeepSpeed's engine refuses to start without it.
        os.environ.setdefault("LOCAL_RANK", "0")
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=world,
                                device_id=device_id)
