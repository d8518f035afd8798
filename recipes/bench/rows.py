"""The benchmarks' output: each measured row printed as one tagged JSON line and appended to a
JSONL file (docs/results/ keeps those files as the raw record)."""

import json
import os


def emit(tag: str, row: dict, out: str = "") -> None:
    """Print `[tag] {row}` and append the row to `out` (if given) as one JSON line."""
    line = json.dumps(row)
    print(f"[{tag}]", line, flush=True)
    if out:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "a") as f:
            f.write(line + "\n")
