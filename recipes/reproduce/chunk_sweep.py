"""Chunk-size sweep: SlideDP's pipeline chunk (slidedp.chunk_mib: the cast/H2D and D2H/update
pieces of a block) against throughput and the update tail, at one batch; one build per chunk.

    python -m recipes.reproduce.chunk_sweep [--chunks 4,8,16,32,64,128] [--batch 16]
"""

from recipes.reproduce.common import (BATCH, GPU_RESERVED, STEP, TOKENS, WORLD, Column, log2_axis,
                                      parser, start, write_outputs)

PAPER = ("chunk-size sweeps (a figure; the summary gives no values): chunking overlaps the cast "
         "of one chunk with the transfer of another, and the gradient return with the CPU "
         "update.")

COLUMNS = [Column("chunk_mib", "chunk MiB"), Column("route", "route"), WORLD, BATCH, TOKENS, STEP,
           Column("update_tail_s", "update tail s", "{:.3f}"), GPU_RESERVED]


def plot(plt, rows: list[dict]):
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["chunk_mib"] for r in rows], [r["tokens_per_s"] for r in rows], marker="o")
    log2_axis(ax, xlabel="slidedp.chunk_mib", ylabel="tokens/s")
    tail = ax.twinx()
    tail.plot([r["chunk_mib"] for r in rows], [r.get("update_tail_s", 0) for r in rows],
              marker="s", color="tab:red")
    tail.set_ylabel("update tail s", color="tab:red")
    return fig


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--chunks", help="slidedp.chunk_mib values")
    p.add_argument("--batch", type=int, help="local batch")
    p.add_argument("--route", default="sharded/gpu", help="delivery/reduction")
    p.add_argument("--activation", default="recompute", help="SlideDP's activation policy")
    args = p.parse_args()
    runner = start(args, "chunk_sweep",
                   gpu={"chunks": "4,8,16,32,64,128", "batch": 16},
                   tiny={"chunks": "0.25,1", "batch": 1})
    rows = []
    for chunk in args.chunks.split(","):
        for row in runner.bench(["--parallelism.mode=slidedp",
                                 f"--slidedp.activation={args.activation}",
                                 "--bench.routes", args.route, f"--slidedp.chunk_mib={chunk}",
                                 f"--bench.batches={args.batch}"],
                                nproc=runner.nproc(), label=f"chunk{chunk}"):
            rows.append({**row, "chunk_mib": float(chunk)})
    write_outputs(runner, rows, COLUMNS, title="Chunk-size sweep", paper=PAPER, plot=plot)


if __name__ == "__main__":
    main()
