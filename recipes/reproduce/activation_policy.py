"""Activation policy against memory: throughput and peak GPU memory of each policy at the same
batches, SlideDP's (keep, selective, recompute, and the first --keep-blocks blocks kept; one
build for all) beside the GPU-resident baselines' checkpointing (none, selective, full).

    python -m recipes.reproduce.activation_policy [--batches 4,16] [--systems fsdp2-full,...]
"""

from recipes.reproduce.common import (BATCH, GPU_ALLOC, GPU_RESERVED, HOST_RSS, STEP, SYSTEM,
                                      TOKENS, Column, parser, select_systems, start,
                                      write_outputs)

PAPER = ("at 32 sequences per GPU the fixed Qwen3-14B configuration uses 15.0 GiB of peak CUDA "
         "reserved memory on an 80-GB H100: spare HBM is a policy variable (retain activations, "
         "retain intermediates, or replay less), chosen per block by Elastic Checkpointing.")

COLUMNS = [SYSTEM, Column("policy", "activations"), BATCH, TOKENS, STEP, GPU_ALLOC, GPU_RESERVED,
           HOST_RSS]


def plot(plt, rows: list[dict]):
    fig, ax = plt.subplots(figsize=(7, 5))
    for r in rows:
        memory = r.get("peak_mem_reserved_gib") or r["peak_rss_gib"]
        ax.scatter(memory, r["tokens_per_s"])
        ax.annotate(f"{r['system']} {r['policy']} b{r['local_batch']}", (memory, r["tokens_per_s"]),
                    fontsize=7)
    ax.set_xlabel("peak GPU GiB reserved (CPU run: host RSS)")
    ax.set_ylabel("tokens/s")
    ax.grid(alpha=0.3)
    return fig


def main() -> None:
    p = parser(__doc__, systems="the baselines (empty: none)", batches=True)
    p.add_argument("--policies", default="keep,selective,recompute",
                   help="SlideDP policies (empty: none)")
    p.add_argument("--keep-blocks", type=int, default=0,
                   help="SlideDP: the first N blocks keep everything (each policy's variant)")
    args = p.parse_args()
    runner = start(args, "activation_policy",
                   gpu={"batches": "4,16", "systems": "fsdp2-none,fsdp2-selective,fsdp2-full"},
                   tiny={"batches": "1,2", "systems": ""})
    nproc, rows = runner.nproc(), []
    if args.policies:
        # Ascending memory: a policy that does not fit ends the launch after the cheaper ones.
        order = ["recompute", "selective", "keep"]
        policies = sorted(args.policies.split(","), key=lambda p: order.index(p) if p in order else -1)
        points = [f"{policy}:{args.batches}" for policy in policies]
        for row in runner.bench(["--parallelism.mode=slidedp",
                                 f"--slidedp.keep_blocks={args.keep_blocks}",
                                 "--bench.points", *points], nproc=nproc, label="slidedp"):
            policy = row["ac"] + (f"+keep{args.keep_blocks}" if args.keep_blocks else "")
            rows.append({**row, "system": "slidedp", "policy": policy})
    for row in runner.sweep(select_systems(args.systems), args.batches, nproc=nproc):
        rows.append({**row, "policy": row["ac"]})
    write_outputs(runner, rows, COLUMNS, title="Activation policy against memory", paper=PAPER,
                  plot=plot)


if __name__ == "__main__":
    main()
