"""Benchmark suites: the GPU machine's measurements as TOML files (recipes/bench/suites/), run
one after another with the correctness stage first, per-launch time limits inside a per-suite
deadline, and the headline table of the rows at the end.

    python -m recipes.bench.suite OUT_DIR SUITE [SUITE ...] [--set [SUITE.]NAME=VALUE ...]
        [--ngpu N] [--extra "BENCH FLAGS"] [--correctness SUITE] [--dry-run]
    python -m recipes.bench.suite --list

SUITE is a file name under recipes/bench/suites/ (without .toml) or a path. Every invocation
first runs the `correctness` suite (docs/PERFORMANCE.md rule 2) into OUT_DIR/correctness.log; if
it fails, nothing is measured and the runner exits 1. Bench rows go to OUT_DIR/runs.jsonl, each
launch's output to OUT_DIR/logs/, one progress line per launch to stdout, and at the end the
headline table (recipes.bench.headline) of OUT_DIR/runs.jsonl. Every launch runs with NVLink
multicast off (NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1),
PYTHONUNBUFFERED=1, OMP_NUM_THREADS = cores / ranks, the repository on PYTHONPATH and, unless
the caller's environment sets one, run_train.sh's PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
(the allocator training runs with, which the planner's fit assumes). The exit
status is 1 if a launch failed or was killed (the suite goes on past it), 2 before anything
runs for a suite that cannot run as written, an OUT_DIR that holds an earlier invocation's
results, or a module the launches import that this Python lacks; 143 if the runner is sent
SIGTERM (an outer timeout) while a launch runs, after it has ended that launch's whole tree as at
its limit, so that no launch outlives it. --dry-run prints every command instead.

A suite file:

    description = "what it measures"
    seconds = 420                  # its deadline: no launch runs past it (optional)
    shared_deadline = "multi_gpu"  # suites naming the same one share the first one's deadline
    include = ["other_suite"]      # its variables and workloads first, under this deadline
                                   # (suites/vars/NAME: variables only, not in --list)
    [vars]                         # ${NAME} in any value below; --set NAME=VALUE overrides
    flavor = "qwen3-8B"

    [[workload]]
    name = "reference"
    flags = "--bench.reference --activation_checkpoint.mode=none --bench.batches 4"  # base flags
    limit = 60                     # seconds per launch; skipped when less is left of the deadline
    launches = 3                   # launches of each variant, each passing --bench.launch i
    variants = ["--bench.label a", {flags = "--bench.label b", launches = 1}]

A workload is its base flags and a list of variants, each an override set: a string or list of
flags appended to the base flags (later flags win), or a table whose keys replace the
workload's (its `flags` appended). Each variant is one launch (or `launches` of them). A string
of flags is split as a shell would, after ${NAME} substitution; a list is taken item by item.
Workload keys:

- `module`: what runs, `python -m MODULE FLAGS`; the default, recipes.bench.throughput (the
  bench: the trainer's `--section.key=value` flags and its [bench] section,
  recipes/bench/config.py), runs under torchrun on every rank with `--bench.out
  OUT_DIR/runs.jsonl` first and `--extra` last.
  `code` runs `python -c CODE` instead; `torchrun = true` runs a module on the ranks too.
- `ngpu`: the ranks (default: every GPU, or --ngpu); a list runs the variants once per count.
  A count above the machine's is skipped with a line. `first_fitting = true`: only the first
  variant whose count fits.
- `global_batch`: appends `--bench.batches GLOBAL/RANKS`.
- `largest = [B1, B2, ...]`: tries `--bench.batches B` in order until one launch succeeds (an
  out-of-memory rank can leave its peer waiting in a collective: hence the limit on each try).
- `peak = {launches = N, limit = S}`: after the variants (a sweep, rows labelled with the
  base flags' --bench.label), launches the fastest point (recipes.bench.headline.best_point of
  the base flags' mode and label) N-1 more times, as launches 2..N: a peer's peak, as a median.
- `env`: environment variables for its launches. `show = true`: its output goes to stdout too.
- `capture = "NAME"`, `default = VALUE`: the last line of its output becomes ${NAME} for later
  workloads (the default if it fails or is cut).
- `required = true`: if it fails, the runner stops. `pythonpath = DIR`: once it succeeds, DIR
  goes first on PYTHONPATH for every later launch (an install).

Built-in ${out}, ${repo} and ${ngpu}; ${nproc} is a launch's ranks. A launch killed at its limit
(SIGTERM to its process group, SIGKILL to every descendant 15 s later) is followed by a settle:
up to 60 s until no process holds a GPU and host memory stops coming back, so the next launch
does not start beside a dying one.
"""

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from recipes.bench.suite_file import Suite, SuiteError, load_suite, parse_sets, shipped_suites
from recipes.bench.suite_runner import REPO, Runner


