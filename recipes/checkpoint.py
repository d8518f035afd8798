"""The resumable training state, saved next to each Hugging Face checkpoint:

    <save_dir>/step-N/                 Hugging Face weights (BF16), see models/hf_checkpoint.py
    <save_dir>/step-N/train_state/     meta.json + the backend's exact FP32 weights and optimizer
                                       state (TrainBackend.save_state)

meta.json holds the step, the run's shape (mode, world size, model, seed), the data position and
FORMAT_VERSION. The directory is written as train_state.tmp and renamed last, so a save cut short
by a crash never has train_state/meta.json and is never taken as the "latest" checkpoint.
"""

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from protocols.backend import TrainBackend

FORMAT_VERSION = 1
TRAIN_STATE = "train_state"
META_FILE = "meta.json"
_STEP_DIR = re.compile(r"step-(\d+)")


def step_dir(save_dir: str, step: int) -> Path:
    return Path(save_dir) / f"step-{step}"


def is_complete(directory: Path) -> bool:
    """A step directory whose train state was fully written."""
    return (directory / TRAIN_STATE / META_FILE).is_file()


def latest_checkpoint(save_dir: str) -> Path | None:
    """The complete step-N directory under save_dir with the largest N, if any."""
    steps = {}
    for entry in Path(save_dir).glob("step-*"):
        match = _STEP_DIR.fullmatch(entry.name)
        if match and is_complete(entry):
            steps[int(match.group(1))] = entry
    return steps[max(steps)] if steps else None


def read_meta(directory: Path) -> dict[str, Any]:
    return json.loads((directory / TRAIN_STATE / META_FILE).read_text())


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_train_state(backend: TrainBackend, directory: Path, meta: dict[str, Any], *,
                     rank: int) -> None:
    """Every rank writes its part of the backend state into directory/train_state.tmp; rank 0
    then adds meta.json and renames it into place. Call after the Hugging Face save, which
    replaces the whole step directory."""
    tmp = directory / f"{TRAIN_STATE}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # leftover of an earlier crash
        tmp.mkdir(parents=True)
    _barrier()  # the directory exists before any rank writes into it
    backend.save_state(str(tmp))
    _barrier()  # every rank's files are complete before the save is marked complete
    if rank == 0:
        meta = {"format_version": FORMAT_VERSION, **meta}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        tmp.rename(directory / TRAIN_STATE)
