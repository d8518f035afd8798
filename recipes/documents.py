"""Documents from data files: each document as text pieces with their loss role.

Sources, chosen by file extension:
  - `.jsonl` / `.json`: JSON lines; each line an object with `messages` (chat) or `text` (plain
    LM); `messages` wins when both are present. Blank lines are skipped.
  - `.txt`: documents separated by one or more blank (whitespace-only) lines; a document is its
    remaining lines joined by "\\n" (a file without blank lines is one document).
  - `.parquet`: a `messages` or `text` column, read one row group at a time.
A path is a file, a directory (its supported files, recursively, in sorted order) or a
comma-separated list of those. Every file must hold at least one document. A file that cannot be
read as documents raises DataError naming it (and the line or row).

Chat documents are rendered in Qwen's ChatML, "<|im_start|>{role}\\n{content}<|im_end|>\\n" per
message; only assistant content and its <|im_end|> are loss targets.
"""

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

logger = logging.getLogger(__name__)

JSON_SUFFIXES = (".jsonl", ".json")
SUPPORTED_SUFFIXES = (*JSON_SUFFIXES, ".txt", ".parquet")


class DataError(ValueError):
    """A data path that cannot be read as documents; the message names the file (and the line
    or row)."""


@dataclass(frozen=True)
class Document:
    """Text pieces with their loss role; tokenized piece by piece so masks follow token edges."""

    segments: tuple[tuple[str, bool], ...]
    """(text, is_target) in order."""
    eos_is_target: bool
    """Plain text learns to end; in chat the EOS only separates conversations."""


def plain_document(text: str) -> Document:
    return Document(segments=((text, True),), eos_is_target=True)


def chat_document(messages: list[dict], *, where: str) -> Document:
    """ChatML rendering; only assistant content + <|im_end|> are targets."""
    segments = []
    for message in messages:
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise DataError(f"{where}: each message needs string 'role' and 'content', "
                             f"got {message!r}")
        role, content = message["role"], message["content"]
        if role == "assistant":
            segments += [(f"<|im_start|>{role}\n", False), (f"{content}<|im_end|>", True),
                         ("\n", False)]
        else:
            segments.append((f"<|im_start|>{role}\n{content}<|im_end|>\n", False))
    return Document(segments=tuple(segments), eos_is_target=False)


def record_document(record: object, *, where: str) -> Document:
    """A JSON line or parquet row: `messages` (chat) or `text` (plain)."""
    if isinstance(record, dict) and isinstance(record.get("messages"), list):
        return chat_document(record["messages"], where=where)
    if isinstance(record, dict) and isinstance(record.get("text"), str):
        return plain_document(record["text"])
    raise DataError(f"{where}: expected an object with a 'text' string or a 'messages' list")


def _lines(path: Path) -> Iterator[tuple[str, str]]:
    """("file:line", text) of every line, decoded one by one so a bad byte names its line."""
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            where = f"{path}:{line_no}"
            try:
                yield where, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: not UTF-8 text ({e.reason})") from None


def _read_json_lines(path: Path) -> Iterator[Document]:
    """The file's records; blank lines are skipped, and said once per file (a JSONL file has
    none unless something went wrong while writing it)."""
    blank, first_blank = 0, ""
    for where, line in _lines(path):
        if not line.strip():
            blank, first_blank = blank + 1, first_blank or where
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: malformed JSON ({e.msg})") from None
        yield record_document(record, where=where)
    if blank:
        logger.warning("data: %s: skipped %d blank line(s), the first is line %s", path, blank,
                       first_blank.rsplit(":", 1)[1])


def _read_text(path: Path) -> Iterator[Document]:
    lines: list[str] = []
    for _, line in _lines(path):
        if line.strip():
            lines.append(line.rstrip("\r\n"))
        elif lines:
            yield plain_document("\n".join(lines))
            lines = []
    if lines:
        yield plain_document("\n".join(lines))


def _read_parquet(path: Path) -> Iterator[Document]:
    try:
        parquet = pq.ParquetFile(path)
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"{path}: not a readable parquet file ({e})") from None
    names = parquet.schema_arrow.names
    column = next((c for c in ("messages", "text") if c in names), None)
    if column is None:
        raise DataError(f"{path}: no 'messages' or 'text' column (columns: {names})")
    row = 0
    for group in range(parquet.num_row_groups):
        for value in parquet.read_row_group(group, columns=[column]).column(column).to_pylist():
            yield record_document({column: value}, where=f"{path}:row {row}")
            row += 1


def _read_documents(path: Path) -> Iterator[Document]:
    """The file's documents; raises DataError if it holds none."""
    read = {".txt": _read_text, ".parquet": _read_parquet}.get(path.suffix, _read_json_lines)
    count = 0
    for count, doc in enumerate(read(path), start=1):
        yield doc
    if count == 0:
        raise DataError(f"{path}: holds no documents (only blank lines or no rows)")


def resolve_data_files(paths: str) -> list[Path]:
    """Files named by a comma-separated list of files and directories."""
    supported = "/".join(SUPPORTED_SUFFIXES)
    files: list[Path] = []
    for entry in (p.strip() for p in paths.split(",") if p.strip()):
        path = Path(entry)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*")
                           if p.is_file() and p.suffix in SUPPORTED_SUFFIXES)
            if not found:
                raise DataError(f"no {supported} files under {path}")
            files += found
        elif path.is_file():
            if path.suffix not in SUPPORTED_SUFFIXES:
                raise DataError(f"{path}: unsupported data file type (use {supported})")
            files.append(path)
        else:
            raise DataError(f"data path not found: {path}")
    if not files:
        raise DataError(f"no data paths given in {paths!r}")
    for file in files:
        if file.stat().st_size == 0:
            raise DataError(f"{file}: the file is empty")
    return files


def read_documents(paths: str) -> Iterator[Document]:
    for path in resolve_data_files(paths):
        yield from _read_documents(path)
