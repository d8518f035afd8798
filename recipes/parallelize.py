"""What every mode is built from, and which backend `parallelism.mode` names: the baselines of
recipes/baselines/ (`single`, `fsdp2`: eager.py; `deepspeed`: zero_offload.py) or the SlideDP
runtime (slidedp/engine.py). Each is imported only when asked for (FSDP2 and DeepSpeed take
seconds to import)."""

import torch

from models.args import QwenArgs
from models.kernels import TORCH_KERNELS, Kernels, resolve_kernels
from models.qwen import QwenModel
from recipes.config import JobConfig


def build_kernels(config: JobConfig, *, device: torch.device) -> Kernels:
    """The model's kernels for this run ([model] kernels and attention on this device)."""
    return resolve_kernels(config.model.kernels, attention=config.model.attention,
                           device_type=device.type)


def build_model(args: QwenArgs, *, seed: int, hf_dir: str = "",
                kernels: Kernels = TORCH_KERNELS) -> QwenModel:
    """The full FP32 model on the CPU: seeded random init, or the weights of `hf_dir`. Every
    backend starts from this so the same seed means the same weights in every mode."""
    model = QwenModel(args, kernels)
    if hf_dir:
        from models.hf_checkpoint import load_hf_into_model  # safetensors only when needed

        load_hf_into_model(model, hf_dir)
    else:
        torch.manual_seed(seed)
        model.init_weights()
    return model


def build_backend(config: JobConfig, args: QwenArgs, *, device: torch.device, dp_rank: int,
                  dp_world: int):
    """The TrainBackend of `parallelism.mode`."""
    mode = config.parallelism.mode
    if mode == "single":
        from recipes.baselines.eager import build_single_backend

        return build_single_backend(config, args, device=device)
    if mode == "fsdp2":
        from recipes.baselines.eager import build_fsdp2_backend

        return build_fsdp2_backend(config, args, device=device)
    if mode == "deepspeed":
        from recipes.baselines.zero_offload import build_deepspeed_backend

        return build_deepspeed_backend(config, args, device=device)
    from slidedp.engine import build_slidedp_backend

    return build_slidedp_backend(config, args, device=device, dp_rank=dp_rank, dp_world=dp_world)
