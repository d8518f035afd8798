"""Hugging Face checkpoint I/O: read config.json, stream safetensors into a model, save back.

A model directory is what `huggingface-cli download Qwen/Qwen3-8B` produces: config.json, one
`model.safetensors` or sharded `model-0000i-of-0000N.safetensors` plus
`model.safetensors.index.json`, and tokenizer files. Loading moves one tensor at a time and saving
one shard at a time, so host memory never holds a second copy of the model.

Names inside this module are the model's (`layers.0.mlp.up_proj.weight`); the files use HF's,
which the family's adapter maps them to and back (models/hf_config.py: CausalLMNames).
"""

import dataclasses
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from models.meta import on_meta
from protocols.model_spec import ModelArgs, spec_of, spec_of_model_type

logger = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "generation_config.json", "special_tokens_map.json")


# ----------------------------------------------------------------------------- config.json


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from None


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def _model_path(model_dir: PathLike) -> Path:
    path = Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory not found: {path}")
    return path


def load_config_json(model_dir: PathLike) -> dict[str, Any]:
    """The raw config.json of a model directory (pass it to save as `source_config`)."""
    path = _model_path(model_dir) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found (a Hugging Face model directory needs one)")
    return _read_json(path)


def args_from_hf_config(cfg: dict[str, Any], *, origin: str = CONFIG_FILE) -> ModelArgs:
    """A flavor's args from a parsed config.json, by the spec that reads its model_type;
    `origin` names the file in error messages."""
    spec = spec_of_model_type(cfg.get("model_type"), origin=origin)
    return spec.hf.args_from_hf_config(cfg, origin=origin)


def read_hf_config(model_dir: PathLike) -> ModelArgs:
    """ModelArgs of a Hugging Face model directory, parsed from its config.json."""
    return args_from_hf_config(load_config_json(model_dir),
                               origin=str(Path(model_dir) / CONFIG_FILE))


def match_flavor(args: ModelArgs) -> str | None:
    """Name of the spec's flavor with the same architecture (context length and RoPE scaling
    ignored), if any."""
    key = dataclasses.replace(args, max_position_embeddings=0, rope_scaling=None)
    for name, flavor in spec_of(args).flavors.items():
        if dataclasses.replace(flavor, max_position_embeddings=0, rope_scaling=None) == key:
            return name
    return None


