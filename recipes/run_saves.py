"""A run's side of its saves (recipes/checkpoint.py writes them): the Hugging Face export a save
carries, and what a resumed run restores from one before its first step."""

from collections.abc import Iterator
from pathlib import Path

import torch

from protocols.backend import TrainBackend
from protocols.model_spec import ModelArgs
from recipes.batches import BatchSource
from recipes.checkpoint import TRAIN_STATE, HFExport
from recipes.config import ConfigError, JobConfig


def hf_exporter(config: JobConfig, args: ModelArgs) -> HFExport:
    """The Hugging Face export of a save: the model's config (the source model's, if it was
    fine-tuned from one) and tokenizer with the weights."""
    hf_dir = config.model.hf_dir

    def export(tensors: Iterator[tuple[str, torch.Tensor]], out: Path) -> None:
        from models.hf_checkpoint import load_config_json, save_hf_checkpoint

        save_hf_checkpoint(tensors, args, out,
                           copy_tokenizer_from=config.model.tokenizer_dir or hf_dir or None,
                           source_config=load_config_json(hf_dir) if hf_dir else None)

    return export


def restore_data_position(data: BatchSource, directory: Path, meta: dict) -> None:
    """The data position saved in `directory` (its `meta`), or a ConfigError where this run's
    loader cannot continue it (the data files or seq_len changed). It runs before the backend
    is built and the records are cut back to the save, so a refused resume touches nothing."""
    try:
        data.load_state_dict(meta["data"])
    except ValueError as e:
        raise ConfigError(f"checkpoint.resume_from: {directory}: {e}") from None


def load_backend_state(backend: TrainBackend, directory: Path, meta: dict) -> int:
    """Restore the backend's state saved in `directory` (its `meta`); returns its step."""
    step = backend.load_state(str(directory / TRAIN_STATE))
    if step != meta["step"]:
        raise ValueError(f"{directory}: the backend state is at step {step}, meta.json says "
                         f"{meta['step']}")
    return step
