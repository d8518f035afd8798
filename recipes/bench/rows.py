"""The benchmarks' output: each measured row printed as one tagged JSON line and appended to a
JSONL file (docs/results/ keeps those files as the raw record).

A throughput row also records what its timed steps trained (`training`): a figure counts only
if every one of them trained. The bench writes every row, the invalid ones too (the evidence),
and exits non-zero after the last (`exit_if_invalid`); whatever reads rows for a figure reads
them through `read_rows`, which refuses invalid rows and rows that lack the record."""

import argparse
import json
import math
import os
from pathlib import Path

TRAINING = ("loss", "grad_norm", "skipped", "valid")
"""The training record of a throughput row: per timed step, in order, the loss per target
token, the gradient norm before clipping and whether the update was skipped; then the verdict
(`invalid_reason` beside it says why not)."""

def row_files(doc: str) -> list[str]:
    """The JSONL files named on the command line of a tool that tables rows (`doc`: its help)."""
    p = argparse.ArgumentParser(description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("rows", nargs="+", help="bench JSONL files")
    return p.parse_args().rows


ROW_KEY = ("mode", "label", "flavor", "route", "ac", "world", "seq", "local_batch", "accum")
"""What names a row in an error (the point it measured)."""


def emit(tag: str, row: dict, out: str = "") -> None:
    """Print `[tag] {row}` and append the row to `out` (if given) as one JSON line."""
    line = json.dumps(row)
    print(f"[{tag}]", line, flush=True)
    if out:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "a") as f:
            f.write(line + "\n")


def _faults(loss: list[float], grad_norm: list[float], skipped: list[bool]) -> list[str]:
    """Why timed steps with these records did not train (none: they did)."""
    if not loss:
        return ["no timed step"]
    faults = [f"timed step {i}: loss {l}, gradient norm {g}"
              for i, (l, g) in enumerate(zip(loss, grad_norm), 1)
              if not (math.isfinite(l) and math.isfinite(g))]
    # A skipped update leaves the weights as they were: its time is not a training step's.
    return faults + [f"timed step {i}: update skipped" for i, s in enumerate(skipped, 1) if s]


def training(loss: list[float], grad_norm: list[float], skipped: list[bool]) -> dict:
    """A row's training record (TRAINING) from its timed steps, with the verdict."""
    faults = _faults(loss, grad_norm, skipped)
    return {"loss": loss, "grad_norm": grad_norm, "skipped": skipped, "valid": not faults,
            "invalid_reason": "; ".join(faults) or None}


def _name(row: dict) -> str:
    return ", ".join(f"{k}={row[k]}" for k in ROW_KEY if k in row)


def _refusal(row: dict) -> str | None:
    """Why a row's figure is not one of steps that trained; None when it is. The lists are
    judged again, not only the verdict written beside them."""
    missing = [k for k in TRAINING if k not in row]
    if missing:
        return f"lacks {', '.join(missing)} (written before the bench recorded training)"
    faults = _faults(row["loss"], row["grad_norm"], row["skipped"])
    if faults or not row["valid"]:
        return f"invalid: {'; '.join(faults) or row.get('invalid_reason')}"
    return None


def read_rows(path: str | Path) -> list[dict]:
    """The rows of a JSONL file; SystemExit naming the file and each row it refuses (_refusal):
    one such row and the file is no source of figures."""
    lines = Path(path).read_text().splitlines()
    rows = {n: json.loads(line) for n, line in enumerate(lines, 1) if line.strip()}
    refused = [f"  line {n} ({_name(row)}): {why}" for n, row in rows.items()
               if (why := _refusal(row))]
    if refused:
        raise SystemExit(f"error: {path}: {len(refused)} of {len(rows)} rows refused (not "
                         "figures of steps that trained):\n" + "\n".join(refused))
    return list(rows.values())


def exit_if_invalid(rows: list[dict], out: str) -> None:
    """After a bench wrote `rows` (to `out`): SystemExit naming the invalid ones, if any."""
    invalid = [f"  {_name(r)}: {r['invalid_reason']}" for r in rows if not r["valid"]]
    if invalid:
        raise SystemExit(f"error: {len(invalid)} of {len(rows)} rows invalid (written to "
                         f"{out or 'stdout only'}):\n" + "\n".join(invalid))
