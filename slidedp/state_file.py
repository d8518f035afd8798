"""One rank's part of the host state on disk, as stored (FP32; a BF16 master, BF16 or 8-bit
moments as such), for exact resume.

Rank r of R writes `slidedp-rank{r}-of-{R}.safetensors` with its shard (`Unit.shard(r, R)`,
padding included) of every unit in each region of the optimizer state (`master`, `exp_avg`,
`exp_avg_sq`, and for 8-bit moments their scales; HostStatePlan.state_regions), named
`{region}.u{unit}` (e.g. `master.u12`), and the step counts in the file's metadata (the
backend's steps, and Adam's, which skipped non-finite steps do not advance). A run whose moments
are stored otherwise than the save's converts them on load (8-bit ones through FP32).
The BF16 shadow is not saved: it is the master rounded, rebuilt on load.

The file is written unit by unit, in an order the caller chooses, straight from the shared
mapping (safetensors' own writer would need a copy of the whole shard in memory), and read back
one tensor at a time. Written unit by unit so that a save running in the background can let
each unit's next update go as soon as that unit is on disk (SlideDPBackend.snapshot_state).
"""

import contextlib
import json
import os
import re
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from slidedp import cpu_adam
from slidedp.host_state import MOMENT_SCALES, SharedHostState
from slidedp.layout import StateLayout, Unit

_STEPS_KEY, _ADAM_STEPS_KEY = "steps_done", "adam_steps"
_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.uint8: "U8"}
_FILE = re.compile(r"slidedp-rank\d+-of-(\d+)\.safetensors")


def state_file(directory: str, *, rank: int, world: int) -> Path:
    return Path(directory) / f"slidedp-rank{rank}-of-{world}.safetensors"


def _unit_shards(state: SharedHostState, unit: Unit) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, view into the shared mapping) of this rank's shard of `unit`, every region."""
    for region in state.plan.state_regions():
        yield f"{region}.u{unit.index}", state.shard_view(region, unit)


def _header(tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> bytes:
    """The safetensors header (JSON, space-padded to 8 bytes) for tensors laid out in order."""
    entries: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        entries[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                         "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8)


def save_shards(state: SharedHostState, directory: str, *, steps_done: int, adam_steps: int,
                units: list[Unit], unit_written: Callable[[Unit], None]) -> None:
    """Write this rank's shards of `units` (every unit, in the order to write them), calling
    `unit_written(unit)` once a unit's bytes have left the shared mapping. The caller makes sure
    no update of this rank touches a unit before it is written."""
    tensors = [named for unit in units for named in _unit_shards(state, unit)]
    header = _header(tensors, {_STEPS_KEY: str(steps_done), _ADAM_STEPS_KEY: str(adam_steps)})
    with open(state_file(directory, rank=state.rank, world=state.world), "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for unit in units:
            for _, t in _unit_shards(state, unit):
                # Host memory, little-endian as safetensors stores it (numpy has no BF16).
                f.write(t.view(torch.uint8).numpy().data)
            unit_written(unit)
        f.flush()
        os.fsync(f.fileno())  # on disk before the save is marked complete


def _saved_world_sizes(directory: str) -> list[int]:
    return sorted({int(m.group(1)) for p in Path(directory).iterdir()
                   if (m := _FILE.fullmatch(p.name))})


def load_shards(state: SharedHostState, directory: str) -> tuple[int, int]:
    """Read this rank's shards into the host state; returns the saved (steps, Adam steps)."""
    path = state_file(directory, rank=state.rank, world=state.world)
    if not path.is_file():
        raise ValueError(f"{directory} holds SlideDP state of world size "
                         f"{_saved_world_sizes(directory) or 'none'}, this run has {state.world} "
                         "ranks: resume with the same number of ranks")
    with safe_open(path, framework="pt") as f:
        for unit in state.layout.units:
            for name, dest in _unit_shards(state, unit):
                region = name.split(".")[0]
                if region in MOMENT_SCALES.values():
                    continue  # read with its moment
                saved = f.get_tensor(name)
                if saved.shape != dest.shape:
                    raise ValueError(f"{path}: {name} has {saved.numel()} elements, this model's "
                                     f"shard {dest.numel()}: saved from a different model")
                if region in MOMENT_SCALES:
                    _load_moment(f, state, unit, region, saved, dest)
                else:
                    dest.copy_(saved)
        meta = f.metadata()
    steps = int(meta[_STEPS_KEY])
    return steps, int(meta.get(_ADAM_STEPS_KEY, steps))  # saves from before skipping existed


def _load_moment(f, state: SharedHostState, unit: Unit, region: str, saved: torch.Tensor,
                 dest: torch.Tensor) -> None:
    """A saved moment into `dest`, with its block scales where either side is 8-bit: as stored,
    or converted (8-bit codes dequantized to FP32; FP32 or BF16 quantized as the CPU Adam stores
    them)."""
    signed, scales = region == "exp_avg", MOMENT_SCALES[region]
    if saved.dtype == torch.uint8:
        scale = f.get_tensor(f"{scales}.u{unit.index}")
        if dest.dtype == torch.uint8:
            dest.copy_(saved)
            state.shard_view(scales, unit).copy_(scale)
        else:
            dest.copy_(cpu_adam.dequantize_moment(saved, scale, signed=signed))
    elif dest.dtype == torch.uint8:
        cpu_adam.quantize_moment(saved.float(), signed=signed, codes=dest,
                                 scale=state.shard_view(scales, unit))
    else:
        dest.copy_(saved)  # FP32 or BF16 either side: copy_ rounds to nearest even


def read_master(layout: StateLayout, directory: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Full master weights (FP32, or a BF16 master) by parameter name, assembled unit by unit
    from every rank's file in `directory` (written for `layout.world` ranks)."""
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(safe_open(state_file(directory, rank=r, world=layout.world),
                                               framework="pt"))
                 for r in range(layout.world)]
        for unit in layout.units:
            flat = torch.cat([f.get_tensor(f"master.u{unit.index}") for f in files])
            for p in unit.params:
                yield p.name, flat[p.offset:p.offset + p.numel].view(p.shape)
