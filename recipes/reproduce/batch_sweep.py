"""Batch-size sweep: throughput, peak GPU memory and host memory (peak RSS of rank 0) against the
local batch, per system, on every GPU found.

    python -m recipes.reproduce.batch_sweep [--systems slidedp-recompute,fsdp2-full,...]
        [--batches 1,2,4,8,16] [--flavor qwen3-4B --seq 4096]
"""

from recipes.reproduce.common import (BATCH, GPU_ALLOC, GPU_RESERVED, HOST_RSS, STEP, SYSTEM,
                                      TOKENS, WORLD, Column, fastest, log2_axis, parser,
                                      select_systems, start, write_outputs)

PAPER = ("batch-size scaling and CPU memory for Qwen3-8B on 4 x RTX 4090 and Qwen3-14B on "
         "4 x H100, GPU memory against batch for Qwen3-14B (figures; the summary gives no values). "
         "On record (docs/DESIGN.md §4): SlideFormer, Qwen3-8B, batch 64, seq 1024 on one RTX "
         "4090: 27.3 s/step, 2,398 tokens/s, 15.6 GiB GPU, ~133 GB host; ZeRO-Offload, "
         "Llama-3.1-8B, batch 32, seq 1024: 18.3 s/step, 1,791 tokens/s; SlideDP, Qwen3-14B at "
         "32 sequences per GPU on an 80-GB H100: 15.0 GiB peak reserved.")

COLUMNS = [SYSTEM, WORLD, BATCH, TOKENS, STEP, Column("mfu", "MFU", "{:.1%}"), GPU_ALLOC,
           GPU_RESERVED, HOST_RSS]


def lines(rows: list[dict]) -> dict[str, list[dict]]:
    """Each system's median launch at each batch, by batch: --rows may hold a point several
    times (several launches or calls), the table lists each, and a line through all would
    double back."""
    best = fastest(rows, key=lambda r: (r["system"], r["local_batch"]))
    out: dict[str, list[dict]] = {r["system"]: [] for r in rows}  # in order of first appearance
    for system, batch in sorted(best, key=lambda k: k[1]):
        out[system].append(best[system, batch])
    return out


def plot(plt, rows: list[dict]):
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6), layout="constrained")
    panels = [("tokens_per_s", "tokens/s"), ("peak_mem_reserved_gib", "peak GPU GiB (reserved)"),
              ("peak_rss_gib", "host RSS GiB (rank 0)")]
    by_system = lines(rows)
    for ax, (key, label) in zip(axes, panels):
        for system, line in by_system.items():
            points = [(r["local_batch"], r[key]) for r in line if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points), marker="o", label=system)
        log2_axis(ax, ylabel=label)
    # Below the panels: inside one, the legend hid a line.
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncol=4, fontsize=8)
    fig.suptitle(f"{rows[0]['flavor']}, seq {rows[0]['seq']}, {rows[0]['world']} GPU(s)"
                 if rows else "no points")
    return fig


def main() -> None:
    args = parser(__doc__, systems="the systems", batches=True).parse_args()
    runner = start(args, "batch_sweep",
                   gpu={"batches": "1,2,4,8,16",
                        "systems": "slidedp-recompute,fsdp2-full,zero2-offload,reference-full"},
                   tiny={"batches": "1,2",
                         "systems": "slidedp-recompute,fsdp2-full,reference-full"})
    rows = runner.sweep(select_systems(args.systems), args.batches, nproc=runner.nproc())
    write_outputs(runner, rows, COLUMNS, title="Batch-size sweep", paper=PAPER, plot=plot)


if __name__ == "__main__":
    main()
