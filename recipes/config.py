"""The job configuration: dataclass sections, parsed from TOML plus `--section.key=value` flags.

Precedence is CLI > TOML > defaults (torchtitan's ConfigManager with tyro). Every mistake a user
can make in a config (unknown key, wrong type, bad choice, missing file) is reported as one
`ConfigError` line naming the key, before any work starts.
"""

import dataclasses
import importlib.util
import math
import sys
import types
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

import torch

from models.kernels import AttentionChoice, KernelChoice, KernelsUnavailable, resolve_kernels
from models.rope import RopeScaling
from protocols.bounds import UNSET_OR_AT_LEAST_1, above, at_least, bound_error, within
from protocols.model_spec import ModelArgs, all_flavors
from recipes.baselines.activation_checkpoint import ACMode
from recipes.checkpoint import META_FILE, TRAIN_STATE, latest_checkpoint
from slidedp.activations import block_policies
from slidedp.config import SlideDPConfig
from slidedp.plan.policy_file import parse_candidates

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib


class ConfigError(ValueError):
    """A one-line, user-facing configuration error."""


@dataclass
class Job:
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
class Model:
    flavor: str = ""
    """Flavor of a registered model (models/<name>/, e.g. qwen3-8B); empty: hf_dir's, else
    qwen3-debug."""
    hf_dir: str = ""
    """Hugging Face model directory (config.json + safetensors) to fine-tune; empty: random init."""
    tokenizer_dir: str = ""
    """Directory with tokenizer.json; empty: hf_dir."""
    kernels: KernelChoice = "auto"
    """Norm/RoPE/SwiGLU/loss kernels: "liger" (fused Triton, CUDA), "torch" (eager), "auto"
    (liger on CUDA when installed, else torch)."""
    attention: AttentionChoice = "auto"
    """SDPA backend on CUDA: "auto" (cuDNN, then flash, efficient, math), or only that one."""
    rope_scaling_type: Literal["model", "none", "linear", "dynamic", "yarn"] = "model"
    """RoPE scaling for long context: "model" (hf_dir's config.json rope_scaling; a flavor has
    none), "none", or that type (as transformers defines it)."""
    rope_scaling_factor: Annotated[float, UNSET_OR_AT_LEAST_1] = 0.0
    """Positions x this factor; 0: the model's (a type the model lacks needs one)."""
    original_max_position_embeddings: Annotated[int, at_least(0)] = 0
    """yarn: the pre-training positions it scales (Qwen's cards: 32768); 0: the model's, else
    its max_position_embeddings."""


@dataclass
class Training:
    steps: Annotated[int, at_least(1)] = 100
    """Optimizer steps to run."""
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
    dataset: Literal["files", "synthetic"] = "synthetic"
    """"files": tokenize dataset_path; "synthetic": uniform random tokens (throughput runs)."""
    dataset_path: str = ""
    """Comma-separated data files or directories (.jsonl, .json, .txt, .parquet)."""
    loss_chunk_tokens: Annotated[int, at_least(1)] = 4096
    """Tokens per chunk of the output head + cross-entropy (bounds the logits' memory)."""
    dtype: Literal["bf16", "fp32"] = "bf16"
    """Compute dtype of single and fsdp2 (slidedp and deepspeed compute in BF16); master weights
    and optimizer state are always FP32."""
    init_on_meta: bool = False
    """Create weights on the meta device, init them in place after sharding (fast; fsdp2)."""
    nonfinite: Literal["stop_consecutive", "stop_total", "skip", "off"] = "stop_consecutive"
    """A step with a NaN/Inf loss or gradient norm skips its update (see docs/USAGE.md, Failures); "skip": go on,
    "stop_*": stop after max_nonfinite_steps such steps in a row / in total; "off": no check."""
    max_nonfinite_steps: Annotated[int, at_least(1)] = 3
    """Skipped steps (in a row, or in total since the start) that stop the run."""


@dataclass
class Optimizer:
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
class LRScheduler:
    warmup_steps: Annotated[int, at_least(0)] = 0
    """Steps of linear warmup from lr/warmup_steps up to lr."""
    decay_type: Literal["linear", "cosine", "none"] = "cosine"
    """Decay after warmup, reaching min_lr_factor * lr at the last step ("none": constant)."""
    min_lr_factor: Annotated[float, within(0, 1)] = 0.1
    """Final learning rate as a fraction of lr."""


