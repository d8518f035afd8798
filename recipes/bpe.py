"""A Qwen-style byte-level BPE trained on texts: for corpora that come without a tokenizer (the
test assets, tests/assets/make_assets.py; the moments-curve recipe's corpus on a machine no
download reaches). The `tokenizers` library trains it; this fixes Qwen's layout around it."""

from collections.abc import Iterable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers.trainers import BpeTrainer

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""Qwen's special tokens, appended after the learned ones (<|endoftext|> is the data's EOS)."""
# Qwen2/Qwen3's pre-tokenizer split: digits one by one, so arithmetic stays learnable.
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def train_bpe(texts: Iterable[str], *, vocab_size: int) -> Tokenizer:
    """Byte-level BPE laid out like Qwen's (NFC, the regex split, byte-level), at most
    `vocab_size` tokens with SPECIAL_TOKENS appended last."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(vocab_size=vocab_size - len(SPECIAL_TOKENS), show_progress=False,
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tokenizer
