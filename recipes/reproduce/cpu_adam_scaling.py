"""CPU Adam against cores, beside the host's memory bandwidth measured in the same run: for each
thread count, our fused AdamW (slidedp/cpu_adam.py), torch's fused AdamW with the casts a runtime
needs around it, a torch copy_, and two STREAM triads (slidedp/plan/triad.py) on as many threads:
the standalone OpenMP one (the best of its plain and non-temporal stores, static and dynamic
schedules), which `ours / triad` is against, and the one on our update's thread pool. The
update's bytes are counted at 28 per parameter, the triads' as STREAM counts them.

    python -m recipes.reproduce.cpu_adam_scaling [--params 200e6] [--threads 1,2,4,8,16]
"""

from recipes.bench import cpu_adam
from recipes.reproduce.common import Column, log2_axis, parser, start, write_outputs
from slidedp import native_build
from slidedp.cpu_adam import host_cores
from slidedp.plan.probe_machine import thread_counts
from slidedp.plan.triad import OpenMPTriad, default_elements, openmp_triads, triad

PAPER = ("on the H100 host CPU Adam reaches an estimated 182-184 GB/s at 16 physical cores "
         "across 101-488M-parameter layers; 32 cores improve the update by only 8.5-10.0%.")

NOTES = ("The OpenMP triad is csrc/stream_triad.c, its arrays first-touched by its threads, the "
         "best of plain and non-temporal stores under static and dynamic schedules (named); where "
         "it cannot be built, `ours / triad` is against the pool's. The pool triad is STREAM's "
         "loop on our update's threads (triad loop 'slidedp'; 'torch' where the C++ library could "
         "not be built). STREAM does not count the write-allocate read of the array it writes; our "
         "Adam writes only what it read.")

COLUMNS = [Column("threads", "threads"), Column("ours_gparams", "ours Gparam/s", "{:.2f}"),
           Column("ours_gbs", "ours GB/s", "{:.1f}"),
           Column("torch_gbs", "torch fused+casts GB/s", "{:.1f}"),
           Column("copy_gbs", "copy_ GB/s", "{:.1f}"),
           Column("openmp_triad_gbs", "OpenMP triad GB/s", "{:.1f}"),
           Column("openmp_triad_mode", "OpenMP stores, schedule"),
           Column("triad_gbs", "pool triad GB/s", "{:.1f}"),
           Column("triad_kernel", "pool triad loop"),
           Column("ours_over_triad", "ours / triad", "{:.0%}"),
           Column("ours_over_torch", "ours / torch", "{:.2f}x")]


def plot(plt, rows: list[dict]):
    fig, ax = plt.subplots(figsize=(7, 4))
    threads = [r["threads"] for r in rows]
    for key, label in (("ours_gbs", "our Adam (28 B/param)"), ("torch_gbs", "torch fused + casts"),
                       ("copy_gbs", "torch copy_"), ("openmp_triad_gbs", "OpenMP STREAM triad"),
                       ("triad_gbs", "pool STREAM triad")):
        if any(r.get(key) is None for r in rows):
            continue  # no OpenMP triad here
        ax.plot(threads, [r[key] for r in rows], marker="o", label=label)
    log2_axis(ax, xlabel="threads", ylabel="GB/s")
    ax.legend(fontsize=8)
    return fig


def _openmp_triad(elements: int, threads: int, repeats: int) -> OpenMPTriad | None:
    """The standalone triad's best variant, or None (with a note) where it cannot be built."""
    try:
        return openmp_triads(elements=elements, threads=threads, repeats=repeats)[0]
    except native_build.NativeBuildError as e:
        print(f"[cpu_adam_scaling] no OpenMP triad, against the pool's: {e}", flush=True)
        return None


def main() -> None:
    p = parser(__doc__, recorded=False)  # it times the CPU itself, not through the bench
    p.add_argument("--params", type=float, help="parameters per update")
    p.add_argument("--threads", help="thread counts")
    p.add_argument("--stream-elements", type=int, help="triad elements per array "
                   "(default: 4x the last-level caches, STREAM's rule)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per point")
    args = p.parse_args()
    all_threads = ",".join(map(str, thread_counts(host_cores())))
    runner = start(args, "cpu_adam_scaling",
                   gpu={"params": 200e6, "threads": all_threads,
                        "stream_elements": default_elements()},
                   tiny={"params": 2e6, "threads": "1,2", "stream_elements": 4 * 2**20})
    threads = [int(t) for t in args.threads.split(",")]
    isa = cpu_adam.cpu_adam.active_isa()
    print(f"[cpu_adam_scaling] {args.params / 1e6:.0f}M params, ISA {isa}, "
          f"triad 3 x {args.stream_elements * 8 / 2**20:.0f} MiB, threads {threads}", flush=True)
    rows = []
    for row in cpu_adam.run(int(args.params), threads, args.repeats):
        gbs, kernel = triad(elements=args.stream_elements, threads=row["threads"],
                            repeats=args.repeats)
        best = _openmp_triad(args.stream_elements, row["threads"], args.repeats)
        omp_gbs = None if best is None else best.best_gbs
        rows.append({**row, "openmp_triad_gbs": omp_gbs,
                     "openmp_triad_mode": None if best is None else f"{best.mode} {best.schedule}",
                     "triad_gbs": gbs, "triad_kernel": kernel,
                     "ours_over_triad": row["ours_gbs"] / (omp_gbs or gbs)})
        omp = "" if best is None else f"OpenMP triad {omp_gbs:.1f} GB/s ({best.mode} {best.schedule}), "
        print(f"[cpu_adam_scaling]   {row['threads']} threads: ours {row['ours_gbs']:.1f} GB/s, "
              f"{omp}pool triad {gbs:.1f} GB/s ({kernel})", flush=True)
    write_outputs(runner, rows, COLUMNS, title="CPU Adam against cores", paper=PAPER,
                  plot=plot, notes=NOTES)


if __name__ == "__main__":
    main()