@dataclass
class Parallelism:
    mode: Literal["single", "fsdp2", "deepspeed", "slidedp"] = "single"
    """single: one device; fsdp2: torch FSDP2 on the GPUs; deepspeed: DeepSpeed ZeRO-Offload
    (the [deepspeed] section); slidedp: host-resident, streamed."""
    fsdp_cpu_offload: bool = False
    """fsdp2: FSDP2's CPUOffloadPolicy: FP32 shards, gradients and Adam state in host memory,
    AdamW steps on the CPU after backward."""


@dataclass
class ActivationCheckpoint:
    mode: ACMode = "none"
    """Recompute in backward (single, fsdp2, deepspeed): "full": every transformer block;
    "selective": torchtitan's op-level policy (saves attention and every other matmul output,
    recomputes the rest; recipes/baselines/activation_checkpoint.py); "none"."""


@dataclass
class DeepSpeed:
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
class Checkpoint:
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
class Metrics:
    log_freq: Annotated[int, at_least(1)] = 10
    """Print the progress line every this many steps (and at the first and the last)."""
    enable_tensorboard: bool = True
    """Write TensorBoard events to <dump_folder>/tb/<run> (a folder per run; rank 0)."""
    jsonl: bool = True
    """Write one JSON object per step to <dump_folder>/metrics.jsonl (rank 0)."""


@dataclass
class Plan:
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


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(c) for c in get_args(tp))
    if get_origin(tp) in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string",
            type(None): "unset"}.get(tp, str(tp))


def _matches(value: Any, tp: Any) -> bool:
    """TOML-strict type check: bool is not an int, an int is a valid float."""
    origin = get_origin(tp)
    if origin is Literal:
        return any(type(value) is type(c) and value == c for c in get_args(tp))
    if origin in (Union, types.UnionType):
        return any(_matches(value, a) for a in get_args(tp))
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is type(None):
        return value is None
    return isinstance(value, tp)


def _base(tp: Any) -> Any:
    """The type under an Annotated one (its bounds stripped)."""
    return get_args(tp)[0] if get_origin(tp) is Annotated else tp


