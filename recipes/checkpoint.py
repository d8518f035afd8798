"""The resumable training state, saved next to each Hugging Face checkpoint:

    <save_dir>/step-N/                 Hugging Face weights (BF16), see models/hf_checkpoint.py
    <save_dir>/step-N/train_state/     meta.json + the backend's exact FP32 weights and optimizer
                                       state (TrainBackend.snapshot_state)

meta.json holds the step, the run's shape (mode, world size, model, seed), the data position and
FORMAT_VERSION. A save is a snapshot, taken in the loop after step N, and a write, in a thread of
its own that training does not wait for (checkpoint.async_mode = "async"):
1. every rank writes its part of the snapshot into <save_dir>/step-N.train_state.tmp/;
2. once every rank has (a barrier of the writer threads, on a gloo group of their own), rank 0
   exports the Hugging Face weights, read back from those files, into step-N/ (replacing any
   earlier step-N), adds meta.json and renames the directory to step-N/train_state: the mark of
   a complete save;
3. rank 0 deletes the complete saves older than the newest checkpoint.keep_latest_k, and what
   saves cut short left behind.
One save is in flight at a time. A crash at any point leaves every complete save complete, and
"latest" (the complete step-N with the largest N) is never a save cut short.
"""

import json
import logging
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from protocols.backend import TrainBackend
from recipes.nonfinite import NonFiniteStop

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
TRAIN_STATE = "train_state"
META_FILE = "meta.json"
_STEP_DIR = re.compile(r"step-(\d+)")
_LEFTOVER = re.compile(r"step-\d+\..+")  # step-N.tmp (HF), step-N.train_state.tmp, *.deleting

HFExport = Callable[[Iterator[tuple[str, torch.Tensor]], Path], None]
"""Writes a Hugging Face model directory from (parameter name, full FP32 tensor) pairs."""


def step_dir(save_dir: str, step: int) -> Path:
    return Path(save_dir) / f"step-{step}"


def staging_dir(save_dir: str, step: int) -> Path:
    """Where the ranks write step `step`'s train state before it is complete."""
    return Path(save_dir) / f"step-{step}.{TRAIN_STATE}.tmp"


def is_complete(directory: Path) -> bool:
    """A step directory whose train state was fully written."""
    return (directory / TRAIN_STATE / META_FILE).is_file()


def _complete_saves(save_dir: str) -> dict[int, Path]:
    steps = {}
    for entry in Path(save_dir).glob("step-*"):
        match = _STEP_DIR.fullmatch(entry.name)
        if match and is_complete(entry):
            steps[int(match.group(1))] = entry
    return steps


def latest_checkpoint(save_dir: str) -> Path | None:
    """The complete step-N directory under save_dir with the largest N, if any."""
    steps = _complete_saves(save_dir)
    return steps[max(steps)] if steps else None


def read_meta(directory: Path) -> dict[str, Any]:
    return json.loads((directory / TRAIN_STATE / META_FILE).read_text())


def prune(save_dir: str, *, keep: int) -> list[Path]:
    """Delete what saves cut short left and, with keep > 0, the complete saves older than the
    newest `keep` (so never the newest); returns the deleted paths. Rank 0, no save in flight."""
    complete = _complete_saves(save_dir)
    doomed = [e for e in Path(save_dir).glob("step-*") if _LEFTOVER.fullmatch(e.name)
              or (_STEP_DIR.fullmatch(e.name) and e not in complete.values())]
    for entry in doomed:
        shutil.rmtree(entry, ignore_errors=True)
    old = [complete[step] for step in sorted(complete)[:-keep]] if keep else []
    for entry in old:
        _delete_complete(entry)
    return doomed + old


def remove_saves(save_dir: str) -> list[Path]:
    """Every save in `save_dir`, complete or cut short (job.overwrite: a new run replaces the
    folder's earlier run, whose saves `latest` would otherwise still name); returns them."""
    removed = prune(save_dir, keep=0)
    for entry in _complete_saves(save_dir).values():
        _delete_complete(entry)
        removed.append(entry)
    return removed


