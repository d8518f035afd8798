"""STREAM triad on the host (slidedp/plan/triad.py), the attainable memory bandwidth a CPU
update is measured against: for each thread count the standalone OpenMP triad
(csrc/stream_triad.c) with plain and with non-temporal stores, each under STREAM's static
schedule and under dynamic chunks, the triad on our CPU Adam's
thread pool, and with --adam our fused AdamW (recipes/bench/cpu_adam.py's workload, 28 bytes per
parameter) on as many threads, each as the best and the median of --repeats timed runs, and the
update's best over the best standalone triad's (docs/PERFORMANCE.md rule 8), the update in the
runtime's layout (the gradient waiting in the BF16 shadow it overwrites), the update on a memfd
mapped shared (as the runtime's host state) without and with MADV_HUGEPAGE and on anonymous
memory with it (as the OpenMP triad's arrays), each with the share of its mapping that huge pages
back, and the update again with its helpers pinned one per core (slidedp.pin_threads). The
kernel's THP modes are recorded with the rows. With OpenMP the update is also set against the
program's in-place swap (its best schedule): as many bytes written as read, the update's own mix,
so that a gap to the triad can be told apart from one to what that mix allows.

    python -m recipes.bench.stream --threads 8,16 --repeats 10 --adam [--json out.json]

The OpenMP threads are bound OMP_PROC_BIND=close, OMP_PLACES=cores unless the environment sets
them. Without a C compiler with OpenMP only the pool's triad is printed.
"""

import argparse
import json
import mmap
import os
import statistics
from pathlib import Path

import torch

from recipes.bench.cpu_adam import ADAM_BYTES_PER_PARAM, HYPER, Workload, timed_runs
from recipes.metrics import cpu_name
from slidedp import affinity, cpu_adam, native_build
from slidedp.plan.triad import (TRIAD_BYTES_PER_ELEM, default_elements, last_level_cache_bytes,
                                openmp_swap, openmp_triad_binary, openmp_triads, pool_triad_seconds)


def _best_median(nbytes: float, seconds: list[float]) -> tuple[float, float]:
    return nbytes / min(seconds) / 1e9, nbytes / statistics.median(seconds) / 1e9


BACKINGS = ("memfd", "memfd-thp", "thp")
"""The update's memory besides torch's allocator: a memfd mapped shared, as slidedp/host_state.py
maps the training state, without and with MADV_HUGEPAGE (shared memory gets huge pages only where
the kernel's shmem_enabled allows them); anonymous memory with MADV_HUGEPAGE, as the OpenMP
triad's arrays."""

HUGE = 2 << 20  # a transparent huge page


def transparent_huge_pages() -> dict[str, str]:
    """The kernel's THP modes (the bracketed word of each sysfs file), for anonymous and shared
    memory: MADV_HUGEPAGE takes effect only where the mode is `madvise`/`advise` or broader."""
    modes = {}
    for name in ("enabled", "shmem_enabled"):
        path = Path("/sys/kernel/mm/transparent_hugepage") / name
        text = path.read_text() if path.exists() else ""
        modes[name] = text.split("[")[1].split("]")[0] if "[" in text else "unknown"
    return modes


def huge_page_kib() -> int:
    """KiB of this process's memory mapped with huge pages, anonymous and shared (0 where
    /proc/self/smaps_rollup is missing): what MADV_HUGEPAGE actually got."""
    path = Path("/proc/self/smaps_rollup")
    if not path.exists():
        return 0
    fields = dict(line.split(":", 1) for line in path.read_text().splitlines() if ":" in line)
    return sum(int(fields.get(name, "0 kB").split()[0]) for name in ("AnonHugePages", "ShmemPmdMapped"))


ARRAY_BYTES = {"param": 4, "exp_avg": 4, "exp_avg_sq": 4, "grad": 2, "bf16_out": 2}
"""The update's five arrays and their bytes per element: FP32 param and moments, BF16 gradient
and output."""


