"""Which backend `parallelism.mode` names: the baselines of recipes/baselines/ (`single`,
`fsdp2`: eager.py; `deepspeed`: zero_offload.py) or the SlideDP runtime (slidedp/engine.py).
Each is imported only when asked for (FSDP2 and DeepSpeed take seconds to import); the baselines
build their model from recipes/model.py."""

import torch

from protocols.model_spec import ModelArgs
from recipes.config import ConfigError, JobConfig, run_config


def build_backend(config: JobConfig, args: ModelArgs, *, device: torch.device, dp_rank: int,
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
    from slidedp.nodes import NodeMismatch

    try:
        return build_slidedp_backend(run_config(config), args, device=device, dp_rank=dp_rank,
                                     dp_world=dp_world)
    except NodeMismatch as e:  # every rank refuses alike, before anything is allocated
        raise ConfigError(str(e)) from None
