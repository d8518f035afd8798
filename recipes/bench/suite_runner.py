"""Runs loaded suites (recipes.bench.suite_file): each workload's variants as launches on their
ranks, each under min(its limit, what is left of its suite's deadline) with its output in
OUT/logs/ and its bench rows in OUT/runs.jsonl; the correctness stage into OUT/correctness.log;
a sweep's fastest point relaunched as a peer's peak; and the counts of launches, failures and
skips that decide the invocation's exit status."""

import glob
import os
import re
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from string import Template

from recipes.bench.kill import KILLED, run_launch, settle
from recipes.bench.suite_file import Suite, flag_args

REPO = Path(__file__).resolve().parents[2]
BENCH = "recipes.bench.throughput"
MIN_LEFT_S = 10
"""A launch that would get less than this before the deadline is skipped."""
ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
       "NVSHMEM_DISABLE_NVLS": "1", "PYTHONUNBUFFERED": "1"}
"""NVLink multicast off (the lent machines do not allow it) and unbuffered logs."""
DEFAULT_ENV = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
"""What a launch gets unless the caller's environment sets it: run_train.sh's allocator, so that
a bench measures the allocator training runs with (the planner's fit assumes it: a plan that
fits by its allocations can fail on the default allocator's fragments)."""


def launch_env(ranks: int) -> dict[str, str]:
    """The environment of a bench launch of `ranks` ranks, as run_train.sh sets training's:
    DEFAULT_ENV under the caller's, ENV over it, each rank's share of the cores and the
    repository on PYTHONPATH."""
    cores = len(os.sched_getaffinity(0))
    path = os.environ.get("PYTHONPATH")
    return {**DEFAULT_ENV, **os.environ, **ENV, "OMP_NUM_THREADS": str(max(1, cores // ranks)),
            "PYTHONPATH": os.pathsep.join(filter(None, [path, str(REPO)]))}


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
        self.env = launch_env(self.ngpu)

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
            rc = run_launch(cmd, limit=cut, out=f, cwd=REPO, env={**self.env, **env})
        took = time.monotonic() - start
        note = f" (killed at its {cut:.0f} s limit)" if rc in KILLED else ""
        print(f"[suite] {what}: rc {rc} in {took:.1f} s{note}; {log.relative_to(self.out)}",
              flush=True)
        text = log.read_text(errors="replace")
        if show:
            print(text, end="" if text.endswith("\n") else "\n", flush=True)
        elif rc != 0:
            print("".join(f"    {t}\n" for t in text.splitlines()[-12:]), end="", flush=True)
        if rc in KILLED:
            settle()
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
                flags = flag_args(w.get("flags")) + flag_args(variant.get("flags"))
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
        args = [*flag_args(step["flags"], names), *extra]
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

        base = flag_args(w.get("flags"))
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
            args = flag_args(w.get("flags"))
            rc = self.launch(f"correctness/{w['name']}", self.command(w, args, self.ngpu),
                             limit=w.get("limit"), env=dict(w.get("env", {})), log=log)
            ok = ok and rc == 0
        if not self.dry_run:
            keep = re.compile(r"PASSED|FAILED|ERROR|passed|failed|skipped|weight diff")
            lines = [t for t in log.read_text().splitlines() if keep.search(t)]
            print("".join(f"    {t}\n" for t in lines), end="", flush=True)
        return ok
