"""What the experiment scripts of recipes/reproduce/ share: the command line, the launches of
recipes/bench/throughput.py (which times every point and writes its JSONL rows), and the outputs
(CSV, markdown table, PNG plot) with the paper's corresponding figure beside ours.

Every script runs on however many GPUs it finds (torchrun, one rank per GPU; `--nproc` to use
fewer) and, without GPUs, on the CPU with `--tiny` (qwen3-debug, short sequences: the CPU tests
run each script end to end that way). A point that fails (out of memory, say) is reported with
the tail of its output and the run goes on; the points measured before it are kept. With
`--rows FILE ...` nothing is launched: the table and plot are made from rows recorded before
(e.g. one lease's rows spread over two calls), each launch's rows found by its label, batches,
length and rank count. Rows are read through recipes/bench/rows.py's read_rows: a file with a row
whose steps did not train (or that does not say) ends the experiment with an error naming it.
"""

import argparse
import csv
import json
import math
import os
import shlex
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recipes.bench.kill import KILLED, run_captured
from recipes.bench.rows import read_rows
from recipes.bench.suite_runner import launch_env

REPO = Path(__file__).resolve().parents[2]
RESULTS = Path("docs/results")
"""Default parent of each experiment's output folder (relative to the working directory)."""


@dataclass(frozen=True)
class System:
    """A peer as the bench runs it: `family` groups a system's own options (a peer's peak is its
    best over them), `flags` are recipes/bench/throughput.py's (recipes/bench/config.py)."""

    name: str
    family: str
    flags: tuple[str, ...]


SLIDEDP, FSDP2 = "--parallelism.mode=slidedp", "--parallelism.mode=fsdp2"
DEEPSPEED, REFERENCE = "--parallelism.mode=deepspeed", "--bench.reference"


def _resident(blocks: int) -> tuple[str, ...]:
    """SlideDP flags: the first `blocks` blocks' optimizer state and the embedding's resident on
    the GPU, the host updating the rest in the order the next forward needs them."""
    return (f"--slidedp.gpu_state_blocks={blocks}", "--slidedp.embedding_update=resident",
            "--slidedp.update_order=next_use")


_SEG = "segments(input_norm+qkv+qk_norm_rope+attention_core+o_proj)"
_OPS = "ops(matmul+attention)"


@dataclass(frozen=True)
class Planned:
    """A configuration the step-time model chose: the [slidedp] settings that differ from the
    defaults, the embedding's state resident with the first `state_blocks` blocks'."""

    activation: str
    activation_blocks: str
    window_slots: int
    chunk_mib: int
    state_blocks: int

    def flags(self) -> tuple[str, ...]:
        """The bench's flags for it."""
        return (SLIDEDP, f"--slidedp.activation={self.activation}",
                *([f"--slidedp.activation_blocks={self.activation_blocks}"]
                  if self.activation_blocks else []),
                f"--slidedp.window_slots={self.window_slots}",
                f"--slidedp.chunk_mib={self.chunk_mib}", *_resident(self.state_blocks))


PLANNED: dict[tuple[str, int], Planned] = {
    ("h100", 2): Planned(_OPS, "", 3, 128, 27),
    ("h100", 4): Planned(f"{_SEG}@offload=0.5", f"23-35:{_OPS}@offload=1.0", 2, 32, 27),
    ("h100", 8): Planned("selective", f"0-14:{_OPS}", 2, 128, 9),
    ("h100", 16): Planned(f"{_SEG}@offload=0.5", "35:selective@offload=1.0", 2, 128, 0),
    ("h200", 8): Planned(f"{_OPS}@offload=1.0", "", 2, 128, 18),
    ("h100-launches", 2): Planned(
        f"{_SEG}@offload=0.5", "21:segments(qkv+qk_norm_rope+attention_core)@offload=0.5,"
        f"22-35:{_OPS}@offload=1.0", 2, 8, 36),
}
"""Qwen3-4B's settings that `python -m recipes.plan train_configs/h200_qwen3_4b_slidedp.toml
--rates RATES --training.local_batch_size BATCH --search` chooses from the model alone, by
(rates, batch): on an 80 GB card (h100) at 2-16 sequences and on 141 GB (h200) at 8, where the
all-resident `keep` does not fit. `h100-launches`: the h100 rates once they held the host's
launch times, which change the choice at 2 sequences (at 8, one block's policy at the same
predicted time)."""


