"""What slidedp/ reads of a run's configuration, typed: the [slidedp] section and the few
training, optimizer and model fields the runtime and its planner use. The recipes declare their
sections on these (recipes/job_config.py) and build a RunConfig once from their JobConfig
(recipes/config.py's `run_config`); nothing in slidedp/ reads the recipes' JobConfig."""

from dataclasses import dataclass, field
from typing import Annotated, Literal

from models.kernels import AttentionChoice, KernelChoice
from protocols.bounds import Checked, above, at_least, within
from slidedp.config import SlideDPConfig

ParallelMode = Literal["single", "fsdp2", "deepspeed", "slidedp"]
"""The training modes (recipes/parallelize.py builds each)."""
ACMode = Literal["none", "full", "selective"]
"""Activation checkpointing of the modes that keep the model on the device
(recipes/baselines/activation_checkpoint.py)."""


@dataclass
class RunModel(Checked):
    hf_dir: str = ""
    """Hugging Face model directory (config.json + safetensors) to fine-tune; empty: random init."""
    kernels: KernelChoice = "auto"
    """Norm/RoPE/SwiGLU/loss kernels: "liger" (fused Triton, CUDA), "torch" (eager), "auto"
    (liger on CUDA when installed, else torch)."""
    attention: AttentionChoice = "auto"
    """SDPA backend on CUDA: "auto" (cuDNN, then flash, efficient, math), or only that one."""


@dataclass
class RunTraining(Checked):
    steps: Annotated[int, at_least(1)] = 100
    """Optimizer steps to run (every node must run as many)."""
    seq_len: Annotated[int, at_least(1)] = 128
    """Tokens per sample (documents are packed)."""
    local_batch_size: Annotated[int, at_least(1)] = 8
    """Samples per micro-batch on each rank."""
    grad_accum_steps: Annotated[int, at_least(1)] = 1
    """Micro-batches accumulated per optimizer step."""
    max_norm: Annotated[float, at_least(0)] = 1.0
    """Global gradient-norm clipping threshold; 0 = off (the norm is still reported)."""
    seed: Annotated[int, at_least(0)] = 0
    """Seed for weight init and data order."""
    loss_chunk_tokens: Annotated[int, at_least(1)] = 4096
    """Tokens per chunk of the output head + cross-entropy (bounds the logits' memory)."""
    dtype: Literal["bf16", "fp32"] = "bf16"
    """Compute dtype of single and fsdp2 (slidedp and deepspeed compute in BF16); master weights
    and optimizer state are always FP32."""
    nonfinite: Literal["stop_consecutive", "stop_total", "skip", "off"] = "stop_consecutive"
    """A step with a NaN/Inf loss or gradient norm skips its update (see docs/USAGE.md, Failures); "skip": go on,
    "stop_*": stop after max_nonfinite_steps such steps in a row / in total; "off": no check."""


@dataclass
class Optimizer(Checked):
    lr: Annotated[float, above(0)] = 1e-5
    """Peak learning rate of AdamW."""
    beta1: Annotated[float, within(0, 1, high_open=True)] = 0.9
    """AdamW first-moment decay."""
    beta2: Annotated[float, within(0, 1, high_open=True)] = 0.95
    """AdamW second-moment decay."""
    eps: Annotated[float, above(0)] = 1e-8
    """AdamW denominator epsilon."""
    weight_decay: Annotated[float, at_least(0)] = 0.1
    """Decoupled weight decay, applied to every parameter."""


@dataclass
class RunConfig(Checked):
    """A run's configuration as slidedp/ reads it."""

    mode: ParallelMode = "slidedp"
    """parallelism.mode: the planner also describes the modes that keep the model on the device."""
    activation_checkpoint: ACMode = "none"
    """activation_checkpoint.mode of those modes."""
    model: RunModel = field(default_factory=RunModel)
    """The [model] fields the runtime reads."""
    training: RunTraining = field(default_factory=RunTraining)
    """The [training] fields the runtime reads."""
    optimizer: Optimizer = field(default_factory=Optimizer)
    """The [optimizer] section, all of it."""
    slidedp: SlideDPConfig = field(default_factory=SlideDPConfig)
    """The [slidedp] section."""