def to_hf_config(args: ModelArgs, *, dtype: torch.dtype = torch.bfloat16,
                 source_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json contents for `args` (its spec's adapter). Extra keys of `source_config`
    (bos/eos ids, transformers_version, ...) are kept; architecture keys are always ours."""
    return spec_of(args).hf.to_hf_config(args, dtype=dtype, source_config=source_config)


def param_shapes(args: ModelArgs) -> dict[str, torch.Size]:
    """Name -> shape of every parameter of `args`'s model, built on the meta device (no memory)."""
    with on_meta():
        model = spec_of(args).model_cls(args)
    return {name: p.shape for name, p in model.named_parameters()}


# ----------------------------------------------------------------------------- loading


class _Entry(NamedTuple):
    file: Path
    key: str
    shape: torch.Size


def _checkpoint_files(path: Path) -> list[Path]:
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    index = path / INDEX_FILE
    if not index.is_file():
        raise FileNotFoundError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: missing field 'weight_map'")
    files = [path / name for name in sorted(set(weight_map.values()))]
    absent = [f.name for f in files if not f.is_file()]
    if absent:
        raise FileNotFoundError(f"{index}: listed shard files not found: {absent}")
    return files


def _locate_tensors(model_dir: PathLike) -> dict[str, _Entry]:
    """Where each tensor lives, in file order, read from the safetensors headers only."""
    path = _model_path(model_dir)
    args = read_hf_config(path)
    hf = spec_of(args).hf
    entries: dict[str, _Entry] = {}
    for file in _checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                name = hf.from_hf_name(key)
                if args.tie_embeddings and name == hf.head:
                    continue  # some tied exports still write the head; it is the embedding
                if name in entries:
                    raise ValueError(f"{path}: tensor {key!r} is in both {entries[name].file.name} "
                                     f"and {file.name}")
                entries[name] = _Entry(file, key, torch.Size(f.get_slice(key).get_shape()))
    return entries


def _read_entries(entries: dict[str, _Entry], names: Iterable[str]
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(entries[name].file, []).append(name)
    for file, group in by_file.items():
        with safe_open(file, framework="pt") as f:
            for name in group:
                yield name, f.get_tensor(entries[name].key)


def hf_tensor_shapes(model_dir: PathLike) -> dict[str, torch.Size]:
    """Name -> shape of every tensor in the checkpoint, without reading any tensor data."""
    return {name: entry.shape for name, entry in _locate_tensors(model_dir).items()}


def iter_hf_tensors(model_dir: PathLike, *, names: set[str] | None = None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs read one at a time in the file's dtype, only `names` if given (names
    the checkpoint lacks are skipped). For a tied model any lm_head.weight in the files is skipped.
    Not a generator itself, so a bad directory fails here rather than at the first `next`."""
    entries = _locate_tensors(model_dir)
    return _read_entries(entries, [n for n in entries if names is None or n in names])


def _preview(names: list[str], *, limit: int = 5) -> str:
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _mismatch_message(found: dict[str, torch.Size], expected: dict[str, torch.Size], *,
                      strict: bool) -> str | None:
    """One line describing how `found` differs from `expected`, or None when it loads."""
    missing = sorted(expected.keys() - found.keys())
    unexpected = sorted(found.keys() - expected.keys())
    wrong = [f"{n} {tuple(found[n])} vs expected {tuple(expected[n])}"
             for n in sorted(found.keys() & expected.keys()) if found[n] != expected[n]]
    if not strict and (missing or unexpected):
        logger.warning("non-strict load: missing [%s]; unexpected [%s]",
                       _preview(missing), _preview(unexpected))
        missing, unexpected = [], []
    parts = [f"{what} [{_preview(items)}]" for what, items in
             (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)) if items]
    return "; ".join(parts) or None


def _checked_entries(model_dir: PathLike, expected: dict[str, torch.Size], *,
                     strict: bool) -> dict[str, _Entry]:
    entries = _locate_tensors(model_dir)
    problem = _mismatch_message({n: e.shape for n, e in entries.items()}, expected, strict=strict)
    if problem:
        raise ValueError(f"{model_dir}: checkpoint does not match the model: {problem}")
    return entries


def check_hf_tensors(model_dir: PathLike, args: ModelArgs) -> None:
    """Raise (FileNotFoundError, ValueError or safetensors' SafetensorError) unless the
    safetensors files exist and their headers hold exactly the tensors of `args`'s model; reads
    headers only, so a run can check its checkpoint before anything is allocated."""
    _checked_entries(model_dir, param_shapes(args), strict=True)


def load_hf_into(dest: Callable[[str, torch.Tensor], None], model_dir: PathLike,
                 expected: dict[str, torch.Size], *, strict: bool = True) -> None:
    """Stream the checkpoint into `dest(name, tensor)`, one tensor at a time in the file's dtype
    (dest converts). Names and shapes are checked against `expected` before any data is read, so
    a mismatch leaves the destination untouched. strict=False tolerates missing/unexpected names."""
    entries = _checked_entries(model_dir, expected, strict=strict)
    for name, tensor in _read_entries(entries, [n for n in entries if n in expected]):
        dest(name, tensor)


@torch.no_grad()
def load_hf_into_model(model: nn.Module, model_dir: PathLike, *, strict: bool = True) -> None:
    """Copy a Hugging Face checkpoint into `model`'s parameters in place (cast to their dtype)."""
    params = dict(model.named_parameters())
    load_hf_into(lambda name, tensor: params[name].copy_(tensor), model_dir,
                 {name: p.shape for name, p in params.items()}, strict=strict)


# ----------------------------------------------------------------------------- saving


class _ShardWriter:
    """Accumulates tensors until `max_shard_bytes` and writes each full shard, so memory holds at
    most one shard. Shards get their final `-of-N` names in `finish`, once N is known."""

    def __init__(self, out: Path, *, max_shard_bytes: int):
        self.out, self.max_shard_bytes = out, max_shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.total_bytes = 0
        self.shard_keys: list[list[str]] = []

    def add(self, key: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self.pending[key] = tensor
        self.pending_bytes += nbytes
        self.total_bytes += nbytes

    def _partial(self, i: int) -> Path:
        return self.out / f"shard-{i:05d}.partial"

    def _flush(self) -> None:
        path = self._partial(len(self.shard_keys))
        save_file(self.pending, path, metadata={"format": "pt"})
        path.chmod(_new_file_mode())  # safetensors creates it 0o600, unlike the other files
        self.shard_keys.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        self._flush()
        n = len(self.shard_keys)
        if n == 1:
            self._partial(0).rename(self.out / SINGLE_FILE)
            return
        weight_map = {}
        for i, keys in enumerate(self.shard_keys):
            name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            self._partial(i).rename(self.out / name)
            weight_map.update(dict.fromkeys(keys, name))
        _write_json(self.out / INDEX_FILE, {"metadata": {"total_size": self.total_bytes},
                                            "weight_map": dict(sorted(weight_map.items()))})


def _check_save_name(name: str, shape: torch.Size, expected: dict[str, torch.Size],
                     seen: set[str]) -> None:
    # Checked per tensor so a wrong name fails before gigabytes are written.
    if name not in expected:
        raise ValueError(f"cannot save tensor {name!r}: not a parameter of the model")
    if name in seen:
        raise ValueError(f"cannot save tensor {name!r}: given twice")
    if shape != expected[name]:
        raise ValueError(f"cannot save tensor {name!r}: shape {tuple(shape)} vs expected "
                         f"{tuple(expected[name])}")


def _write_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]], args: ModelArgs, out: Path,
                   *, dtype: torch.dtype, max_shard_bytes: int) -> None:
    expected, hf = param_shapes(args), spec_of(args).hf
    writer = _ShardWriter(out, max_shard_bytes=max_shard_bytes)
    seen: set[str] = set()
    for name, tensor in named_tensors:
        if args.tie_embeddings and name == hf.head:
            continue  # the head is the embedding; HF tied checkpoints omit it
        _check_save_name(name, tensor.shape, expected, seen)
        seen.add(name)
        # A fresh contiguous CPU copy: safetensors refuses views that share storage (flat buffers).
        writer.add(hf.to_hf_name(name),
                   tensor.detach().to("cpu", dtype=dtype, memory_format=torch.contiguous_format,
                                      copy=True))
    missing = sorted(expected.keys() - seen)
    if missing:
        raise ValueError(f"cannot save checkpoint: missing tensors [{_preview(missing)}]")
    writer.finish()


def _copy_tokenizer(src: Path, dst: Path) -> None:
    if not src.is_dir():
        raise FileNotFoundError(f"tokenizer directory not found: {src}")
    copied = [name for name in TOKENIZER_FILES if (src / name).is_file()]
    for name in copied:
        shutil.copy2(src / name, dst / name)
    if not copied:
        logger.warning("no tokenizer files in %s; the saved model has none", src)


def _new_file_mode() -> int:
    """The mode open() gives a new file here: 0o666 less the process's umask (read from
    /proc, as os.umask can only be read by setting it, which other threads would see)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except OSError:
        pass
    return 0o644


def save_hf_checkpoint(named_tensors: Iterable[tuple[str, torch.Tensor]], args: ModelArgs,
                       out_dir: PathLike, *, dtype: torch.dtype = torch.bfloat16,
                       max_shard_bytes: int = 5 * 2**30,
                       copy_tokenizer_from: PathLike | None = None,
                       source_config: dict[str, Any] | None = None) -> None:
    """Write a Hugging Face model directory from (model parameter name, full tensor) pairs,
    streaming shard by shard. Everything goes to `out_dir.tmp` first and is renamed into place at the end,
    so a crash never leaves a directory that looks complete; an existing `out_dir` is replaced."""
    out = Path(out_dir).absolute()  # so "." or "x/" still have a name to suffix
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # leftover of an earlier crash
    tmp.mkdir(parents=True)
    try:
        if copy_tokenizer_from is not None:
            _copy_tokenizer(Path(copy_tokenizer_from), tmp)
        _write_tensors(named_tensors, args, tmp, dtype=dtype, max_shard_bytes=max_shard_bytes)
        _write_json(tmp / CONFIG_FILE, to_hf_config(args, dtype=dtype, source_config=source_config))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