SYSTEMS: dict[str, System] = {s.name: s for s in [
    System("slidedp-recompute", "slidedp", (SLIDEDP, "--slidedp.activation=recompute")),
    System("slidedp-selective", "slidedp", (SLIDEDP, "--slidedp.activation=selective")),
    System("slidedp-keep", "slidedp", (SLIDEDP, "--slidedp.activation=keep")),
    # The embedding's AdamW on the GPU (slidedp.embedding_update): with clipping, its update is
    # the first the next forward waits for.
    System("slidedp-keep-gpuembed", "slidedp", (SLIDEDP, "--slidedp.activation=keep",
                                                "--slidedp.embedding_update=gpu")),
    # Every unit's optimizer state resident on the GPU (36: Qwen3-4B's blocks, the head-to-head's
    # model): with clipping, no update waits on the host; fits `keep` up to 4 sequences on 141 GB.
    System("slidedp-keep-resident", "slidedp", (SLIDEDP, "--slidedp.activation=keep",
                                                *_resident(36))),
    # The step-time model's own choices where not every unit's state fits beside `keep`'s
    # activations (PLANNED): part of the state resident, the host updating the rest behind the
    # forward, the activations saved, replayed or offloaded per block.
    *(System(f"slidedp-plan-{rates}-{batch}", "slidedp", choice.flags())
      for (rates, batch), choice in PLANNED.items()),
    # A keep/selective mix sized for 16 sequences of Qwen3-4B (14 kept blocks of 6.9 GiB each),
    # where `keep` everywhere does not fit.
    System("slidedp-selective-keep14-gpuembed", "slidedp",
           (SLIDEDP, "--slidedp.activation=selective", "--slidedp.keep_blocks=14",
            "--slidedp.embedding_update=gpu")),
    *(System(f"fsdp2-{ac}", "fsdp2", (FSDP2, f"--activation_checkpoint.mode={ac}"))
      for ac in ("none", "selective", "full")),
    # The offloading peers, each with full checkpointing and without (`-noac`: its peak at the
    # small batches where its activations fit the GPU).
    *(System(f"{name}{suffix}", family, (*flags, f"--activation_checkpoint.mode={ac}"))
      for name, family, flags in (
          ("fsdp2-offload", "fsdp2-offload", (FSDP2, "--parallelism.fsdp_cpu_offload")),
          ("zero2-offload", "zero-offload", (DEEPSPEED, "--deepspeed.zero_stage=2")),
          ("zero3-offload", "zero3-offload", (DEEPSPEED, "--deepspeed.zero_stage=3")))
      for ac, suffix in (("full", ""), ("none", "-noac"))),
    # The paper's peers SlideFormer and MegaTrain, re-implemented as policies of the SlideDP
    # runtime (slidedp/peer_styles.py), with the same activation policies.
    *(System(f"{runtime}-{policy}", runtime, (SLIDEDP, f"--slidedp.runtime={runtime}",
                                              f"--slidedp.activation={policy}"))
      for runtime in ("slideformer", "megatrain") for policy in ("recompute", "keep")),
    *(System(f"reference-{ac}", "reference", (REFERENCE, f"--activation_checkpoint.mode={ac}"))
      for ac in ("none", "full")),
]}
"""The systems an experiment can name (--systems); DeepSpeed needs the deepspeed package."""


