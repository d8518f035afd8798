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
PYTHONUNBUFFERED=1, OMP_NUM_THREADS = cores / ranks and the repository on PYTHONPATH. The exit
status is 1 if a launch failed or was killed (the suite goes on past it), 2 before anything
runs for a suite that cannot run as written, an OUT_DIR that holds an earlier invocation's
results, or a module the launches import that this Python lacks. --dry-run prints every
command instead.

A suite file:

    description = "what it measures"
    seconds = 420                  # its deadline: no launch runs past it (optional)
    shared_deadline = "multi_gpu"  # suites naming the same one share the first one's deadline
    include = ["other_suite"]      # that suite's workloads first, under this deadline
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
import contextlib
import glob
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from string import Template

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
SUITES = Path(__file__).with_name("suites")
BENCH = "recipes.bench.throughput"
KILL_GRACE_S = 15
"""After SIGTERM, how long a killed launch gets to exit before SIGKILL."""
MIN_LEFT_S = 10
"""A launch that would get less than this before the deadline is skipped."""
SETTLE_S, SETTLE_POLL_S, SETTLE_RISE_KIB = 60, 2, 1 << 20
ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
       "NVSHMEM_DISABLE_NVLS": "1", "PYTHONUNBUFFERED": "1"}
"""NVLink multicast off (the lent machines do not allow it) and unbuffered logs."""
KEYS = {"name", "module", "code", "torchrun", "flags", "variants", "limit", "launches", "ngpu",
        "first_fitting", "global_batch", "largest", "peak", "env", "show", "capture", "default",
        "required", "pythonpath"}
RUNTIME_VARS = {"nproc"}
_WHOLE = re.compile(r"\$\{(\w+)\}")


class SuiteError(Exception):
    """A suite file that cannot run as written (before anything runs)."""


@dataclass
class Suite:
    name: str
    description: str
    workloads: list[dict]
    seconds: float | None = None
    shared_deadline: str | None = None
    vars: dict = field(default_factory=dict)
    """Its variables as resolved (an including suite's defaults)."""


def suite_path(name: str) -> Path:
    """A suite's file: a path as given, else recipes/bench/suites/NAME.toml."""
    path = Path(name)
    if path.suffix == ".toml" or os.sep in name:
        return path
    return SUITES / f"{name}.toml"


def _value(text: str):
    """--set's VALUE: a TOML value ([8, 4], 550, true), else the string as written."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_sets(pairs: list[str]) -> dict[str | None, dict]:
    """--set [SUITE.]NAME=VALUE pairs, by suite (None: every suite)."""
    sets: dict[str | None, dict] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise SuiteError(f"--set {pair!r}: expected [SUITE.]NAME=VALUE")
        suite, _, name = key.rpartition(".")
        sets.setdefault(suite or None, {})[name] = _value(text)
    return sets


def _substitute(value, names: dict, path: str):
    """`value` with ${NAME} replaced (a string that is one ${NAME} takes the variable's own
    type); names not known yet (${nproc}, captured ones) are left for the launch."""
    if isinstance(value, dict):
        return {k: _substitute(v, names, f"{path}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute(v, names, f"{path}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value
    whole = _WHOLE.fullmatch(value)
    if whole and whole[1] in names and names[whole[1]] is not None:
        return names[whole[1]]
    for ref in _WHOLE.findall(value):
        if ref not in names:
            raise SuiteError(f"{path}: ${{{ref}}} is not set (--set {ref}=VALUE)")
    return Template(value).safe_substitute({k: _text(v) for k, v in names.items() if v is not None})


def _text(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def load_suite(name: str, sets: dict[str | None, dict], builtins: dict,
               _seen: tuple[str, ...] = ()) -> Suite:
    """A suite file, its includes' workloads first, every ${NAME} but the launch-time ones
    resolved; SuiteError for an unknown key or an unset variable."""
    path = suite_path(name)
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in SUITES.glob("*.toml")))
        raise SuiteError(f"no suite {name!r} ({path}); shipped: {known}")
    stem = path.stem
    if stem in _seen:
        raise SuiteError(f"{path}: includes itself through {' -> '.join(_seen)}")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise SuiteError(f"{path}: {e}") from None
    unknown = set(data) - {"description", "seconds", "shared_deadline", "include", "vars",
                           "workload"}
    if unknown:
        raise SuiteError(f"{path}: unknown key {sorted(unknown)[0]!r}")
    included = [load_suite(n, sets, builtins, (*_seen, stem)) for n in data.get("include", [])]
    names = dict(builtins)
    for inc in included:  # an included suite's variables are this one's defaults
        names.update(inc.vars)
    names.update(data.get("vars", {}))
    names.update(sets.get(None, {}), **sets.get(stem, {}))
    captured = {w["capture"] for w in data.get("workload", []) if "capture" in w}
    for n in RUNTIME_VARS | captured:
        names.setdefault(n, None)
    for _ in range(4):  # variables made of variables, after --set
        names = {k: _substitute(v, names, f"{path}: vars.{k}") if k not in builtins else v
                 for k, v in names.items()}
    workloads = [w for inc in included for w in inc.workloads]
    for i, raw in enumerate(data.get("workload", [])):
        where = f"{path}: workload {raw.get('name', i + 1)!r}"
        bad = set(raw) - KEYS
        for variant in raw.get("variants", []):
            if isinstance(variant, dict):
                bad |= set(variant) - KEYS
        if bad:
            raise SuiteError(f"{where}: unknown key {sorted(bad)[0]!r}")
        if "name" not in raw:
            raise SuiteError(f"{where}: no name")
        workloads.append(dict(_substitute(raw, names, where), suite=stem))
    seconds = names.get("seconds", data.get("seconds"))
    return Suite(stem, data.get("description", ""), workloads,
                 float(seconds) if seconds is not None else None, data.get("shared_deadline"),
                 {k: v for k, v in names.items() if k not in builtins})


def _flags(value, names: dict | None = None) -> list[str]:
    """A workload's flags as arguments: a string split as a shell would, a list item by item;
    launch-time ${NAME} resolved from `names`."""
    if value is None:
        return []
    names = {k: _text(v) for k, v in (names or {}).items()}
    if isinstance(value, str):
        return shlex.split(Template(value).safe_substitute(names))
    return [Template(str(v)).safe_substitute(names) for v in value]


def flag_value(args: list[str], flag: str) -> str | None:
    """The last value given to `flag` in `args` (as argparse reads it), else None."""
    found = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith(flag + "="):
            found = arg.split("=", 1)[1]
    return found


def _glob(arg: str) -> list[str]:
    """A path pattern as a shell expands it: the files it matches, sorted, else itself."""
    if "*" in arg and not arg.startswith("-"):
        return sorted(glob.glob(arg)) or [arg]
    return [arg]


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun starts its workers in sessions of their own, out of
    reach of a process-group signal)."""
    parent_of: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent_of[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    below, frontier = [], {pid}
    while frontier:
        frontier = {child for child, parent in parent_of.items() if parent in frontier}
        below.extend(frontier)
    return below


def _mem_available_kib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1])
    return 0


