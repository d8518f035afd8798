"""Long context: one sequence per step against its length, SlideDP with full recompute (and any
other --systems), with YaRN scaling where the length exceeds the model's positions (Qwen3's cards:
x4 over 32,768 native positions for 131,072; a power of two x 32,768 beyond). A step of a long
sequence takes minutes: one timed step, no clipping, and one warm-up step only below 131,072 tokens
by default (WARM_BELOW).

    python -m recipes.reproduce.long_context [--seqs 32768,65536,131072,262144]
"""

import math

from protocols.model_spec import get_flavor
from recipes.reproduce.common import (GPU_ALLOC, GPU_RESERVED, SYSTEM, TOKENS, WORLD, Column,
                                      log2_axis, parser, select_systems, start, write_outputs)

NATIVE = 32768
"""Qwen3's pre-training positions, which YaRN scales."""

WARM_BELOW = 131072
"""Without --warmup, lengths below this get one warm-up step, longer ones none. A step of a few
seconds would otherwise carry the first update cycle's tail (seconds of updates after its
compute), which a step of minutes hides."""

PAPER = ("256K-token sequences for Qwen3-14B on 4 x H100 (no throughput given), and over 1M "
         "tokens per step without gradient accumulation.")

COLUMNS = [SYSTEM, Column("seq", "tokens/sequence"), Column("rope_scaling", "RoPE scaling"), WORLD,
           TOKENS, Column("step_time_s", "s/step", "{:.2f}"), GPU_ALLOC, GPU_RESERVED,
           Column("peak_rss_gib", "host RSS GiB", "{:.1f}")]


def rope_flags(flavor: str, seq: int) -> list[str]:
    """YaRN over the native positions when `seq` exceeds the flavor's positions."""
    if seq <= get_flavor(flavor).max_position_embeddings:
        return []
    factor = 2 ** math.ceil(math.log2(seq / NATIVE))
    return ["--model.rope_scaling_type=yarn", f"--model.rope_scaling_factor={factor}",
            f"--model.original_max_position_embeddings={NATIVE}"]


def plot(plt, rows: list[dict]):
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for system in dict.fromkeys(r["system"] for r in rows):
        mine = [r for r in rows if r["system"] == system]
        ax.plot([r["seq"] for r in mine], [r["tokens_per_s"] for r in mine], marker="o",
                label=system)
        bx.plot([r["seq"] for r in mine], [r.get("peak_mem_reserved_gib") or r["peak_rss_gib"]
                                           for r in mine], marker="o", label=system)
    log2_axis(ax, xlabel="tokens per sequence", ylabel="tokens/s")
    log2_axis(bx, xlabel="tokens per sequence", ylabel="peak GPU GiB reserved (CPU run: host RSS)")
    ax.legend(fontsize=8)
    return fig


def main() -> None:
    p = parser(__doc__, systems="the systems")
    p.add_argument("--seqs", help="sequence lengths")
    args = p.parse_args()
    runner = start(args, "long_context",
                   gpu={"seqs": "32768,65536,131072,262144", "systems": "slidedp-recompute",
                        "steps": 1, "warmup": None, "max_norm": 0.0},
                   tiny={"seqs": "64,128", "systems": "slidedp-recompute"})
    per_length_warmup = args.warmup is None
    rows = []
    for system in select_systems(args.systems):
        for seq in (int(s) for s in args.seqs.split(",")):
            if per_length_warmup:
                args.warmup = 1 if seq < WARM_BELOW else 0  # the runner reads it per launch
            # The last training.seq_len wins over the run's; one launch per length (its RoPE
            # tables).
            for row in runner.bench([*system.flags, f"--training.seq_len={seq}",
                                     "--bench.batches=1",
                                     *rope_flags(args.flavor, seq)],
                                    nproc=runner.nproc(), label=system.name):
                rows.append({**row, "system": system.name})
    write_outputs(runner, rows, COLUMNS, title="Long context", paper=PAPER, plot=plot)


if __name__ == "__main__":
    main()
