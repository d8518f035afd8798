"""The tokenizer of a model (or tokenizer) directory, and the EOS id that ends every packed
document (recipes/data.py)."""

import json
from pathlib import Path

from tokenizers import Tokenizer

DEFAULT_EOS = "<|endoftext|>"


def _read_json_if_present(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_id(tokenizer: Tokenizer, token: str, *, source: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise ValueError(f"EOS token {token!r} (from {source}) is not in the tokenizer vocabulary")
    return token_id


def _resolve_eos_id(tokenizer: Tokenizer, directory: Path) -> int:
    """EOS from tokenizer_config.json's eos_token, else config.json's eos_token_id, else
    <|endoftext|> (Qwen base models)."""
    eos = _read_json_if_present(directory / "tokenizer_config.json").get("eos_token")
    if isinstance(eos, dict):  # older HF configs store an AddedToken dict
        eos = eos.get("content")
    if eos:
        return _token_id(tokenizer, eos, source="tokenizer_config.json")
    eos_id = _read_json_if_present(directory / "config.json").get("eos_token_id")
    if isinstance(eos_id, list):  # generation-style configs list several; the first ends text
        eos_id = eos_id[0] if eos_id else None
    if isinstance(eos_id, int):
        return eos_id
    return _token_id(tokenizer, DEFAULT_EOS, source="the default")


def load_tokenizer(model_or_tokenizer_dir: str | Path) -> tuple[Tokenizer, int]:
    """The directory's tokenizer.json and the EOS id that ends every packed document."""
    directory = Path(model_or_tokenizer_dir)
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise FileNotFoundError(f"tokenizer.json not found in {directory}")
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    return tokenizer, _resolve_eos_id(tokenizer, directory)