def parser(doc: str, *, systems: str = "", batches: bool = False,
           recorded: bool = True) -> argparse.ArgumentParser:
    """The flags every experiment takes, --systems (helped by `systems`) and --batches where
    asked for, --rows unless it measures without the bench (`recorded` false); each adds its own. Unset ones take the experiment's defaults (GPU) or, with
    --tiny, its CPU-sized ones (`start`)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if systems:
        p.add_argument("--systems", help=f"{systems}: a comma list of {', '.join(SYSTEMS)}")
    if batches:
        p.add_argument("--batches", help="local batch sizes, ascending")
    p.add_argument("--out-dir", help="output folder (default docs/results/<experiment>)")
    p.add_argument("--flavor", help="model flavor (a models/<name>/ package's flavors)")
    p.add_argument("--seq", type=int, help="tokens per sequence")
    p.add_argument("--kernels", default="auto", choices=("auto", "liger", "torch"))
    p.add_argument("--max-norm", type=float,
                   help="gradient clipping of every system (default 1.0, the experiment's)")
    p.add_argument("--nproc", type=int, default=0,
                   help="ranks (0: every GPU found; on the CPU, the experiment's default)")
    p.add_argument("--steps", type=int, help="timed steps per point (median reported)")
    p.add_argument("--warmup", type=int, help="untimed steps per point")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per launch")
    p.add_argument("--tiny", action="store_true",
                   help="CPU-sized run (qwen3-debug, short sequences): what the tests run")
    if recorded:
        p.add_argument("--rows", nargs="+", default=[],
                       help="launch nothing: the rows of these runs.jsonl files (recorded before)")
    return p


def start(args: argparse.Namespace, experiment: str, *, gpu: dict[str, Any],
          tiny: dict[str, Any]) -> "Runner":
    """The unset flags filled from the experiment's defaults (GPU-sized, or --tiny), matplotlib
    checked, and the experiment's Runner."""
    _resolve(args, gpu=gpu, tiny=tiny)
    args.rows = getattr(args, "rows", [])
    missing = [p for p in args.rows if not Path(p).is_file()]
    if missing:
        raise SystemExit(f"error: --rows: no file {missing[0]}")
    require_matplotlib()
    return Runner(args, experiment=experiment)


def _resolve(args: argparse.Namespace, *, gpu: dict[str, Any], tiny: dict[str, Any]) -> None:
    defaults = {"flavor": "qwen3-4B", "seq": 4096, "steps": 2, "warmup": 1, "max_norm": 1.0, **gpu}
    if args.tiny:
        defaults.update({"flavor": "qwen3-debug", "seq": 64, "steps": 1, "warmup": 0, **tiny})
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def select_systems(names: str) -> list[System]:
    """The systems of a comma list; SystemExit (one line) naming an unknown one."""
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in SYSTEMS]
    if unknown:
        raise SystemExit(f"error: unknown system {unknown[0]!r} (systems: {', '.join(SYSTEMS)})")
    return [SYSTEMS[n] for n in chosen]


