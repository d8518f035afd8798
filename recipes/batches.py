"""This rank's infinite stream of micro-batches: uniform random tokens (training.dataset =
"synthetic") or the packed files of recipes/data.py, resumable at step boundaries."""

from collections.abc import Iterator
from typing import Protocol

import torch

from protocols.backend import Batch
from protocols.model_spec import ModelArgs
from recipes.config import JobConfig
from recipes.preflight import data_error, load_checked_tokenizer


class SyntheticBatches:
    """Uniform random tokens, every position a target. Global sample g comes from its own
    generator seeded by (seed, g), and rank r takes samples r, r + W, ... of each global
    micro-batch (as PackedDataLoader does), so any world size sees the same global batches.
    The position is the number of micro-batches drawn, the same on every rank."""

    def __init__(self, *, vocab_size: int, seq_len: int, local_batch_size: int, dp_rank: int,
                 dp_world: int, seed: int) -> None:
        self.vocab_size, self.seq_len, self.local_batch_size = vocab_size, seq_len, local_batch_size
        self.dp_rank, self.dp_world, self.seed = dp_rank, dp_world, seed
        self.drawn = 0

    def _batch(self, index: int) -> Batch:
        generator = torch.Generator()
        first = index * self.local_batch_size * self.dp_world
        rows = []
        for i in range(self.local_batch_size):
            generator.manual_seed((self.seed << 32) + first + i * self.dp_world + self.dp_rank)
            rows.append(torch.randint(self.vocab_size, (self.seq_len + 1,), generator=generator))
        tokens = torch.stack(rows)
        return tokens[:, :-1], tokens[:, 1:]

    def __iter__(self) -> Iterator[Batch]:
        while True:
            batch = self._batch(self.drawn)
            self.drawn += 1
            yield batch

    def state_dict(self) -> dict:
        return {"micro_batches": self.drawn}

    def load_state_dict(self, sd: dict) -> None:
        self.drawn = sd["micro_batches"]


class BatchSource(Protocol):
    """This rank's infinite stream of micro-batches, resumable at step boundaries (its state is
    the same on every rank): SyntheticBatches or recipes.data.PackedDataLoader."""

    def __iter__(self) -> Iterator[Batch]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, sd: dict) -> None: ...


def build_batches(config: JobConfig, args: ModelArgs, *, dp_rank: int,
                  dp_world: int) -> BatchSource:
    """This rank's infinite stream of (input_ids, labels) micro-batches. A bad tokenizer or data
    record is a ConfigError naming it (file:line), raised before any model is built."""
    training = config.training
    shape = dict(seq_len=training.seq_len, local_batch_size=training.local_batch_size,
                 dp_rank=dp_rank, dp_world=dp_world, seed=training.seed)
    if training.dataset == "synthetic":
        return SyntheticBatches(vocab_size=args.vocab_size, **shape)
    from recipes.data import PackedDataLoader  # tokenizers/pyarrow only for files
    from recipes.documents import DataError

    tokenizer, eos_id = load_checked_tokenizer(config, args)
    try:
        return PackedDataLoader(training.dataset_path, tokenizer, eos_id=eos_id, **shape)
    except DataError as e:
        raise data_error(e) from None
