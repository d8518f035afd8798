"""The job configuration, parsed from TOML plus `--section.key=value` flags, and checked.

Precedence is CLI > TOML > defaults, as torchtitan's ConfigManager has it; tyro parses the flags.
The sections (recipes/job_config.py) hold their fields to their types, choices and bounds
themselves (protocols/bounds.py); this module adds the checks across fields and files. Every
mistake a user can make in a config (unknown key, wrong type, bad choice, a number out of bounds,
missing file) is reported as one `ConfigError` line naming the key, before any work starts.
"""

import dataclasses
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import torch

from models.kernels import KernelsUnavailable, resolve_kernels
from models.rope import RopeScaling
from protocols.bounds import FieldError, base_type, field_error, field_types
from protocols.model_spec import ModelArgs, all_flavors
from recipes.checkpoint import META_FILE, TRAIN_STATE, latest_checkpoint
from recipes.job_config import Checkpoint, JobConfig, Model
from slidedp.activations import block_policies
from slidedp.run_config import RunConfig, RunModel, RunTraining
from slidedp.plan.policy_file import parse_candidates

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib


class ConfigError(ValueError):
    """A one-line, user-facing configuration error."""


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


def run_config(config: JobConfig) -> RunConfig:
    """What slidedp/ reads of `config`, built once per run."""
    return RunConfig(mode=config.parallelism.mode,
                     activation_checkpoint=config.activation_checkpoint.mode,
                     model=_narrowed(RunModel, config.model),
                     training=_narrowed(RunTraining, config.training), optimizer=config.optimizer,
                     slidedp=config.slidedp)


def _narrowed(cls: type, section: Any) -> Any:
    """`section`'s values of the fields of `cls`, one of its bases."""
    return cls(**{f.name: getattr(section, f.name) for f in dataclasses.fields(cls)})


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
    return dataclasses.replace(config, slidedp=_with_table(config.slidedp, table, name="slidedp",
                                                           prefix=f"{key}: {path}: "))


@contextmanager
def _keys_named(prefix: str = "", cls: type[JobConfig] = JobConfig) -> Iterator[None]:
    """A FieldError of a section of `cls` built inside as one ConfigError naming its
    section.key."""
    try:
        yield
    except FieldError as e:
        names = {tp: name for name, tp in field_types(cls).items()}
        raise ConfigError(f"{prefix}{names[e.owner]}.{e.message}") from None


def _unknown_key(section: str, key: str, cls: type[JobConfig] = JobConfig) -> ConfigError:
    valid = ", ".join(field_types(field_types(cls)[section]))
    return ConfigError(f"unknown key {section}.{key} (valid keys: {valid})")


def _unknown_section(name: str, cls: type[JobConfig]) -> ConfigError:
    return ConfigError(f"unknown section [{name}] (valid sections: "
                       f"{', '.join(field_types(cls))})")


def _with_table(section: Any, table: dict[str, Any], *, name: str, prefix: str = "",
                cls: type[JobConfig] = JobConfig) -> Any:
    """`section` (a section of `cls`) with a TOML table's keys in place of its own."""
    if unknown := [key for key in table if key not in field_types(type(section))]:
        raise ConfigError(f"{prefix}{_unknown_key(name, unknown[0], cls)}")
    with _keys_named(prefix, cls):
        return dataclasses.replace(section, **table)


def _from_toml(path: str, cls: type[JobConfig]) -> JobConfig:
    """`cls`'s defaults with the file's tables in place of their keys."""
    defaults, sections = cls(), field_types(cls)
    for name, table in (data := _load_toml(path)).items():
        if name not in sections:
            raise ConfigError(f"{path}: {_unknown_section(name, cls)}")
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: {name} must be a [{name}] table, got {table!r}")
    return dataclasses.replace(defaults, **{
        name: _with_table(getattr(defaults, name), table, name=name, prefix=f"{path}: ", cls=cls)
        for name, table in data.items()})


@cache
def _registry() -> Any:
    """tyro's rules for int, float and Literal flags, except that a value that does not parse
    is passed on as its text: the section's own check then refuses it in one line naming the
    key, as it does a TOML value (tyro's own refusal is a multi-line box)."""
    import tyro
    from tyro.constructors import PrimitiveConstructorSpec, PrimitiveTypeInfo

    registry = tyro.constructors.ConstructorRegistry()

    @registry.primitive_rule
    def lenient(info: PrimitiveTypeInfo) -> PrimitiveConstructorSpec | None:
        tp = info.type
        if get_origin(tp) is Literal:
            metavar = "{" + ",".join(map(str, get_args(tp))) + "}"
        elif tp in (int, float):
            metavar = tp.__name__.upper()
        else:
            return None
        return PrimitiveConstructorSpec(nargs=1, metavar=metavar,
                                        instance_from_str=lambda args: _read(tp, args[0]),
                                        is_instance=lambda value: field_error("", value, tp) is None,
                                        str_from_instance=lambda value: [str(value)])

    return registry