def _span(n: int, size: int) -> int:
    """n elements of `size` bytes, rounded up to whole huge pages."""
    return -(-n * size // HUGE) * HUGE


def mapping_bytes(n: int) -> int:
    """The bytes of `backed_arrays(n, ...)`'s one mapping."""
    return sum(_span(n, size) for size in ARRAY_BYTES.values())


def backed_arrays(n: int, backing: str) -> dict[str, torch.Tensor]:
    """ARRAY_BYTES' arrays of n elements, each at a huge-page boundary of one mapping of
    `backing` (BACKINGS)."""
    total = mapping_bytes(n)
    if backing.startswith("memfd"):
        fd = os.memfd_create("slidedp-stream", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, total)
            memory = mmap.mmap(fd, total, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
    else:
        memory = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if backing.endswith("thp"):
        memory.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(memory, dtype=torch.uint8)  # holds a reference to the mapping
    arrays, offset = {}, 0
    for name, size in ARRAY_BYTES.items():
        dtype = torch.float32 if size == 4 else torch.bfloat16
        arrays[name] = raw[offset:offset + n * size].view(dtype)
        offset += _span(n, size)
    arrays["grad"].copy_(torch.randn(n, generator=torch.Generator().manual_seed(0)))
    return arrays


def backed_update_seconds(arrays: dict[str, torch.Tensor], threads: int, repeats: int) -> list[float]:
    """`timed_runs` of the update (its output apart from the gradient) on `backed_arrays`."""
    steps = iter(range(1, repeats + 2))

    def step() -> None:
        cpu_adam.adam_update(arrays["param"], arrays["grad"], arrays["exp_avg"], arrays["exp_avg_sq"],
                             step=next(steps), **HYPER, bf16_out=arrays["bf16_out"], num_threads=threads)
    return timed_runs(step, repeats)


def measure(threads: int, *, elements: int, repeats: int, openmp: bool,
            work: Workload | None) -> dict:
    """One row: every triad (and the update, given its workload) on `threads` threads."""
    row: dict = {"threads": threads}
    if openmp:
        runs = openmp_triads(elements=elements, threads=threads, repeats=repeats)
        row["openmp"] = [{"mode": r.mode, "schedule": r.schedule, "best_gbs": r.best_gbs,
                          "median_gbs": r.median_gbs} for r in runs]
        row["triad_mode"] = f"{runs[0].mode} {runs[0].schedule}"
        row["triad_best_gbs"] = runs[0].best_gbs
        swap = openmp_swap(elements=elements, threads=threads, repeats=repeats)
        row["swap_schedule"], row["swap_best_gbs"], row["swap_median_gbs"] = (
            swap.schedule, swap.best_gbs, swap.median_gbs)
    seconds, kernel = pool_triad_seconds(elements=elements, threads=threads, repeats=repeats)
    row["pool_best_gbs"], row["pool_median_gbs"] = _best_median(elements * TRIAD_BYTES_PER_ELEM, seconds)
    row["pool_kernel"] = kernel
    if work is not None:
        seconds = timed_runs(lambda: work.ours(threads), repeats)
        row["adam_best_gbs"], row["adam_median_gbs"] = _best_median(work.n * ADAM_BYTES_PER_PARAM, seconds)
        # Rule 8: the same statistic on both sides; the pool's triad where OpenMP is missing.
        triad_gbs = row.get("triad_best_gbs", row["pool_best_gbs"])
        row["adam_over_triad"] = row["adam_best_gbs"] / triad_gbs
        if "swap_best_gbs" in row:
            row["adam_over_swap"] = row["adam_best_gbs"] / row["swap_best_gbs"]
        # The runtime's layout, the gradient in the shadow: the same bytes, none of them the
        # read-for-ownership of an output apart from the gradient (csrc/cpu_adam.cpp adam_lanes).
        seconds = timed_runs(lambda: work.ours_in_shadow(threads), repeats)
        row["adam_in_shadow_best_gbs"], row["adam_in_shadow_median_gbs"] = _best_median(
            work.n * ADAM_BYTES_PER_PARAM, seconds)
        row["adam_in_shadow_over_triad"] = row["adam_in_shadow_best_gbs"] / triad_gbs
        # The same update on other memory: the page size and sharing the runtime's state has.
        for backing in BACKINGS:
            before = huge_page_kib()
            arrays = backed_arrays(work.n, backing)
            best, median = _best_median(work.n * ADAM_BYTES_PER_PARAM,
                                        backed_update_seconds(arrays, threads, repeats))
            row[f"adam_{backing}_best_gbs"], row[f"adam_{backing}_median_gbs"] = best, median
            row[f"adam_{backing}_over_triad"] = best / triad_gbs
            row[f"adam_{backing}_huge_page_share"] = (huge_page_kib() - before) * 1024 / mapping_bytes(work.n)
            del arrays
        # The same update with each helper pinned to a core (slidedp.pin_threads; this thread
        # stays on every core), unpinned again for the next row.
        where = affinity.placement(sorted(os.sched_getaffinity(0)), update_threads=threads)
        cpu_adam.pin_helpers(list(where.helpers))
        seconds = timed_runs(lambda: work.ours(threads), repeats)
        cpu_adam.pin_helpers([-1] * len(where.helpers))
        row["adam_pinned_best_gbs"], row["adam_pinned_median_gbs"] = _best_median(
            work.n * ADAM_BYTES_PER_PARAM, seconds)
    return row


def describe(row: dict) -> str:
    """One printed line: best / median GB/s of each contender."""
    parts = [f"{row['threads']:3d} threads:"]
    for r in sorted(row.get("openmp", []), key=lambda r: (r["mode"], r["schedule"])):
        parts.append(f"openmp {r['mode']} {r['schedule']} {r['best_gbs']:6.1f} / {r['median_gbs']:6.1f}")
    if "swap_best_gbs" in row:
        parts.append(f"openmp swap {row['swap_schedule']} {row['swap_best_gbs']:6.1f} / {row['swap_median_gbs']:6.1f}")
    parts.append(f"pool ({row['pool_kernel']}) {row['pool_best_gbs']:6.1f} / {row['pool_median_gbs']:6.1f}")
    if "adam_best_gbs" in row:
        against = f"openmp {row['triad_mode']}" if "triad_mode" in row else "pool"
        parts.append(f"adam {row['adam_best_gbs']:6.1f} / {row['adam_median_gbs']:6.1f} "
                     f"= {row['adam_over_triad']:.2f}x the {against} triad"
                     + (f", {row['adam_over_swap']:.2f}x the swap" if "adam_over_swap" in row else "")
                     + "; gradient in the shadow "
                     f"{row['adam_in_shadow_best_gbs']:6.1f} / {row['adam_in_shadow_median_gbs']:6.1f} "
                     f"= {row['adam_in_shadow_over_triad']:.2f}x; "
                     + "".join(f"on {b} {row[f'adam_{b}_best_gbs']:6.1f} / {row[f'adam_{b}_median_gbs']:6.1f} "
                               f"= {row[f'adam_{b}_over_triad']:.2f}x ({row[f'adam_{b}_huge_page_share']:.0%} "
                               "in huge pages); " for b in BACKINGS)
                     + "pinned "
                     f"{row['adam_pinned_best_gbs']:6.1f} / {row['adam_pinned_median_gbs']:6.1f}")
    return "  ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default=str(cpu_adam.host_cores()),
                        help="comma-separated thread counts (default: every core)")
    parser.add_argument("--elements", type=int, default=0,
                        help="elements per array (0: 4x the last-level caches)")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per point (best and median)")
    parser.add_argument("--adam", action="store_true", help="also time our CPU AdamW on the same threads")
    parser.add_argument("--params", type=float, default=200e6, help="parameters per update (--adam)")
    parser.add_argument("--json", help="also write the rows to this path")
    args = parser.parse_args()
    elements = args.elements or default_elements()
    try:
        binary = str(openmp_triad_binary())
    except native_build.NativeBuildError as e:
        print(f"no standalone OpenMP triad, the pool's only: {e}")
        binary = None
    meta = {"cpu": cpu_name(), "cores": cpu_adam.host_cores(),
            "last_level_cache_bytes": last_level_cache_bytes(), "elements": elements,
            "repeats": args.repeats, "openmp_triad": binary,
            "omp_proc_bind": os.environ.get("OMP_PROC_BIND", "close"),
            "omp_places": os.environ.get("OMP_PLACES", "cores"),
            "transparent_huge_pages": transparent_huge_pages()}
    work = None
    if args.adam:
        work = Workload(int(args.params))
        meta.update(params=work.n, isa=cpu_adam.active_isa(), adam_bytes_per_param=ADAM_BYTES_PER_PARAM)
    print(f"STREAM triad, 3 x {elements * 8 / 2**20:.0f} MiB FP64 arrays, {meta['cores']} cores, "
          f"GB/s best / median of {args.repeats}"
          + (f"; CPU AdamW {work.n / 1e6:.0f}M params, ISA {meta['isa']}" if work else ""))
    rows = []
    for threads in (int(t) for t in args.threads.split(",")):
        rows.append(measure(threads, elements=elements, repeats=args.repeats,
                            openmp=binary is not None, work=work))
        print(describe(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
