"""STREAM triad on the host: the attainable memory bandwidth a CPU update is measured against
(the probe's `dram_gbs`, slidedp/plan/probe_machine.py; `python -m recipes.bench.stream` prints it).

a = b + s * c over FP64 arrays each at least 4x the last-level caches (STREAM's rule), counted as
STREAM counts it: 3 arrays x 8 bytes per element (two reads, one write; the write-allocate read is
not counted). Two loops:
- `openmp_triad`: a standalone OpenMP program (csrc/stream_triad.c, built with -march=native),
  arrays first-touched by the threads that use them, plain or non-temporal stores, STREAM's static
  schedule or dynamic chunks (on a VM with uneven vCPUs a static split waits for the slowest):
  the host's limit that docs/PERFORMANCE.md rule 8 asks for is the best of these;
- `triad`: STREAM's loop in our C++ library on the CPU Adam's thread pool
  (slidedp.cpu_adam.stream_triad; torch.add where that library cannot be built), arrays filled by
  torch: what the probe uses, and the fallback where no C compiler with OpenMP is found.
The OpenMP program also runs `swap` (a and b exchanged in place, 32 bytes per element): as many
bytes written as read, into the lines just read, the CPU AdamW's own mix without its arithmetic,
so that an update below the triad can be told from one below what its traffic allows.
A torch op is neither figure: torch's copy and add run on its own intra-op threads, not the
update's, and can stay below what the CPU Adam itself moves (docs/PERFORMANCE.md)."""

import dataclasses
import glob
import json
import os
import subprocess
import time
from pathlib import Path

import torch

from slidedp import cpu_adam, native_build

TRIAD_BYTES_PER_ELEM = 3 * 8
STORE_MODES = ("plain", "nt")
SCHEDULES = ("static", "dynamic")
_OPENMP_SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "stream_triad.c"
_OPENMP_FLAGS = ("-O3", "-march=native", "-fopenmp")
# Threads pinned one per core, in order, unless the caller's environment says otherwise.
_OPENMP_ENV_DEFAULTS = {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}


@dataclasses.dataclass(frozen=True)
class OpenMPTriad:
    """One run of the standalone triad (its JSON line, and the binding it ran under)."""

    threads: int
    elements: int
    repeats: int
    mode: str
    """'plain' or 'nt' (non-temporal stores)."""
    schedule: str
    """'static' (STREAM's) or 'dynamic' (chunks of 32 Ki elements, as our pool hands out)."""
    kernel: str
    """'triad' or 'swap' (a and b exchanged in place)."""
    best_s: float
    median_s: float
    best_gbs: float
    """GB/s (1e9 bytes) of the fastest run, 24 bytes per element (swap: 32)."""
    median_gbs: float
    proc_bind: str
    places: str


def last_level_cache_bytes() -> int:
    """The sum of the distinct last-level caches of this machine (0 if sysfs does not say)."""
    caches: dict[str, int] = {}
    for index in glob.glob("/sys/devices/system/cpu/cpu*/cache/index*"):
        try:
            level = int(open(f"{index}/level").read())
            size = open(f"{index}/size").read().strip()
            shared = open(f"{index}/shared_cpu_list").read().strip()
        except (OSError, ValueError):
            continue
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        nbytes = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        caches[f"{level}:{shared}"] = nbytes
    top = max((int(k.split(":")[0]) for k in caches), default=0)
    return sum(v for k, v in caches.items() if int(k.split(":")[0]) == top)