def _delete_complete(entry: Path) -> None:
    """Renamed first: a crash while deleting never leaves a half-deleted directory that still
    looks complete."""
    trash = entry.with_name(entry.name + ".deleting")
    entry.rename(trash)
    shutil.rmtree(trash, ignore_errors=True)


class NonFiniteWeights(NonFiniteStop):
    """A save found weights that are not finite: the step is not saved and the run stops."""


def _finite(tensors: Iterator[tuple[str, torch.Tensor]], step: int
            ) -> Iterator[tuple[str, torch.Tensor]]:
    """`tensors`, each checked as it goes to the export: a weight that is not finite raises
    NonFiniteWeights before it is written."""
    for name, tensor in tensors:
        if not torch.isfinite(tensor).all():
            bad = int((~torch.isfinite(tensor)).sum())
            raise NonFiniteWeights(f"step {step} not saved: {name} has {bad} of "
                                   f"{tensor.numel()} elements not finite (the updates "
                                   "diverged: lower optimizer.lr, or clip with training.max_norm)")
        yield name, tensor


class CheckpointSaver:
    """The saves of one run (see the module's docstring); every rank makes one, in the same
    order relative to other process groups, and calls `save` at the same steps."""

    def __init__(self, backend: TrainBackend, *, save_dir: str, keep_latest_k: int,
                 background: bool, rank: int, export_hf: HFExport) -> None:
        self.backend, self.save_dir, self.keep = backend, save_dir, keep_latest_k
        self.background, self.rank, self.export_hf = background, rank, export_hf
        # The writer threads' own collectives: ordered among themselves, never against the
        # training thread's.
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, step: int, meta: dict[str, Any]) -> float:
        """Save the state after step `step` with `meta` (meta.json, with the format version);
        returns the seconds the caller was held: the end of the previous save, the snapshot,
        and the whole write with async_mode = "disabled"."""
        start = time.perf_counter()
        self.wait()
        write = self.backend.snapshot_state(self.group)
        if self.background:
            self._thread = threading.Thread(target=self._write, args=(write, step, meta),
                                            name=f"save-step-{step}", daemon=True)
            self._thread.start()
        else:
            self._write(write, step, meta)
            self.raise_failure()
        return time.perf_counter() - start

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    def _write(self, write: Callable[[str], None], step: int, meta: dict[str, Any]) -> None:
        try:
            start = time.perf_counter()
            staging = staging_dir(self.save_dir, step)
            if self.rank == 0:
                shutil.rmtree(staging, ignore_errors=True)
                staging.mkdir(parents=True)
            self._barrier()  # the directory exists before any rank writes into it
            write(str(staging))
            self._barrier()  # every rank's part is complete
            if self.rank == 0:
                self._complete(staging, step, meta, start)
        except BaseException as e:  # reported to the training thread by the next call
            self._error = e

    def _complete(self, staging: Path, step: int, meta: dict[str, Any], start: float) -> None:
        out = step_dir(self.save_dir, step)
        try:
            self.export_hf(_finite(self.backend.saved_master_parameters(str(staging)), step), out)
        except NonFiniteWeights:
            # Nothing of this step may stay to be loaded or resumed: not its weights, not its
            # state (a staging directory is never `latest`, but it is not kept either).
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(staging, ignore_errors=True)
            raise
        meta = {"format_version": FORMAT_VERSION, "step": step, **meta}
        (staging / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        staging.rename(out / TRAIN_STATE)
        how = "in the background" if self.background else "while training waited"
        logger.info("saved %s (Hugging Face weights + train state) in %.1f s %s", out,
                    time.perf_counter() - start, how)
        for path in prune(self.save_dir, keep=self.keep):
            logger.info("deleted %s (checkpoint.keep_latest_k = %d)", path, self.keep)

    def raise_failure(self) -> None:
        """Raise the error of a save that failed (its step was not saved)."""
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, NonFiniteWeights):
                raise error
            raise RuntimeError(f"saving a checkpoint to {self.save_dir} failed: {error}") from error

    def wait(self) -> None:
        """Until the save in flight is complete (on rank 0: exported, marked and pruned)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.raise_failure()
