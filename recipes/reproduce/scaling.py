"""GPU-count scaling on one host: strong (a fixed global batch split over 1, 2, 4, ... GPUs) and
weak (a fixed batch per GPU), for SlideDP and the compute-only reference (each GPU alone, scaled
by the count: the ideal), up to every GPU found.

    python -m recipes.reproduce.scaling [--global-batch 64] [--local-batch 16] [--gpus 1,2,4,8]

Efficiency against the fewest GPUs n0 measured: strong = (t(n0) / t(n)) / (n / n0) with t the
step time; weak = (tokens/s(n) / n) / (tokens/s(n0) / n0).
"""

from recipes.reproduce.common import (BATCH, STEP, SYSTEM, TOKENS, WORLD, Column, parser,
                                      select_systems, start, write_outputs)

PAPER = ("weak scaling: Qwen3-32B at 64 sequences per GPU keeps 95-98% efficiency from 2 to 8 "
         "A800s. Strong scaling: Qwen3-14B at a global batch of 256 on A800s, 4 -> 8 GPUs: the "
         "matched compute reference goes from 27.2 to 14.4 s per step, SlideFormer stays near "
         "43 s, SlideDP goes from 29.6 to 15.3 s.")

COLUMNS = [Column("scaling", "scaling"), SYSTEM, WORLD, BATCH, Column("global_batch", "global batch"),
           TOKENS, STEP, Column("efficiency", "efficiency", "{:.1%}")]


def gpu_counts(text: str, available: int) -> list[int]:
    if text:
        return [int(n) for n in text.split(",")]
    counts = [1 << i for i in range(available.bit_length()) if 1 << i < available]
    return counts + [available]


def with_efficiency(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        group = [q for q in rows if q["scaling"] == r["scaling"] and q["system"] == r["system"]]
        base = min(group, key=lambda q: q["world"])
        n = r["world"] / base["world"]
        if r["scaling"] == "strong":
            eff = base["step_time_s"] / r["step_time_s"] / n
        else:
            eff = r["tokens_per_s"] / base["tokens_per_s"] / n
        out.append({**r, "efficiency": eff})
    return out


def plot(plt, rows: list[dict]):
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, scaling in zip(axes, ("strong", "weak")):
        for system in dict.fromkeys(r["system"] for r in rows):
            points = [(r["world"], r["tokens_per_s"]) for r in rows
                      if r["scaling"] == scaling and r["system"] == system]
            if points:
                ax.plot(*zip(*points), marker="o", label=system)
        ax.set_title(f"{scaling} scaling")
        ax.set_xlabel("GPUs")
        ax.set_ylabel("tokens/s (global)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return fig


def main() -> None:
    p = parser(__doc__, systems="the systems")
    p.add_argument("--gpus", default="", help="GPU counts (default 1, 2, 4, ... up to all)")
    p.add_argument("--global-batch", type=int, help="strong scaling: sequences per step")
    p.add_argument("--local-batch", type=int, help="weak scaling: sequences per GPU")
    args = p.parse_args()
    runner = start(args, "scaling",
                   gpu={"systems": "slidedp-recompute,reference-full", "global_batch": 0,
                        "local_batch": 16},
                   tiny={"systems": "slidedp-recompute", "global_batch": 2, "local_batch": 1})
    counts = gpu_counts(args.gpus, runner.gpus or 2)
    global_batch = args.global_batch or args.local_batch * max(counts)
    bad = [n for n in counts if global_batch % n]
    if bad:
        raise SystemExit(f"error: --global-batch {global_batch} does not split over {bad[0]} GPUs")
    rows = []
    for system in select_systems(args.systems):
        for n in counts:
            # Both regimes' local batches in one launch (one point when they coincide).
            batches = dict.fromkeys([args.local_batch, global_batch // n])
            for row in runner.bench([*system.flags, "--bench.batches", *map(str, batches)],
                                    nproc=n, label=system.name):
                for scaling, local in (("weak", args.local_batch), ("strong", global_batch // n)):
                    if row["local_batch"] == local:
                        rows.append({**row, "system": system.name, "scaling": scaling,
                                     "global_batch": local * n})
    rows.sort(key=lambda r: (r["scaling"], r["system"], r["world"]))
    write_outputs(runner, with_efficiency(rows), COLUMNS, title="GPU-count scaling",
                  paper=PAPER, plot=plot)


if __name__ == "__main__":
    main()
