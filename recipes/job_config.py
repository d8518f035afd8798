"""The job configuration's sections: one dataclass per TOML table, JobConfig holding them all.

Each field carries its type, its `Literal` choices or `Annotated` bounds and a one-line docstring,
which tyro prints in `--help`; each section holds its fields to them whenever it is built
(protocols/bounds.py). They sit apart from their parsing and the checks across sections
(recipes/config.py), so that every key a run reads is in one short module. The runtime's own
section and fields (slidedp/config.py, slidedp/run_config.py) are included or extended here.
"""

from dataclasses import dataclass, field
from typing import Annotated, Literal

from protocols.bounds import UNSET_OR_AT_LEAST_1, Checked, at_least, within
from slidedp.config import SlideDPConfig
from slidedp.run_config import ACMode, Optimizer, ParallelMode, RunModel, RunTraining


@dataclass
class Job(Checked):
    config_file: str | None = None
    """TOML file with this run's settings; command-line flags override it."""
    dump_folder: str = "./outputs"
    """Folder for metrics.jsonl and TensorBoard events."""
    description: str = ""
    """Free-text description of the run, printed at start."""
    overwrite: bool = False
    """Let a new run (not a resume) replace an earlier run's metrics.jsonl and saves in these
    folders; without it such a run is refused."""


@dataclass
class Model(RunModel):
    flavor: str = ""
    """Flavor of a registered model (models/<name>/, e.g. qwen3-8B); empty: hf_dir's, else
    qwen3-debug."""
    tokenizer_dir: str = ""
    """Directory with tokenizer.json; empty: hf_dir."""
    rope_scaling_type: Literal["model", "none", "linear", "dynamic", "yarn"] = "model"
    """RoPE scaling for long context: "model" (hf_dir's config.json rope_scaling; a flavor has
    none), "none", or that type (as transformers defines it)."""
    rope_scaling_factor: Annotated[float, UNSET_OR_AT_LEAST_1] = 0.0
    """Positions x this factor; 0: the model's (a type the model lacks needs one)."""
    original_max_position_embeddings: Annotated[int, at_least(0)] = 0
    """yarn: the pre-training positions it scales (Qwen's cards: 32768); 0: the model's, else
    its max_position_embeddings."""


@dataclass
class Training(RunTraining):
    dataset: Literal["files", "synthetic"] = "synthetic"
    """"files": tokenize dataset_path; "synthetic": uniform random tokens (throughput runs)."""
    dataset_path: str = ""
    """Comma-separated data files or directories (.jsonl, .json, .txt, .parquet)."""
    init_on_meta: bool = False
    """Create weights on the meta device, init them in place after sharding (fast; fsdp2)."""
    max_nonfinite_steps: Annotated[int, at_least(1)] = 3
    """Skipped steps (in a row, or in total since the start) that stop the run."""


@dataclass
class LRScheduler(Checked):
    warmup_steps: Annotated[int, at_least(0)] = 0
    """Steps of linear warmup from lr/warmup_steps up to lr."""
    decay_type: Literal["linear", "cosine", "none"] = "cosine"
    """Decay after warmup, reaching min_lr_factor * lr at the last step ("none": constant)."""
    min_lr_factor: Annotated[float, within(0, 1)] = 0.1
    """Final learning rate as a fraction of lr."""


@dataclass
class Parallelism(Checked):
    mode: ParallelMode = "single"
    """single: one device; fsdp2: torch FSDP2 on the GPUs; deepspeed: DeepSpeed ZeRO-Offload
    (the [deepspeed] section); slidedp: host-resident, streamed."""
    fsdp_cpu_offload: bool = False
    """fsdp2: FSDP2's CPUOffloadPolicy: FP32 shards, gradients and Adam state in host memory,
    AdamW steps on the CPU after backward."""


@dataclass
class ActivationCheckpoint(Checked):
    mode: ACMode = "none"
    """Recompute in backward (single, fsdp2, deepspeed): "full": every transformer block;
    "selective": torchtitan's op-level policy (saves attention and every other matmul output,
    recomputes the rest; recipes/baselines/activation_checkpoint.py); "none"."""


@dataclass
class DeepSpeed(Checked):
    """DeepSpeed ZeRO-Offload (parallelism.mode = "deepspeed"; pip install '.[deepspeed]'):
    BF16 compute with FP32 master weights and Adam state in host memory, updated by
    DeepSpeedCPUAdam after backward (recipes/baselines/zero_offload.py)."""

    zero_stage: Literal[2, 3] = 2
    """ZeRO stage: 2 shards gradients and optimizer state (BF16 weights replicated on the GPUs);
    3 also shards the BF16 weights, gathered block by block."""
    cpu_threads: Annotated[int, at_least(0)] = 0
    """Threads of DeepSpeedCPUAdam per rank (0: this rank's share of the CPUs it may run on;
    torchrun would otherwise leave it OMP_NUM_THREADS=1)."""
    pin_memory: bool = True
    """Page-locked host buffers for the offloaded optimizer state (faster copies)."""
    reduce_bucket_size: Annotated[int, at_least(1)] = 500_000_000
    """Elements per gradient reduce (and ZeRO-2 all-gather) bucket: DeepSpeed's
    reduce_bucket_size, its default."""
    overlap_comm: bool = True
    """Overlap gradient reduction with backward (DeepSpeed's overlap_comm)."""


@dataclass
class Checkpoint(Checked):
    save_dir: str = ""
    """Hugging Face-format saves go to <save_dir>/step-<N>; empty: no saving."""
    interval: Annotated[int, at_least(0)] = 0
    """Save every this many steps as well; 0: only at the end."""
    resume_from: str = ""
    """Continue exactly from a step-N directory with train_state/, or "latest" under save_dir."""
    keep_latest_k: Annotated[int, at_least(0)] = 3
    """Keep the newest K complete saves and delete older ones (0: keep all)."""
    async_mode: Literal["async", "disabled"] = "async"
    """"async": write each save in the background from a snapshot; "disabled": the step waits."""


@dataclass
class Metrics(Checked):
    log_freq: Annotated[int, at_least(1)] = 10
    """Print the progress line every this many steps (and at the first and the last)."""
    enable_tensorboard: bool = True
    """Write TensorBoard events to <dump_folder>/tb/<run> (a folder per run; rank 0)."""
    jsonl: bool = True
    """Write one JSON object per step to <dump_folder>/metrics.jsonl (rank 0)."""


@dataclass
class Plan(Checked):
    """The machine `python -m recipes.plan CONFIG` plans for (recipes/plan.py; a run ignores it)."""

    rates: str = ""
    """Its rates: a file shipped in slidedp/plan/rates/ by name (e.g. h200x2) or a path; empty:
    this machine's (the probe's cache, else measured here)."""
    ngpu: Annotated[int, at_least(0)] = 0
    """Ranks (GPUs) to plan for; 0: the rates' machine's."""
    nnodes: Annotated[int, at_least(1)] = 1
    """Nodes of `ngpu` ranks each to plan for (slidedp/nodes.py's replicated mode)."""
    link: str = ""
    """The nodes' network when nnodes > 1: a file shipped in slidedp/plan/rates/links/ by name
    (e.g. ib400x8) or a path."""


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    deepspeed: DeepSpeed = field(default_factory=DeepSpeed)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    slidedp: SlideDPConfig = field(default_factory=SlideDPConfig)
    plan: Plan = field(default_factory=Plan)
