"""The model every backend starts from: the kernels of a run and the seeded (or Hugging Face)
full FP32 model on the CPU. A module of its own so that the baselines and the mode switch
(recipes/parallelize.py) both import it and not each other."""

import torch

from torch import nn

from models.kernels import TORCH_KERNELS, Kernels, resolve_kernels
from protocols.model_spec import ModelArgs, spec_of
from recipes.config import JobConfig


def build_kernels(config: JobConfig, *, device: torch.device) -> Kernels:
    """The model's kernels for this run ([model] kernels and attention on this device)."""
    return resolve_kernels(config.model.kernels, attention=config.model.attention,
                           device_type=device.type)


def build_model(args: ModelArgs, *, seed: int, hf_dir: str = "",
                kernels: Kernels = TORCH_KERNELS) -> nn.Module:
    """The full FP32 model on the CPU: seeded random init, or the weights of `hf_dir`. Every
    backend starts from this so the same seed means the same weights in every mode."""
    model = spec_of(args).model_cls(args, kernels)
    if hf_dir:
        from models.hf_checkpoint import load_hf_into_model  # safetensors only when needed

        load_hf_into_model(model, hf_dir)
    else:
        torch.manual_seed(seed)
        model.init_weights()
    return model