def _check_value(key: str, value: Any, tp: Any) -> Any:
    """The value if it fits the annotation (ints widened to float) and its bounds (Annotated
    Bound markers), else a ConfigError."""
    base = _base(tp)
    if not _matches(value, base):
        raise ConfigError(f"{key} must be {_type_name(base)}, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):  # inf passes every bound
        raise ConfigError(f"{key} must be finite, got {value!r}")
    if error := bound_error(key, value, tp):
        raise ConfigError(error)
    return float(value) if base is float else value


def _unknown_key(section: str, key: str, valid: Iterable[str]) -> ConfigError:
    return ConfigError(f"unknown key {section}.{key} (valid keys: {', '.join(valid)})")


def _unknown_section(name: str) -> ConfigError:
    return ConfigError(f"unknown section [{name}] (valid sections: "
                       f"{', '.join(get_type_hints(JobConfig))})")


def _section_from_dict(cls: type, data: dict[str, Any], *, section: str) -> Any:
    hints = get_type_hints(cls, include_extras=True)
    for key in data:
        if key not in hints:
            raise _unknown_key(section, key, hints)
    return cls(**{key: _check_value(f"{section}.{key}", value, hints[key])
                  for key, value in data.items()})


def check_config(config: JobConfig) -> None:
    """Every field against its annotation, choices and bounds (covers command-line values)."""
    for section in dataclasses.fields(config):
        obj = getattr(config, section.name)
        for name, tp in get_type_hints(type(obj), include_extras=True).items():
            _check_value(f"{section.name}.{name}", getattr(obj, name), tp)


def _require_path(key: str, value: str, *, kind: Literal["file", "directory", "file or directory"],
                  must_contain: str = "") -> None:
    path = Path(value)
    found = {"file": path.is_file, "directory": path.is_dir, "file or directory": path.exists}[kind]
    if not found():
        raise ConfigError(f"{key}: {kind} not found: {value}")
    if must_contain and not (path / must_contain).is_file():
        raise ConfigError(f"{key}: {value} has no {must_contain}")


def _with_rope_scaling(model: Model, args: ModelArgs) -> ModelArgs:
    """`args` with the [model] RoPE scaling keys applied over the model's own scaling (a factor
    or original positions alone change the model's; a type the model has keeps its other
    fields)."""
    kind, factor, original = (model.rope_scaling_type, model.rope_scaling_factor,
                              model.original_max_position_embeddings)
    current = args.rope_scaling
    key = "model.rope_scaling_factor" if factor else "model.original_max_position_embeddings"
    if kind == "none":
        if factor or original:
            raise ConfigError(f'{key} is set but model.rope_scaling_type = "none"')
        return dataclasses.replace(args, rope_scaling=None)
    if kind == "model" and current is None:
        if factor or original:
            raise ConfigError(f"{key} is set but the model has no RoPE scaling; set "
                              'model.rope_scaling_type (e.g. "yarn") too')
        return args
    kind = current.rope_type if kind == "model" else kind
    base = current if current is not None and current.rope_type == kind else None
    if base is None and not factor:
        raise ConfigError(f'model.rope_scaling_type = "{kind}" needs model.rope_scaling_factor '
                          "(the model has no such scaling)")
    fields: dict[str, Any] = {"factor": factor} if factor else {}
    if original:
        if kind not in ("yarn", "longrope", "llama3"):
            raise ConfigError(f"model.original_max_position_embeddings: {kind} scaling does not "
                              "take one (it scales max_position_embeddings)")
        fields["original_max_position_embeddings"] = original
    elif base is None and kind == "yarn":
        fields["original_max_position_embeddings"] = args.max_position_embeddings
    scaling = (dataclasses.replace(base, **fields) if base is not None
               else RopeScaling(rope_type=kind, **fields))
    return dataclasses.replace(args, rope_scaling=scaling)


def resolve_model(config: JobConfig) -> tuple[str, ModelArgs]:
    """(flavor name, architecture): the flavor, or what model.hf_dir's config.json says, with
    the [model] RoPE scaling keys applied. A custom architecture read from hf_dir that matches
    no flavor is named after the directory."""
    flavor, hf_dir = config.model.flavor, config.model.hf_dir
    flavors = all_flavors()
    if flavor and flavor not in flavors:
        raise ConfigError(f"model.flavor: unknown flavor {flavor!r} "
                          f"(choose one of {', '.join(flavors)})")
    if not hf_dir:
        name = flavor or "qwen3-debug"
        return name, _with_rope_scaling(config.model, flavors[name])
    from models.hf_checkpoint import match_flavor, read_hf_config  # safetensors only when needed

    try:
        args = read_hf_config(hf_dir)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.hf_dir: {e}") from None
    inferred = match_flavor(args)
    if flavor and flavor != inferred:
        raise ConfigError(f"model.flavor = {flavor!r} contradicts model.hf_dir {hf_dir}, whose "
                          f"config.json is {inferred or 'a custom architecture'}")
    return inferred or f"custom ({Path(hf_dir).name})", _with_rope_scaling(config.model, args)


def _job_config_from_dict(cls: type, data: dict[str, Any]) -> Any:
    sections = get_type_hints(cls, include_extras=True)
    for name, table in data.items():
        if name not in sections:
            raise _unknown_section(name)
        if not isinstance(table, dict):
            raise ConfigError(f"{name} must be a [{name}] table, got {table!r}")
    return cls(**{name: _section_from_dict(sections[name], table, section=name)
                  for name, table in data.items()})


def _check_paths(config: JobConfig) -> None:
    model, training = config.model, config.training
    if model.hf_dir:
        _require_path("model.hf_dir", model.hf_dir, kind="directory", must_contain="config.json")
    if model.tokenizer_dir:
        _require_path("model.tokenizer_dir", model.tokenizer_dir, kind="directory",
                      must_contain="tokenizer.json")
    if training.dataset == "files":
        if not training.dataset_path:
            raise ConfigError('training.dataset_path: required when training.dataset = "files"')
        for entry in (p.strip() for p in training.dataset_path.split(",") if p.strip()):
            _require_path("training.dataset_path", entry, kind="file or directory")
        if not (model.tokenizer_dir or model.hf_dir):
            raise ConfigError('model.tokenizer_dir: required when training.dataset = "files" '
                              "and model.hf_dir is empty")
    elif training.dataset_path:
        raise ConfigError('training.dataset_path is set but training.dataset = "synthetic"; '
                          'set training.dataset = "files" to train on it')
    if config.checkpoint.resume_from:
        resolve_resume_dir(config.checkpoint)


def resolve_resume_dir(checkpoint: Checkpoint) -> Path:
    """The step directory that checkpoint.resume_from names ("latest": the newest complete save
    under checkpoint.save_dir)."""
    key, value = "checkpoint.resume_from", checkpoint.resume_from
    if value != "latest":
        _require_path(key, value, kind="directory", must_contain=f"{TRAIN_STATE}/{META_FILE}")
        return Path(value)
    if not checkpoint.save_dir:
        raise ConfigError(f'{key} = "latest" needs checkpoint.save_dir')
    found = latest_checkpoint(checkpoint.save_dir)
    if found is None:
        raise ConfigError(f"{key}: no complete checkpoint (step-N/{TRAIN_STATE}/{META_FILE}) "
                          f"under {checkpoint.save_dir}")
    return found


def _check_activation(config: JobConfig, args: ModelArgs) -> None:
    """SlideDP's per-block activation policies read against the model's blocks."""
    s = config.slidedp
    try:
        block_policies(args.n_layers, default=s.activation, blocks=s.activation_blocks,
                       keep_blocks=s.keep_blocks)
        parse_candidates(s.autopolicy_candidates)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_combinations(config: JobConfig) -> None:
    training = config.training
    try:
        resolve_kernels(config.model.kernels, attention=config.model.attention,
                        device_type="cuda" if torch.cuda.is_available() else "cpu")
    except KernelsUnavailable as e:
        raise ConfigError(str(e)) from None
    if config.slidedp.autopolicy and config.parallelism.mode != "slidedp":
        raise ConfigError('slidedp.autopolicy: applies to parallelism.mode = "slidedp", not '
                          f'"{config.parallelism.mode}"')
    if training.init_on_meta and config.parallelism.mode == "single":
        raise ConfigError('training.init_on_meta: not supported with parallelism.mode = "single"')
    if training.init_on_meta and config.model.hf_dir:
        raise ConfigError("training.init_on_meta: cannot be combined with model.hf_dir "
                          "(checkpoint weights are loaded before sharding)")


def _load_toml(path: str, *, key: str = "job.config_file") -> dict[str, Any]:
    _require_path(key, path, kind="file")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{key}: {path}: invalid TOML: {e}") from None


def _with_policy_file(config: JobConfig) -> JobConfig:
    """`config` with the [slidedp] keys of slidedp.policy_file (AutoPolicy's choice, written by
    slidedp/plan/policy_file.py) in place of its own."""
    key, path = "slidedp.policy_file", config.slidedp.policy_file
    if not path:
        return config
    data = _load_toml(path, key=key)
    table = data.get("slidedp")
    if set(data) != {"slidedp"} or not isinstance(table, dict):
        raise ConfigError(f"{key}: {path} must hold one [slidedp] table, got "
                          f"{', '.join(sorted(data)) or 'nothing'}")
    if "policy_file" in table:
        raise ConfigError(f"{key}: {path} sets slidedp.policy_file itself")
    try:
        chosen = _section_from_dict(SlideDPConfig, table, section="slidedp")
    except ConfigError as e:
        raise ConfigError(f"{key}: {path}: {e}") from None
    return dataclasses.replace(config, slidedp=dataclasses.replace(
        config.slidedp, **{name: getattr(chosen, name) for name in table}))


def _cli_value(text: str, tp: Any) -> Any:
    """A flag's text as the annotation's type where it parses (else the text itself, which
    _check_value then refuses with the expected type)."""
    if tp in (int, float):
        try:
            return tp(text)
        except ValueError:
            return text
    if type(None) in get_args(tp) and text == "None":
        return None
    return text


def _check_cli_args(args: list[str]) -> list[str]:
    """The flags as tyro takes them, every key spelled with underscores (as --help and the
    README spell it; dashes are accepted too), each `--section.key=value` checked like a TOML
    value: an unknown key, a wrong type, a bad choice or a bound is one ConfigError naming the
    key instead of tyro's multi-line box. Booleans are flags (`--metrics.jsonl`,
    `--metrics.no_jsonl`) or `=true` / `=false`."""
    sections = get_type_hints(JobConfig)
    out: list[str] = []
    rest = iter(args)
    for arg in rest:
        if arg in ("-h", "--help"):
            out.append(arg)
            continue
        if not arg.startswith("--") or "." not in arg.partition("=")[0]:
            raise ConfigError(f"unexpected argument {arg!r} (flags are --section.key=value)")
        name, eq, text = arg[2:].partition("=")
        section, _, key = name.replace("-", "_").partition(".")
        if section not in sections:
            raise _unknown_section(section)
        hints = get_type_hints(sections[section], include_extras=True)
        negated = key.startswith("no_") and _base(hints.get(key[3:])) is bool
        key = key[3:] if negated else key
        if key not in hints:
            raise _unknown_key(section, key, hints)
        full, tp = f"{section}.{key}", hints[key]
        if _base(tp) is bool:
            value = not negated
            if eq:
                if negated or text.lower() not in ("true", "false"):
                    raise ConfigError(f"{full} must be true or false, got {arg!r}")
                value = text.lower() == "true"
            out.append(f"--{section}.{'' if value else 'no_'}{key}")
            continue
        if not eq:
            text = next(rest, None)
            if text is None:
                raise ConfigError(f"{full}: no value given (--{full}=VALUE)")
        _check_value(full, _cli_value(text, _base(tp)), tp)
        out.append(f"--{full}={text}")
    return out


def _import_torchtitan_without_its_init() -> None:
    """Register the `torchtitan` package without running its __init__.py, whose only work is
    registering torchtitan's quantization converters (unused here): they import torch.compile's
    stack, about 4 s of CPU in every process that parses a config (each rank, the preflight).
    torchtitan.config and its imports (tyro, logging) do not need it. Without torchtitan the
    import that follows fails as usual."""
    spec = importlib.util.find_spec("torchtitan")
    if spec is not None and "torchtitan" not in sys.modules:
        sys.modules["torchtitan"] = importlib.util.module_from_spec(spec)  # submodules import as usual


def _job_config_manager():
    """torchtitan's ConfigManager for JobConfig, with one-line errors for TOML values and flags
    alike, strict TOML types, and --help spelled as the README does (underscores).
    Defined on first use: importing torchtitan takes seconds, which processes that only need
    the dataclasses (ranks of a test, SlideDP workers) should not pay."""
    import tyro

    _import_torchtitan_without_its_init()
    from torchtitan.config.manager import ConfigManager, custom_registry

    class JobConfigManager(ConfigManager):
        def parse_args(self, args: list[str]) -> JobConfig:
            self.toml_path = _config_file_arg(args)
            base = JobConfig() if self.toml_path is None else self._from_toml(self.toml_path)
            self.config = tyro.cli(JobConfig, args=_check_cli_args(args), default=base,
                                   registry=custom_registry, use_underscores=True)
            check_config(self.config)  # policy_file itself is a string, before it is read
            self.config = _with_policy_file(self.config)
            self._validate_config()
            return self.config

        def _from_toml(self, path: str) -> JobConfig:
            data = _load_toml(path)
            try:
                return _job_config_from_dict(JobConfig, data)
            except ConfigError as e:
                raise ConfigError(f"{path}: {e}") from None

        def _validate_config(self) -> None:
            check_config(self.config)
            _check_paths(self.config)
            _check_combinations(self.config)
            _check_activation(self.config, resolve_model(self.config)[1])

    return JobConfigManager(config_cls=JobConfig)


def _config_file_arg(args: list[str]) -> str | None:
    """The last --job.config_file given ("None": none, as tyro reads it)."""
    path = None
    for i, arg in enumerate(args):
        key, eq, value = arg.partition("=")
        if key in ("--job.config_file", "--job.config-file"):
            path = value if eq else args[i + 1] if i + 1 < len(args) else None
    return None if path == "None" else path


def parse_config(args: list[str]) -> JobConfig:
    """Defaults < TOML (--job.config_file) < flags; raises ConfigError on any mistake."""
    return _job_config_manager().parse_args(args)