def _gpu_busy() -> bool:
    """Whether any process holds a GPU (False where there is no nvidia-smi)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return bool(out.strip())


def settle() -> float:
    """After a killed launch: wait (at most SETTLE_S) until no process holds a GPU and host
    memory stops coming back, so that the next launch does not share the machine with one
    still freeing its memory. Returns the seconds waited."""
    waited, after = 0.0, _mem_available_kib()
    while waited < SETTLE_S:
        time.sleep(SETTLE_POLL_S)
        waited += SETTLE_POLL_S
        before, after = after, _mem_available_kib()
        if not _gpu_busy() and after - before < SETTLE_RISE_KIB:
            break
    print(f"settled after {waited:.0f} s; MemAvailable {after / (1 << 20):.0f} GiB", flush=True)
    return waited


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


@dataclass
class Runner:
    out: Path
    ngpu: int
    extra: list[str] = field(default_factory=list)
    dry_run: bool = False
    env: dict[str, str] = field(default_factory=dict)
    captured: dict[str, str] = field(default_factory=dict)
    deadlines: dict[str, float] = field(default_factory=dict)
    launched: int = 0
    failed: int = 0
    skipped: int = 0
    stop: bool = False
    deadline: float | None = None
    last_log: Path | None = None

    def __post_init__(self):
        cores = len(os.sched_getaffinity(0))
        path = os.environ.get("PYTHONPATH")
        self.env = dict(os.environ, **ENV, OMP_NUM_THREADS=str(max(1, cores // self.ngpu)),
                        PYTHONPATH=os.pathsep.join(filter(None, [path, str(REPO)])))

    # -- one launch -------------------------------------------------------------------------

    def command(self, w: dict, args: list[str], nproc: int) -> list[str]:
        """The command line of one launch of workload `w` with `args` on `nproc` ranks."""
        module = w.get("module", BENCH)
        bench = module == BENCH and w.get("torchrun", True)
        args = [path for arg in args for path in _glob(arg)]
        if "code" in w:
            return [sys.executable, "-c", w["code"], *args]
        head = [sys.executable, "-m", module]
        # One bench rank needs no launcher (seconds less per launch): it makes its own group.
        if w.get("torchrun", bench) and not (module == BENCH and nproc == 1):
            head = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc_per_node={nproc}", "-m", module]
        if bench:
            return [*head, f"--bench.out={self.out / 'runs.jsonl'}", *args, *self.extra]
        return [*head, *args]

    def launch(self, what: str, cmd: list[str], *, limit: float | None, env: dict,
               log: Path | None = None, show: bool = False) -> int | None:
        """Run `cmd` under min(limit, what is left of the deadline), its output in `log`; its
        exit status (124 if it was killed at the limit), None if skipped for lack of time: less
        than MIN_LEFT_S is left, or less than the launch's own limit (it would be killed by the
        deadline before its limit and counted failed, for lack of time rather than a fault)."""
        left = None if self.deadline is None else self.deadline - time.monotonic()
        if left is not None and (left < MIN_LEFT_S or (limit is not None and left < limit)):
            print(f"out of time, skipped: {what} ({left:.0f} s left"
                  f"{f', its limit {limit:.0f} s' if limit is not None else ''})", flush=True)
            self.skipped += 1
            return None
        limits = [x for x in (limit, left) if x is not None]
        cut = min(limits) if limits else None
        self.launched += 1
        if log is None:
            slug = re.sub(r"[^\w.-]+", "_", what)
            log = self.out / "logs" / f"{self.launched:03d}_{slug}.log"
        self.last_log = log
        line = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        line += (" " if line else "") + shlex.join(cmd)
        if self.dry_run:
            print(f"{line}{f'   # limit {cut:.0f} s' if cut else ''}")
            return 0
        log.parent.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        with open(log, "a") as f:
            f.write(f"$ {line}\n")
            f.flush()
            proc = subprocess.Popen(cmd, cwd=REPO, env={**self.env, **env}, stdout=f,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=cut)
            except subprocess.TimeoutExpired:
                rc = self._kill(proc)
        took = time.monotonic() - start
        note = f" (killed at its {cut:.0f} s limit)" if rc in (124, 137) else ""
        print(f"[suite] {what}: rc {rc} in {took:.1f} s{note}; {log.relative_to(self.out)}",
              flush=True)
        text = log.read_text(errors="replace")
        if show:
            print(text, end="" if text.endswith("\n") else "\n", flush=True)
        elif rc != 0:
            print("".join(f"    {t}\n" for t in text.splitlines()[-12:]), end="", flush=True)
        if rc in (124, 137):
            settle()
        return rc

    def _kill(self, proc: subprocess.Popen) -> int:
        """SIGTERM to the launch's process group (torchrun passes it on to its workers), then
        SIGKILL to whatever of it is left after KILL_GRACE_S; 124 or 137, as timeout(1)."""
        tree = [proc.pid, *descendants(proc.pid)]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=KILL_GRACE_S)
            rc = 124
        except subprocess.TimeoutExpired:
            rc = 137
        for pid in [*tree, *descendants(proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
        return rc

    # -- workloads --------------------------------------------------------------------------

    def run_workload(self, w: dict) -> None:
        variants = [v if isinstance(v, dict) else {"flags": v} for v in w.get("variants", [{}])]
        counts = w.get("ngpu")
        counts = counts if isinstance(counts, list) else [counts]
        for n in counts:
            fitted = False
            for j, variant in enumerate(variants):
                if w.get("first_fitting") and fitted:
                    break
                flags = _flags(w.get("flags")) + _flags(variant.get("flags"))
                step = {**w, **variant, "flags": flags}
                given = variant.get("ngpu") or n
                nproc = int(given or self.ngpu)
                what = f"{w['suite']}/{w['name']}"
                what += f" {j + 1}/{len(variants)}" if len(variants) > 1 else ""
                what += f" on {nproc}" if given else ""
                if nproc > self.ngpu:
                    print(f"skipped, needs {nproc} GPUs: {what}", flush=True)
                    self.skipped += 1
                    continue
                fitted = True
                self.run_step(step, what, nproc)
                if self.stop:
                    return
        if "peak" in w:
            self.relaunch_peak(w, int(counts[0] or self.ngpu))

    def run_step(self, step: dict, what: str, nproc: int, extra: tuple[str, ...] = (),
                 launch_numbers: range | None = None) -> None:
        names = {"nproc": nproc, **self.captured}
        args = [*_flags(step["flags"], names), *extra]
        if "global_batch" in step:
            args += ["--bench.batches", str(int(step["global_batch"]) // nproc)]
        env = {k: Template(str(v)).safe_substitute(names) for k, v in step.get("env", {}).items()}
        if "launches" in step and launch_numbers is None:
            launch_numbers = range(1, int(step["launches"]) + 1)
        for i in launch_numbers or [None]:
            tail = [] if i is None else [f"--bench.launch={i}"]
            label = what if i is None else f"{what} launch {i}"
            sizes = step.get("largest")
            if sizes:
                rc = self._largest(step, args + tail, label, nproc, sizes, env)
            else:
                rc = self.launch(label, self.command(step, args + tail, nproc),
                                 limit=step.get("limit"), env=env, show=step.get("show", False))
            self._after(step, label, rc)
            if self.stop:
                return

    def _largest(self, step, args, label, nproc, sizes, env) -> int | None:
        """The first of `sizes` whose launch succeeds: its status (the last one's if none)."""
        rc = None
        for b in sizes:
            cmd = self.command(step, [*args, "--bench.batches", str(b)], nproc)
            rc = self.launch(f"{label} batch {b}", cmd, limit=step.get("limit"), env=env)
            if rc in (0, None):
                return rc
            print(f"{label} at {b} sequences per GPU failed (out of memory?)", flush=True)
        return rc

    def _after(self, step: dict, label: str, rc: int | None) -> None:
        """Count a launch's outcome; a capture's value, a path export, a required stop."""
        if "capture" in step:
            value = step.get("default", "")
            if rc == 0 and not self.dry_run:
                lines = [t for t in self.last_log.read_text().splitlines() if t.strip()]
                value = lines[-1].strip() if lines else value
            self.captured[step["capture"]] = str(value)
            print(f"{label}: {step['capture']} = {value}", flush=True)
        if rc is None:
            return
        if rc != 0:
            self.failed += 1
        if rc == 0 and step.get("pythonpath"):
            first = [step["pythonpath"], self.env["PYTHONPATH"]]
            self.env["PYTHONPATH"] = os.pathsep.join(first)
        if rc != 0 and step.get("required"):
            print(f"{label} failed and is required: stopping", flush=True)
            self.stop = True

    def relaunch_peak(self, w: dict, nproc: int) -> None:
        """The sweep's fastest point, relaunched as launches 2..N."""
        from recipes.bench.headline import best_point

        base = _flags(w.get("flags"))
        mode = ("reference" if "--bench.reference" in base
                else flag_value(base, "--parallelism.mode") or "single")
        label = flag_value(base, "--bench.label") or ""
        peak, what = w["peak"], f"{w['suite']}/{w['name']} peak"
        if self.dry_run:
            best = [f"<activation_checkpoint.mode and bench.batches of the fastest {mode} row "
                    f"labelled {label}>"]
        else:
            try:
                best = shlex.split(best_point(str(self.out / "runs.jsonl"), mode=mode, label=label))
            except (SystemExit, FileNotFoundError) as e:
                print(f"{what}: no point to relaunch ({e})", flush=True)
                self.failed += 1
                return
            print(f"{what}: the fastest point is {shlex.join(best)}", flush=True)
        step = {**w, "flags": base, "limit": peak.get("limit", w.get("limit"))}
        step.pop("largest", None)
        self.run_step(step, what, nproc, extra=tuple(best),
                      launch_numbers=range(2, int(peak.get("launches", 3)) + 1))

    # -- suites -----------------------------------------------------------------------------

    def run_suite(self, suite: Suite) -> None:
        deadline = "" if suite.seconds is None else f" (deadline {suite.seconds:.0f} s" + (
            f", shared by every {suite.shared_deadline} suite)" if suite.shared_deadline else ")")
        print(f"=== {suite.name} {time.strftime('%H:%M:%S')}{deadline}"
              f"{f': {suite.description}' if suite.description else ''}", flush=True)
        now = time.monotonic()
        if suite.shared_deadline and suite.seconds is not None:
            self.deadline = self.deadlines.setdefault(suite.shared_deadline, now + suite.seconds)
        else:
            self.deadline = None if suite.seconds is None else now + suite.seconds
        if self.dry_run:
            self.deadline = None
        for w in suite.workloads:
            self.run_workload(w)
            if self.stop:
                return

    def correctness(self, suite: Suite) -> bool:
        """The correctness stage: each workload into OUT/correctness.log; True if all pass."""
        print(f"=== correctness {time.strftime('%H:%M:%S')}", flush=True)
        log, ok = self.out / "correctness.log", True
        for w in suite.workloads:
            args = _flags(w.get("flags"))
            rc = self.launch(f"correctness/{w['name']}", self.command(w, args, self.ngpu),
                             limit=w.get("limit"), env=dict(w.get("env", {})), log=log)
            ok = ok and rc == 0
        if not self.dry_run:
            keep = re.compile(r"PASSED|FAILED|ERROR|passed|failed|skipped|weight diff")
            lines = [t for t in log.read_text().splitlines() if keep.search(t)]
            print("".join(f"    {t}\n" for t in lines), end="", flush=True)
        return ok


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
        for path in sorted(SUITES.glob("*.toml")):
            print(f"{path.stem:24} {tomllib.loads(path.read_text()).get('description', '')}")
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
