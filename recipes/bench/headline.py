"""Headline figures from bench rows (docs/PERFORMANCE.md's rules): a point measured in several
launches (each row's `launch`: a suite workload's `launches`) is quoted as the median of its
launches' tokens/s with their min-max; rows are read through `read_rows`, so one row of a step
that did not train refuses the file. Launches are counted per file, as a suite numbers them per
invocation: two calls of one machine start, each with its own launch 1, are two launches.

  python -m recipes.bench.headline RUNS.jsonl [RUNS.jsonl ...]   # the markdown table
"""

import statistics
from collections import defaultdict

from recipes.bench.rows import read_rows, row_files

POINT = ("mode", "label", "flavor", "route", "kernels", "ac", "activation_blocks", "keep_blocks",
         "slots", "embedding_update", "runtime", "world", "seq", "local_batch", "accum",
         "max_norm", "sync", "gpu", "host_cpu")
"""What names one measured point: its rows differ only in their launch (a row without `sync`
waited for the device after every step; rows before `gpu` and `host_cpu` were recorded have
neither). Launches on another GPU or host CPU are another point: hosts of one GPU kind move the
host-bound steps."""


def points(rows: list[dict]) -> dict[tuple, list[dict]]:
    """The rows of each point, in file order."""
    out: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        out[tuple(row.get(k) for k in POINT)].append(row)
    return dict(out)


def summary(rows: list[dict]) -> dict:
    """One point's launches: their count, and the median, min and max of tokens/s and MFU."""
    tokens = [r["tokens_per_s"] for r in rows]
    mfu = [r["mfu"] for r in rows if r.get("mfu") is not None]
    return {"launches": len({(r.get("source"), r.get("launch", 1)) for r in rows}),
            "rows": len(rows),
            "median": statistics.median(tokens), "min": min(tokens), "max": max(tokens),
            "mfu": statistics.median(mfu) if mfu else None}


def best_point(path: str, *, mode: str, label: str) -> str:
    """The bench flags of the fastest valid row of `mode` with `label` in `path`: a peer's peak
    point, to launch again."""
    rows = [r for r in read_rows(path) if r["mode"] == mode and r.get("label") == label]
    if not rows:
        raise SystemExit(f"error: {path}: no {mode} row labelled {label!r}")
    best = max(rows, key=lambda r: r["tokens_per_s"])
    return f"--activation_checkpoint.mode={best['ac']} --bench.batches {best['local_batch']}"


def table(rows: list[dict]) -> str:
    """Markdown: one line per point, the headline (median of launches) and its spread."""
    lines = ["| mode | label | flavor | kernels | activations | batch | embedding | clip | timed | "
             "launches | tokens/s median | min-max | MFU | machine |", "|---" * 14 + "|"]
    for key, group in points(rows).items():
        point, s = dict(zip(POINT, key)), summary(group)
        policy = ", ".join(filter(None, (point["ac"], point["activation_blocks"])))
        mfu = "" if s["mfu"] is None else f"{100 * s['mfu']:.1f}%"
        lines.append(
            f"| {point['mode']} | {point['label'] or ''} | {point['flavor']} | "
            f"{point['kernels']} | {policy} | "
            f"{point['local_batch']} | {point['embedding_update'] or ''} | {point['max_norm']} | "
            f"{point['sync'] or 'step'} | {s['launches']} | {s['median']:,.0f} | "
            f"{s['min']:,.0f}-{s['max']:,.0f} | {mfu} | "
            f"{' / '.join(filter(None, (point['gpu'], point['host_cpu'])))} |")
    return "\n".join(lines)


def main() -> None:
    print(table([row | {"source": path} for path in row_files(__doc__)
                 for row in read_rows(path)]))


if __name__ == "__main__":
    main()