def _ngpu(requested: int | None) -> int:
    """The ranks of a launch by default: --ngpu, else NGPU, else every GPU (1 on a machine
    without one: the CPU check of a suite)."""
    if requested:
        return requested
    if os.environ.get("NGPU"):
        return int(os.environ["NGPU"])
    try:
        import torch
        return max(1, torch.cuda.device_count())
    except ImportError:
        return 1


def headline_table(runs: Path) -> str:
    from recipes.bench.headline import table
    from recipes.bench.rows import read_rows

    if not runs.is_file():
        return f"no rows in {runs}"
    try:
        return table(read_rows(runs))
    except SystemExit as e:
        return str(e)


def missing_imports(suites: list[Suite], env: dict[str, str]) -> str | None:
    """The import error a launch would meet, or None: the bench's modules and, where a workload
    asks for them, Liger's kernels, imported in a child. The GPU machine runs the repository
    from its tree with the packages it has, so a missing one (pulp, liger-kernel) would
    otherwise surface in the first launch, after the minutes of the correctness stage."""
    modules = ["recipes.bench.throughput"]
    if any("liger" in str(w.get("flags", "")) for s in suites for w in s.workloads):
        modules.append("liger_kernel")
    proc = subprocess.run([sys.executable, "-c", f"import {', '.join(modules)}"], cwd=REPO,
                          env=env, capture_output=True, text=True)
    return None if proc.returncode == 0 else proc.stderr.strip().splitlines()[-1]


def used_out_dir(out: Path) -> list[str]:
    """What an earlier invocation left in `out`: its rows, correctness log or launch logs, which
    this one would append to (a launch log per number) and mix into its own table."""
    return [n for n in ("runs.jsonl", "correctness.log", "logs") if (out / n).exists()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", nargs="?", help="the output folder (runs.jsonl, logs/, ...)")
    p.add_argument("suites", nargs="*", help="suite names (recipes/bench/suites/) or paths")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="[SUITE.]NAME=VALUE",
                   help="a suite variable (a TOML value or a string; `seconds` is a suite's "
                        "deadline); SUITE. limits it to one suite")
    p.add_argument("--ngpu", type=int, default=0,
                   help="ranks per launch (default: NGPU, else every GPU, else 1: a CPU check)")
    p.add_argument("--extra", default="",
                   help="flags appended to every bench launch (later flags win), e.g. a CPU check: "
                        "'--model.kernels=torch --model.flavor=qwen3-debug "
                        "--training.seq_len=64 --bench.warmup=0 --training.steps=1'")
    p.add_argument("--correctness", default="correctness",
                   help="the suite run first, whose failure stops the invocation")
    p.add_argument("--dry-run", action="store_true", help="print every command, run none")
    p.add_argument("--list", action="store_true", help="the shipped suites and what each measures")
    a = p.parse_args(argv)
    if a.list:
        for name, description in shipped_suites().items():
            print(f"{name:24} {description}")
        return 0
    if not a.out or not a.suites:
        p.error("give OUT_DIR and at least one SUITE (--list names them)")
    out = Path(a.out).resolve()
    ngpu = _ngpu(a.ngpu)
    builtins = {"out": str(out), "repo": str(REPO), "ngpu": ngpu}
    try:
        sets = parse_sets(a.sets)
        gate = load_suite(a.correctness, sets, builtins)
        suites = [load_suite(name, sets, builtins) for name in a.suites]
    except SuiteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    runner = Runner(out, ngpu, shlex.split(a.extra), a.dry_run)
    if not a.dry_run:  # refused before the minutes of the correctness stage
        if used := used_out_dir(out):
            print(f"error: {out} holds an earlier invocation's {', '.join(used)}; give a new "
                  "OUT_DIR", file=sys.stderr)
            return 2
        if missing := missing_imports([gate, *suites], runner.env):
            print(f"error: a launch would fail: {missing}; install it, or carry its wheel to the "
                  "GPU machine", file=sys.stderr)
            return 2
        out.mkdir(parents=True, exist_ok=True)
    print(f"[suite] {ngpu} rank(s) per launch, OMP_NUM_THREADS={runner.env['OMP_NUM_THREADS']}, "
          f"out {out}", flush=True)
    if not runner.correctness(gate):
        print(f"correctness failed ({out / 'correctness.log'}): nothing measured", flush=True)
        return 1
    runner.launched = 0  # what follows is the measurement
    for suite in suites:
        if suite.name == gate.name:
            continue  # it ran first
        runner.run_suite(suite)
        if runner.stop:
            break
    print(f"=== done {time.strftime('%H:%M:%S')}: {runner.launched} launches, {runner.failed} "
          f"failed, {runner.skipped} skipped", flush=True)
    if not a.dry_run:
        print(headline_table(out / "runs.jsonl"), flush=True)
    return 1 if runner.failed or runner.stop else 0


if __name__ == "__main__":
    sys.exit(main())
