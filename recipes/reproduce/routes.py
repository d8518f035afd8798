"""Route comparison: SlideDP's four datapaths (delivery replicated | sharded, reduction gpu |
cpu) against the local batch, in one build per batch list, with the bytes each route moved per
rank and its step time over the best route's at the same batch. On one GPU the routes move the
same bytes (there is nothing to shard or reduce): run it on several.

    python -m recipes.reproduce.routes [--batches 8,16] [--routes sharded/gpu,replicated/gpu,...]
"""

from recipes.reproduce.common import (BATCH, STEP, TOKENS, WORLD, Column, batch_flags, parser,
                                     start, write_outputs)

ROUTES = "sharded/gpu,replicated/gpu,sharded/cpu,replicated/cpu"

PAPER = ("4 x A800 with NVLink bridges, Qwen3-14B at 16 sequences per GPU: sharded delivery 17% "
         "faster than replicated; without the bridges replicated 26% faster; at 8 sequences per "
         "GPU the gaps are 33% and 19%. GPU-bound 8-GPU workloads (64-256 sequences per GPU): "
         "the routes differ by under 2.5%. Replicated delivery with CPU reduction multiplies H2D "
         "and D2H traffic by the rank count R; sharded delivery with GPU reduction keeps them "
         "independent of R.")

COLUMNS = [Column("route", "delivery/reduction"), WORLD, BATCH, TOKENS, STEP,
           Column("vs_best", "step time / best route's", "{:.3f}"),
           Column("traffic_h2d_mb", "H2D MB/rank", "{:,.1f}"),
           Column("traffic_d2h_mb", "D2H MB/rank", "{:,.1f}"),
           Column("traffic_all_gather_mb", "all-gather MB", "{:,.1f}"),
           Column("traffic_reduce_scatter_mb", "reduce-scatter MB", "{:,.1f}"),
           Column("traffic_host_reduce_mb", "host reduce MB", "{:,.1f}"),
           Column("update_tail_s", "update tail s", "{:.3f}")]


def with_ratios(rows: list[dict]) -> list[dict]:
    best = {}
    for r in rows:
        best[r["local_batch"]] = min(best.get(r["local_batch"], float("inf")), r["step_time_s"])
    return [{**r, "vs_best": r["step_time_s"] / best[r["local_batch"]]} for r in rows]


def plot(plt, rows: list[dict]):
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    batches = sorted({r["local_batch"] for r in rows})
    routes = list(dict.fromkeys(r["route"] for r in rows))
    width = 0.8 / max(1, len(routes))
    for i, route in enumerate(routes):
        by_batch = {r["local_batch"]: r for r in rows if r["route"] == route}
        xs = [j + i * width for j, b in enumerate(batches) if b in by_batch]
        ax.bar(xs, [by_batch[b]["tokens_per_s"] for b in batches if b in by_batch], width,
               label=route)
        bx.bar(xs, [by_batch[b].get("traffic_h2d_mb", 0) + by_batch[b].get("traffic_d2h_mb", 0)
                    for b in batches if b in by_batch], width, label=route)
    for axis, label in ((ax, "tokens/s"), (bx, "host traffic MB per rank (H2D + D2H)")):
        axis.set_xticks([j + width * (len(routes) - 1) / 2 for j in range(len(batches))],
                        [str(b) for b in batches])
        axis.set_xlabel("sequences per GPU")
        axis.set_ylabel(label)
    ax.legend(fontsize=8)
    return fig


def main() -> None:
    p = parser(__doc__, batches=True)
    p.add_argument("--routes", default=ROUTES, help="delivery/reduction list")
    p.add_argument("--activation", default="recompute", help="SlideDP's activation policy")
    args = p.parse_args()
    runner = start(args, "routes",
                   gpu={"batches": "8,16"},
                   tiny={"batches": "1"})
    # The first route's reduction decides whether the host staging region exists: a CPU one
    # first, so every route can run in the same build.
    routes = sorted(args.routes.split(","), key=lambda r: not r.endswith("/cpu"))
    rows = runner.bench(["--parallelism.mode=slidedp", f"--slidedp.activation={args.activation}",
                         "--bench.routes", *routes, *batch_flags(args.batches)],
                        nproc=runner.nproc(default_cpu=2), label="routes")
    write_outputs(runner, with_ratios(rows), COLUMNS, title="Route comparison", paper=PAPER,
                  plot=plot)


if __name__ == "__main__":
    main()