def require_matplotlib():
    """matplotlib's pyplot (Agg), or SystemExit with the install line: checked before anything
    runs, so a long run does not end without its plot."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("error: the plots need matplotlib: pip install '.[reproduce]' "
                         "(or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


class Runner:
    """Launches recipes/bench/throughput.py; every row it writes lands in <out_dir>/runs.jsonl."""

    def __init__(self, args: argparse.Namespace, *, experiment: str) -> None:
        self.args, self.experiment = args, experiment
        self.out_dir = Path(args.out_dir or RESULTS / experiment)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = self.out_dir / "runs.jsonl"
        self.jsonl.unlink(missing_ok=True)  # this run's rows only
        self.gpus = gpu_count()
        self.launches = self.failures = 0

    def nproc(self, default_cpu: int = 1) -> int:
        """--nproc, else every GPU, else `default_cpu` CPU ranks."""
        return self.args.nproc or self.gpus or default_cpu

    def bench(self, flags: Sequence[str], *, nproc: int, label: str = "",
              common: bool = True) -> list[dict]:
        """One launch of the bench with `flags` (plus the run's model, sequence, kernels, clipping
        and step counts unless `common` is false); its rows, each marked with `label`."""
        a = self.args
        shared = [f"--model.flavor={a.flavor}", f"--training.seq_len={a.seq}",
                  f"--model.kernels={a.kernels}", f"--training.max_norm={a.max_norm}",
                  f"--training.steps={a.steps}", f"--bench.warmup={a.warmup}"] if common else []
        bench = ["-m", "recipes.bench.throughput", *shared, *flags, f"--bench.label={label}",
                 "--slidedp.check_host_memory=false", f"--bench.out={self.jsonl}"]
        env = launch_env(nproc)
        if nproc == 1:  # one process, no launcher (seconds less per point): its own group
            cmd = [sys.executable, *bench]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={nproc}", *bench]
        if self.args.rows:
            return self._recorded(flags, nproc=nproc, label=label)
        before = self._rows_written()
        self.launches += 1
        print(f"[{self.experiment}] {label or ''} x{nproc}: {shlex.join(flags)}", flush=True)
        start = time.perf_counter()
        rc, output = run_captured(cmd, limit=a.timeout, cwd=REPO, env=env)
        failed = rc != 0
        tail = (f"timed out after {a.timeout:.0f} s\n{output[-1000:]}" if rc in KILLED
                else output[-2000:])
        rows = self._rows_written()[len(before):]
        print(f"[{self.experiment}]   {len(rows)} point(s) in {time.perf_counter() - start:.0f} s"
              + (" - FAILED (points after the last one above are missing):\n" + tail
                 if failed else ""), flush=True)
        self.failures += failed
        return rows

    def sweep(self, systems: Sequence[System], batches: str, *, nproc: int) -> list[dict]:
        """Each system over `batches` (ascending: once one does not fit, the larger ones are
        not tried) in one launch; every row gets its `system` and `family`."""
        rows = []
        for system in systems:
            for row in self.bench([*system.flags, *batch_flags(batches)], nproc=nproc,
                                  label=system.name):
                rows.append({**row, "system": system.name, "family": system.family})
        return rows

    def _recorded(self, flags: Sequence[str], *, nproc: int, label: str) -> list[dict]:
        """The recorded rows (--rows) that this launch would have written, copied to this run's
        runs.jsonl: its label, rank count, and the model, batches and length its flags name (one
        file may hold several models' rows under the same labels)."""
        batches = _named_batches(flags)
        seq = int(_last(flags, "--training.seq_len") or self.args.seq)
        flavor = _last(flags, "--model.flavor") or self.args.flavor
        rows = [r for path in self.args.rows for r in _read_rows(Path(path))
                if r.get("label") == label and r.get("world") == nproc and r.get("seq") == seq
                and r.get("flavor") == flavor
                and (batches is None or r.get("local_batch") in batches)]
        with open(self.jsonl, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        return rows

    def _rows_written(self) -> list[dict]:
        return _read_rows(self.jsonl)


def batch_flags(batches: str) -> list[str]:
    """A comma list of local batches as the bench's flag."""
    return ["--bench.batches", *batches.split(",")]


def _values(flags: Sequence[str], key: str) -> list[str] | None:
    """The values the last `key` in `flags` is given (`--key=value`, or every argument after
    `--key` up to the next flag); None where it is not."""
    found = None
    for i, flag in enumerate(flags):
        if flag.startswith(key + "="):
            found = [flag.partition("=")[2]]
        elif flag == key:
            rest = list(flags[i + 1:])
            found = rest[:next((j for j, f in enumerate(rest) if f.startswith("--")), len(rest))]
    return found


def _last(flags: Sequence[str], key: str) -> str | None:
    values = _values(flags, key)
    return values[-1] if values else None


def _named_batches(flags: Sequence[str]) -> set[int] | None:
    """The local batches a bench launch's flags name: bench.batches, or those of its
    bench.points entries (POLICY:B1,B2); None when they name none."""
    if batches := _values(flags, "--bench.batches"):
        return {int(b) for b in batches}
    if not (points := _values(flags, "--bench.points")):
        return None
    from recipes.bench.config import point_specs  # the bench's own parser (it imports torch)

    return {b for spec in point_specs(points) for b in spec.batches}


def _read_rows(path: Path) -> list[dict]:
    return read_rows(path) if path.exists() else []


@dataclass(frozen=True)
class Column:
    """One column of the CSV and the markdown table."""

    key: str
    header: str
    fmt: str = "{}"
    """How the table prints it (the CSV keeps the value as it is)."""

    def text(self, row: dict) -> str:
        value = row.get(self.key)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "–"
        return self.fmt.format(value)


SYSTEM = Column("system", "system")
WORLD = Column("world", "GPUs")
BATCH = Column("local_batch", "seq/GPU")
TOKENS = Column("tokens_per_s", "tokens/s", "{:,.0f}")
STEP = Column("step_time_s", "s/step", "{:.3f}")
GPU_ALLOC = Column("peak_mem_alloc_gib", "GPU GiB alloc", "{:.1f}")
GPU_RESERVED = Column("peak_mem_reserved_gib", "GPU GiB reserved", "{:.1f}")
HOST_RSS = Column("peak_rss_gib", "host RSS GiB", "{:.2f}")
"""The columns most tables share (bench row keys)."""


def log2_axis(ax, *, xlabel: str = "sequences per GPU", ylabel: str) -> None:
    """A plot axis over powers of two, labelled, with a light grid."""
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


def markdown_table(rows: Iterable[dict], columns: Sequence[Column]) -> str:
    lines = ["| " + " | ".join(c.header for c in columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(c.text(r) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


MEDIANS = ("tokens_per_s", "step_time_s", "tflops_per_gpu", "mfu")
"""The row keys that `fastest` quotes as the median of a setting's launches."""


def fastest(rows: Iterable[dict], key: Callable[[dict], Hashable]) -> dict[Hashable, dict]:
    """The fastest setting for each value of key(row): a system's best. A setting measured in
    several launches (rows of one system, rank count and batch) counts as its median launch's
    row (the lower middle of an even count) with its rates (MEDIANS) the launches' medians, as
    recipes/bench/headline.py quotes them (the mean of the middle two of an even count), and
    `launches` and tokens/s `min`-`max` added, so that each side of a ratio is the same
    statistic however many launches it ran (docs/PERFORMANCE.md rules 3 and 6)."""
    settings: dict[Hashable, list[dict]] = defaultdict(list)
    for r in rows:
        settings[r["system"], r.get("world"), r["local_batch"]].append(r)
    best: dict[Hashable, dict] = {}
    for group in settings.values():
        group = sorted(group, key=lambda r: r["tokens_per_s"])
        tokens = [r["tokens_per_s"] for r in group]
        row = {**group[(len(group) - 1) // 2],
               **{k: statistics.median(r[k] for r in group) for k in MEDIANS
                  if all(r.get(k) is not None for r in group)},
               "launches": len(group), "min": tokens[0], "max": tokens[-1]}
        k = key(row)
        if k not in best or row["tokens_per_s"] > best[k]["tokens_per_s"]:
            best[k] = row
    return best


def geomean(values: Iterable[float]) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def machine() -> str:
    """This machine in a line: its GPUs (or none) and cores."""
    import torch

    cores = len(os.sched_getaffinity(0))
    if torch.cuda.is_available():
        gpus = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    else:
        gpus = "no GPU (CPU run)"
    return f"{gpus}, {cores} cores, torch {torch.__version__}"


def write_outputs(runner: Runner, rows: list[dict], columns: Sequence[Column], *, title: str,
                  paper: str, plot: Callable[[Any, list[dict]], Any], notes: str = "") -> None:
    """<name>.csv, <name>.md (table, the paper's figure, the machine, the command) and
    <name>.png in the runner's output folder."""
    plt = require_matplotlib()
    name, out = runner.experiment, runner.out_dir
    with open(out / f"{name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[c.key for c in columns], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    figure = plot(plt, rows)
    figure.savefig(out / f"{name}.png", dpi=120, bbox_inches="tight")
    plt.close(figure)
    command = shlex.join(["python", "-m", f"recipes.reproduce.{name}", *sys.argv[1:]])
    raw = " Raw rows: runs.jsonl." if runner.jsonl.exists() else ""
    where = (f"Rows recorded before, read from {', '.join(runner.args.rows)} (rendered on "
             f"{machine()})" if runner.args.rows else f"Machine: {machine()}")
    md = [f"# {title}", "", f"{where}. Command: `{command}`.{raw}",
          "", markdown_table(rows, columns), "", f"**Paper:** {paper}"]
    if notes:
        md += ["", notes]
    if runner.failures:
        md += ["", f"{runner.failures} of {runner.launches} launches failed (see the log); "
                   "their later points are missing."]
    md += ["", f"![{name}]({name}.png)", ""]
    (out / f"{name}.md").write_text("\n".join(md))
    print(f"[{name}] wrote {out}/{name}.csv, {name}.md, {name}.png")
