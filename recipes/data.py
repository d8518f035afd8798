"""Data pipeline: the documents (recipes/documents.py) tokenized once, packed into samples,
sharded across data-parallel ranks, resumable (the tokenizer: recipes/tokenizer.py).

Every document is tokenized once at start-up (4 bytes per token for ids plus 1 for the target
mask), EOS appended. Each epoch concatenates the documents in a seeded order into one infinite
stream, cut into samples of seq_len + 1 tokens. Data-parallel rank r takes samples r, r + W, ...
of every global step of local_batch_size * W samples, so shards are disjoint and equally long.
"""

import hashlib
import logging
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer

from models.loss import IGNORE_INDEX
from recipes.documents import DataError, Document, read_documents

logger = logging.getLogger(__name__)

_ENCODE_BATCH = 1024  # segments per tokenizer call: amortizes the Rust call, bounds memory


# ---------------------------------------------------------------------------------------------
# Tokenized corpus


@dataclass(frozen=True)
class TokenizedCorpus:
    """All documents' tokens back to back, each ending in EOS."""

    tokens: torch.Tensor
    """int32 (total_tokens,)."""
    targets: torch.Tensor
    """bool (total_tokens,): the token is a loss target."""
    offsets: torch.Tensor
    """int64 (num_docs + 1,): document d is tokens[offsets[d]:offsets[d + 1]]."""

    @property
    def num_docs(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


def _batched(documents: Iterable[Document], *, max_segments: int) -> Iterator[list[Document]]:
    batch, segments = [], 0
    for doc in documents:
        batch.append(doc)
        segments += len(doc.segments)
        if segments >= max_segments:
            yield batch
            batch, segments = [], 0
    if batch:
        yield batch


def tokenize_corpus(documents: Iterable[Document], tokenizer: Tokenizer, *,
                    eos_id: int) -> TokenizedCorpus:
    """Tokenize piece by piece (so target flags follow token edges), EOS after each document."""
    tokens, targets, offsets = array("i"), bytearray(), array("q", [0])
    for batch in _batched(documents, max_segments=_ENCODE_BATCH):
        texts = [text for doc in batch for text, _ in doc.segments]
        encodings = iter(tokenizer.encode_batch(texts, add_special_tokens=False))
        for doc in batch:
            for _, is_target in doc.segments:
                ids = next(encodings).ids
                tokens.extend(ids)
                targets.extend(bytes([is_target]) * len(ids))
            tokens.append(eos_id)
            targets.append(doc.eos_is_target)
            offsets.append(len(tokens))
    if len(offsets) == 1:
        raise ValueError("the data paths hold no documents")
    return TokenizedCorpus(tokens=torch.frombuffer(tokens, dtype=torch.int32),
                           targets=torch.frombuffer(targets, dtype=torch.bool),
                           offsets=torch.frombuffer(offsets, dtype=torch.int64))


def epoch_permutation(*, seed: int, epoch: int, num_docs: int) -> torch.Tensor:
    """Document order of one epoch; a hash of (seed, epoch) keeps nearby seeds unrelated."""
    digest = hashlib.sha256(f"{seed}:{epoch}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.randperm(num_docs, generator=generator)


# ---------------------------------------------------------------------------------------------
# Packed stream


class PackedStream:
    """Read head over the infinite concatenation of epochs of shuffled documents."""

    def __init__(self, corpus: TokenizedCorpus, *, seed: int, log_epochs: bool = True) -> None:
        """`log_epochs`: log each epoch's start (off where epochs are shorter than a step)."""
        self.corpus, self.seed, self.log_epochs = corpus, seed, log_epochs
        # The next token is at `offset` inside document order[cursor] of `epoch`.
        self.epoch, self.cursor, self.offset = 0, 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> torch.Tensor:
        return epoch_permutation(seed=self.seed, epoch=epoch, num_docs=self.corpus.num_docs)

    def seek(self, *, epoch: int, cursor: int, offset: int) -> None:
        if epoch != self.epoch:
            self._order = self._permutation(epoch)
        self.epoch, self.cursor, self.offset = epoch, cursor, offset

    def _next_epoch(self) -> None:
        self.seek(epoch=self.epoch + 1, cursor=0, offset=0)
        if self.log_epochs:
            logger.info("data: epoch %d begins (%d documents, %d tokens)",
                        self.epoch, self.corpus.num_docs, self.corpus.num_tokens)

    def _advance(self, n: int, *, collect: bool) -> list[tuple[int, int]]:
        """Move n tokens ahead; returns the (start, end) corpus ranges passed when collecting."""
        ranges = []
        offsets = self.corpus.offsets
        while n > 0:
            doc = int(self._order[self.cursor])
            start, doc_end = int(offsets[doc]) + self.offset, int(offsets[doc + 1])
            step = min(n, doc_end - start)
            if collect:
                ranges.append((start, start + step))
            n -= step
            self.offset += step
            if start + step == doc_end:
                self.cursor, self.offset = self.cursor + 1, 0
                if self.cursor == self.corpus.num_docs:
                    self._next_epoch()
        return ranges

    def skip(self, n: int) -> None:
        self._advance(n, collect=False)

    def take(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next n tokens (int32) and their target flags (bool)."""
        ranges = self._advance(n, collect=True)
        tokens = torch.cat([self.corpus.tokens[a:b] for a, b in ranges])
        targets = torch.cat([self.corpus.targets[a:b] for a, b in ranges])
        return tokens, targets


def shift_sample(tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """seq_len + 1 tokens -> (input_ids, labels); labels of non-target tokens are masked."""
    labels = tokens[1:].long().masked_fill(~targets[1:], IGNORE_INDEX)
    return tokens[:-1].long(), labels


class PackedDataLoader:
    """Infinite, deterministic, resumable batches of packed samples for one data-parallel rank.

    The position is kept at global-step boundaries (every rank reads past the other ranks'
    samples), so `state_dict()` is the same on every rank and may be saved from rank 0 only.
    """

    def __init__(self, paths: str, tokenizer: Tokenizer, *, eos_id: int, seq_len: int,
                 local_batch_size: int, dp_rank: int = 0, dp_world: int = 1, seed: int = 0) -> None:
        if seq_len < 1 or local_batch_size < 1:
            raise ValueError(f"seq_len ({seq_len}) and local_batch_size ({local_batch_size}) "
                             "must be >= 1")
        if not 0 <= dp_rank < dp_world:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, {dp_world})")
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        self.dp_rank, self.dp_world, self.seed = dp_rank, dp_world, seed
        self.corpus = tokenize_corpus(read_documents(paths), tokenizer, eos_id=eos_id)
        tokens, sample = self.corpus.num_tokens, seq_len + 1
        if tokens < sample:
            raise DataError(f"{paths}: {tokens:,} tokens, fewer than one sample of seq_len + 1 = "
                            f"{sample:,}: use more data or a smaller training.seq_len")
        step = sample * local_batch_size * dp_world
        if tokens < step and dp_rank == 0:  # said once, not by each rank or at each epoch
            logger.warning("data: %s holds %d tokens, fewer than one step's %d (%d samples of "
                           "%d): every step reads it more than once", paths, tokens, step,
                           local_batch_size * dp_world, sample)
        self.stream = PackedStream(self.corpus, seed=seed, log_epochs=tokens >= step)
        self.sample = 0  # global index of the next sample: the first of the next global step
        target_share = self.corpus.targets.count_nonzero().item() / self.corpus.num_tokens
        logger.info("data: %d documents, %d tokens (%.0f%% targets) from %s",
                    self.corpus.num_docs, self.corpus.num_tokens, 100 * target_share, paths)

    @property
    def epoch(self) -> int:
        return self.stream.epoch

    def _next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        sample_tokens = self.seq_len + 1
        step_samples = self.local_batch_size * self.dp_world
        inputs, labels = [], []
        head = 0  # samples of this global step already passed
        for i in range(self.local_batch_size):
            own = i * self.dp_world + self.dp_rank
            self.stream.skip(sample_tokens * (own - head))
            x, y = shift_sample(*self.stream.take(sample_tokens))
            inputs.append(x)
            labels.append(y)
            head = own + 1
        self.stream.skip(sample_tokens * (step_samples - head))
        self.sample += step_samples
        return torch.stack(inputs), torch.stack(labels)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(input_ids, labels), int64 (local_batch_size, seq_len); iterators share one position."""
        while True:
            yield self._next_batch()

    def _fingerprint(self) -> dict:
        """What must match for a saved position to mean the same samples."""
        return {"seed": self.seed, "seq_len": self.seq_len, "num_tokens": self.corpus.num_tokens}

    def state_dict(self) -> dict:
        position = {"epoch": self.stream.epoch, "cursor": self.stream.cursor,
                    "offset": self.stream.offset, "sample": self.sample}
        return position | self._fingerprint()

    def load_state_dict(self, sd: dict) -> None:
        for key, value in self._fingerprint().items():
            if sd[key] != value:
                raise ValueError(f"data state mismatch: checkpoint has {key}={sd[key]}, "
                                 f"this loader {value}")
        self.stream.seek(epoch=sd["epoch"], cursor=sd["cursor"], offset=sd["offset"])
        self.sample = sd["sample"]
