"""STREAM triad on the host: the attainable memory bandwidth a CPU update is measured against
(the probe's `dram_gbs`, slidedp/plan/probe.py; `python -m recipes.bench.stream` prints it).

a = b + s * c over FP64 arrays each at least 4x the last-level caches (STREAM's rule), with
STREAM's own loop in our C++ library on the CPU Adam's thread pool (slidedp.cpu_adam.stream_triad;
torch.add where that library cannot be built). Counted as STREAM counts it: 3 arrays x 8 bytes per
element (two reads, one write; the write-allocate read is not counted); the best of `repeats`
runs. A torch op is not this figure: torch's copy and add run on its own intra-op threads, not
the update's, and can stay below what the CPU Adam itself moves (docs/PERFORMANCE.md)."""

import glob
import time

import torch

from slidedp import cpu_adam

TRIAD_BYTES_PER_ELEM = 3 * 8


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


def triad_gbs(*, elements: int, threads: int, repeats: int = 5) -> float:
    """Best triad bandwidth in GB/s (1e9 bytes) over `repeats` runs on `threads` threads."""
    return triad(elements=elements, threads=threads, repeats=repeats)[0]


def triad(*, elements: int, threads: int, repeats: int = 5) -> tuple[float, str]:
    """`triad_gbs` and the loop that ran ("slidedp", or "torch" for the fallback)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)  # the fallback's threads, and the arrays' parallel fill
    try:
        b = torch.full((elements,), 2.0, dtype=torch.float64)
        c = torch.full((elements,), 0.5, dtype=torch.float64)
        a = torch.empty_like(b)

        def run() -> str:
            return cpu_adam.stream_triad(a, b, c, scalar=3.0, num_threads=threads)

        run()  # warm-up: page faults, thread pool
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            kernel = run()
            best = min(best, time.perf_counter() - start)
        if a[0].item() != 3.5 or a[-1].item() != 3.5:
            raise RuntimeError(f"triad computed {a[0].item()}, {a[-1].item()}, expected 3.5")
    finally:
        torch.set_num_threads(previous)
    return elements * TRIAD_BYTES_PER_ELEM / best / 1e9, kernel