def default_elements() -> int:
    """STREAM's rule: each array at least 4x the last-level caches (at least 64 Mi elements)."""
    return max(4 * last_level_cache_bytes() // 8, 64 * 2**20)


def openmp_triad_binary() -> Path:
    """csrc/stream_triad.c compiled ($CC, else cc) into the CPU Adam's cache; raises
    native_build.NativeBuildError without a compiler or OpenMP."""
    return native_build.compile_cached(_OPENMP_SOURCE, _OPENMP_FLAGS, "stream_triad",
                                       compiler=os.environ.get("CC", "cc"))


def openmp_triad(*, elements: int, threads: int, repeats: int = 10, mode: str = "nt",
                 schedule: str = "static", kernel: str = "triad",
                 env: dict[str, str] | None = None) -> OpenMPTriad:
    """The standalone triad (or `kernel="swap"`, plain stores) on `threads` OpenMP threads,
    `repeats` timed runs after a warm-up. `env` is added to this process's environment
    (OMP_PROC_BIND=close, OMP_PLACES=cores unless either sets them)."""
    if threads < 1:  # OpenMP would ignore OMP_NUM_THREADS=0 and take every core
        raise ValueError(f"openmp_triad: threads must be >= 1, got {threads}")
    binary = openmp_triad_binary()
    run_env = {**_OPENMP_ENV_DEFAULTS, **os.environ, **(env or {}), "OMP_NUM_THREADS": str(threads)}
    args = [str(binary), str(elements), str(repeats), mode, schedule, kernel]
    result = subprocess.run(args, capture_output=True, text=True, env=run_env)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {result.returncode}: {result.stderr.strip()}")
    return OpenMPTriad(**json.loads(result.stdout), proc_bind=run_env["OMP_PROC_BIND"],
                       places=run_env["OMP_PLACES"])


def openmp_triads(*, elements: int, threads: int, repeats: int = 10,
                  env: dict[str, str] | None = None) -> list[OpenMPTriad]:
    """`openmp_triad` in every store mode and schedule, the best (by `best_gbs`) first."""
    runs = [openmp_triad(elements=elements, threads=threads, repeats=repeats, mode=mode,
                         schedule=schedule, env=env)
            for mode in STORE_MODES for schedule in SCHEDULES]
    return sorted(runs, key=lambda r: r.best_gbs, reverse=True)


def openmp_swap(*, elements: int, threads: int, repeats: int = 10,
                env: dict[str, str] | None = None) -> OpenMPTriad:
    """`openmp_triad`'s swap in both schedules, the faster (by `best_gbs`)."""
    runs = [openmp_triad(elements=elements, threads=threads, repeats=repeats, mode="plain",
                         schedule=schedule, kernel="swap", env=env) for schedule in SCHEDULES]
    return max(runs, key=lambda r: r.best_gbs)


def triad_gbs(*, elements: int, threads: int, repeats: int = 5) -> float:
    """Best pool triad bandwidth in GB/s (1e9 bytes) over `repeats` runs on `threads` threads."""
    return triad(elements=elements, threads=threads, repeats=repeats)[0]


def triad(*, elements: int, threads: int, repeats: int = 5) -> tuple[float, str]:
    """`triad_gbs` and the loop that ran ("slidedp", or "torch" for the fallback)."""
    seconds, kernel = pool_triad_seconds(elements=elements, threads=threads, repeats=repeats)
    return elements * TRIAD_BYTES_PER_ELEM / min(seconds) / 1e9, kernel


def pool_triad_seconds(*, elements: int, threads: int, repeats: int = 5) -> tuple[list[float], str]:
    """The pool triad's time of each of `repeats` runs after a warm-up, and the loop that ran."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)  # the fallback's threads, and the arrays' parallel fill
    try:
        b = torch.full((elements,), 2.0, dtype=torch.float64)
        c = torch.full((elements,), 0.5, dtype=torch.float64)
        a = torch.empty_like(b)

        def run() -> str:
            return cpu_adam.stream_triad(a, b, c, scalar=3.0, num_threads=threads)

        kernel = run()  # warm-up: page faults, thread pool
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            seconds.append(time.perf_counter() - start)
        if a[0].item() != 3.5 or a[-1].item() != 3.5:
            raise RuntimeError(f"triad computed {a[0].item()}, {a[-1].item()}, expected 3.5")
    finally:
        torch.set_num_threads(previous)
    return seconds, kernel