def _read(tp: Any, text: str) -> Any:
    """`text` as a value of `tp` (int, float or a Literal), or as it is where it is none."""
    if get_origin(tp) is Literal:
        return next((choice for choice in get_args(tp) if str(choice) == text), text)
    try:
        return tp(text)
    except ValueError:
        return text


def _flag_key(arg: str) -> tuple[str, str]:
    """(section, key) of `--section.key[=value]`, dashes read as underscores."""
    name = arg.partition("=")[0].removeprefix("--").replace("-", "_")
    section, _, key = name.partition(".")
    return section, key


def _is_bool(section: str, key: str, cls: type[JobConfig]) -> bool:
    section_type = field_types(cls).get(section)
    return section_type is not None and base_type(field_types(section_type).get(key)) is bool


def _flag_form(arg: str, cls: type[JobConfig]) -> str:
    """`--section.key=true|false` of a bool field as tyro's flag (`--section.key` or
    `--section.no_key`); any other argument as it is."""
    (section, key), (_, eq, text) = _flag_key(arg), arg.partition("=")
    plain = key.removeprefix("no_")
    if not (eq and arg.startswith("--") and _is_bool(section, plain, cls)):
        return arg
    if plain != key or text.lower() not in ("true", "false"):
        raise ConfigError(f"{section}.{plain} must be true or false, got {arg!r}")
    return f"--{section}.{'no_' if text.lower() == 'false' else ''}{plain}"


def _unexpected(arg: str, cls: type[JobConfig]) -> ConfigError:
    """The error for an argument tyro left over."""
    section, key = _flag_key(arg)
    if not (arg.startswith("--") and key):
        return ConfigError(f"unexpected argument {arg!r} (flags are --section.key=value)")
    if section not in field_types(cls):
        return _unknown_section(section, cls)
    return _unknown_key(section, key, cls)


def _refused(args: list[str], cls: type[JobConfig]) -> ConfigError:
    """The error for flags tyro refuses, which (values that do not parse it passes on) is a
    flag without its value."""
    for arg, following in zip(args, [*args[1:], "--"]):
        section, key = _flag_key(arg)
        if (arg.startswith("--") and "=" not in arg and following.startswith("--")
                and not _is_bool(section, key.removeprefix("no_"), cls)):
            return ConfigError(f"{section}.{key}: no value given (--{section}.{key}=VALUE)")
    return ConfigError(f"the flags do not parse: {' '.join(args)}")


def _with_flags(base: JobConfig, args: list[str]) -> JobConfig:
    """`base` with the flags applied, as tyro parses them (--help: tyro's help, then exit)."""
    import tyro

    cls = type(base)
    helping = "-h" in args or "--help" in args
    args = [_flag_form(arg, cls) for arg in args]
    try:
        config, unknown = tyro.cli(cls, args=args, default=base, registry=_registry(),
                                   use_underscores=True, console_outputs=helping,
                                   return_unknown_args=True)
    except SystemExit as e:
        if helping or e.code == 0:
            raise
        raise _refused(args, cls) from None
    if unknown:
        raise _unexpected(unknown[0], cls)
    return config


def _config_file_arg(args: list[str]) -> str | None:
    """The last --job.config_file given ("None": none, as tyro reads it)."""
    path = None
    for i, arg in enumerate(args):
        key, eq, value = arg.partition("=")
        if key in ("--job.config_file", "--job.config-file"):
            path = value if eq else args[i + 1] if i + 1 < len(args) else None
    return None if path == "None" else path


def parse_config(args: list[str], cls: type[JobConfig] = JobConfig) -> JobConfig:
    """Defaults < TOML (--job.config_file) < flags; raises ConfigError on any mistake, before
    any work starts. `cls`: JobConfig, or a recipe's extension of it with sections of its own
    (as torchtitan's custom config modules extend theirs)."""
    path = _config_file_arg(args)
    with _keys_named(cls=cls):
        config = _with_flags(cls() if path is None else _from_toml(path, cls), args)
    config = _with_policy_file(config)
    _check_paths(config)
    _check_combinations(config)
    _check_activation(config, resolve_model(config)[1])
    return config
