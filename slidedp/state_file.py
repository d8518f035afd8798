"""One rank's part of the FP32 host state on disk, for exact resume.

Rank r of R writes `slidedp-rank{r}-of-{R}.safetensors` with its shard (`Unit.shard(r, R)`,
padding included) of every unit in each of the regions `master`, `exp_avg`, `exp_avg_sq`, named
`{region}.u{unit}` (e.g. `master.u12`), and the optimizer step count in the file's metadata.
The BF16 shadow is not saved: it is the master rounded, rebuilt on load.

The file is written tensor by tensor straight from the shared mapping (safetensors' own writer
would need a copy of the whole shard in memory), and read back one tensor at a time.
"""

import json
import re
import struct
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from slidedp.host_state import SharedHostState

REGIONS = ("master", "exp_avg", "exp_avg_sq")
_STEPS_KEY = "steps_done"
_FILE = re.compile(r"slidedp-rank\d+-of-(\d+)\.safetensors")


def state_file(directory: str, *, rank: int, world: int) -> Path:
    return Path(directory) / f"slidedp-rank{rank}-of-{world}.safetensors"


def _owned_shards(state: SharedHostState) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, view into the shared mapping) of every region's shard of every unit."""
    for region in REGIONS:
        for unit in state.layout.units:
            lo, hi = unit.shard(state.rank, state.world)
            yield f"{region}.u{unit.index}", state.unit_view(region, unit.index, lo, hi)


def _header(tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> bytes:
    """The safetensors header (JSON, space-padded to 8 bytes) for FP32 tensors laid out in order."""
    entries: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        entries[name] = {"dtype": "F32", "shape": list(t.shape),
                         "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8)


def save_shards(state: SharedHostState, directory: str, *, steps_done: int) -> None:
    """Write this rank's shards; the caller makes sure its updates have finished."""
    tensors = list(_owned_shards(state))
    header = _header(tensors, {_STEPS_KEY: str(steps_done)})
    with open(state_file(directory, rank=state.rank, world=state.world), "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for _, t in tensors:
            f.write(t.numpy().data)  # host memory, little-endian FP32 as safetensors stores it


def _saved_world_sizes(directory: str) -> list[int]:
    return sorted({int(m.group(1)) for p in Path(directory).iterdir()
                   if (m := _FILE.fullmatch(p.name))})


def load_shards(state: SharedHostState, directory: str) -> int:
    """Read this rank's shards into the host state; returns the saved optimizer step count."""
    path = state_file(directory, rank=state.rank, world=state.world)
    if not path.is_file():
        raise ValueError(f"{directory} holds SlideDP state of world size "
                         f"{_saved_world_sizes(directory) or 'none'}, this run has {state.world} "
                         "ranks: resume with the same number of ranks")
    with safe_open(path, framework="pt") as f:
        for name, dest in _owned_shards(state):
            saved = f.get_tensor(name)
            if saved.shape != dest.shape:
                raise ValueError(f"{path}: {name} has {saved.numel()} elements, this model's "
                                 f"shard {dest.numel()}: saved from a different model")
            dest.copy_(saved)
        return int(f.metadata()[_STEPS_KEY])
