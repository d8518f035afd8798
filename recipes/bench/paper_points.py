"""The paper's reported points, predicted by the step-time model from the rates of the paper's
platforms (slidedp/plan/rates/*.json: derived from published specs and stated assumptions, not
measured), for docs/RESULTS.md:

    python -m recipes.bench.paper_points [--seq 512]

- Qwen3-14B at a global batch of 256 sequences on 4 and 8 A800s (NVLink bridges): SlideDP,
  SlideFormer's data parallelism (slidedp/plan/steptime.py's "slideformer" schedule) and the
  compute reference. The paper's sequence length is not in the summary we have: 512 is assumed
  (at 1024 the reference would need 81% of the A800's peak); the model's GPU rate is the share
  of peak our H200 reached. A second column calibrates the GPU to the paper's own reference
  (27.2 and 14.4 s), so what remains is the host side of the model.
- Sharded against replicated delivery on 4 A800s, 16 and 8 sequences per GPU, with and without
  the bridges.
- The cast-and-copy of an 800M-parameter layer by one GPU and by two at once; with
  `--cast-and-copy RATES ...` only this table, from the probe's rates of 1, 2, 4, ... ranks of one
  machine (their copies with every rank copying measured, the cast modelled; the suite
  `cast_copy`).
Assumed everywhere: torch kernels, full recompute, no clipping (max_norm = 0), 3 slots, 32 MiB
chunks, the BF16 shadow (SlideFormer: the FP32 master cast on the CPU).
"""

import argparse
from dataclasses import replace

from recipes.config import JobConfig, resolve_model, run_config
from slidedp.activations import RECOMPUTE
from slidedp.plan.predict import step_spec
from slidedp.plan.rates import Rates, load_rates
from slidedp.plan.steptime import cast_and_copy_gbs, simulate_step
from slidedp.plan.workload import Workload

FLAVOR = "qwen3-14B"
GLOBAL_BATCH = 256
PAPER = {"reference": {4: 27.2, 8: 14.4}, "slidedp": {4: 29.6, 8: 15.3}, "slideformer": {4: 43.0, 8: 43.0},
         "routes": {("nvlink", 16): 1.17, ("nvlink", 8): 1.33, ("pcie", 16): 1 / 1.26, ("pcie", 8): 1 / 1.19},
         "cast": {1: 15.6, 2: 8.7}}
"""The paper's figures (issue 11, item 8): seconds per step; routes as replicated / sharded step
time (sharded 17% faster with the bridges: 1.17; replicated 26% faster without: 1/1.26); cast
and copy in GB/s per GPU."""


def config(per_gpu: int, *, seq: int, route: str, shadow: bool = True) -> JobConfig:
    c = JobConfig()
    c.parallelism.mode = "slidedp"
    c.model.flavor, c.model.kernels = FLAVOR, "torch"
    c.training.seq_len, c.training.local_batch_size = seq, per_gpu
    c.training.max_norm, c.training.nonfinite = 0.0, "off"
    c.slidedp.delivery, c.slidedp.reduction = route.split("/")
    c.slidedp.bf16_shadow = shadow
    return c


def step(rates: Rates, per_gpu: int, world: int, *, seq: int, route: str = "sharded/gpu",
         schedule: str = "slidedp") -> float:
    shadow = schedule != "slideformer"
    c = config(per_gpu, seq=seq, route=route, shadow=shadow)
    name, args = resolve_model(c)
    spec = step_spec(run_config(c), args, flavor=name, kernels="torch", world=world, rates=rates,
                     schedule=schedule)
    return simulate_step(spec, rates).step_s


def reference(rates: Rates, per_gpu: int, *, seq: int) -> float:
    name, args = resolve_model(config(per_gpu, seq=seq, route="sharded/gpu"))
    work = Workload(rates, args, flavor=name, kernels="torch", seq=seq)
    return work.micro_batch([RECOMPUTE] * args.n_layers, per_gpu).total


def calibrated(rates: Rates, model_ref: float, paper_ref: float) -> Rates:
    """`rates` with the GPU as fast as the paper's reference says."""
    scale = model_ref / paper_ref
    return replace(rates, gpu_tflops={k: v * scale for k, v in rates.gpu_tflops.items()})


def implied(seconds, target: float, lo: float, hi: float, *, steps: int = 7) -> float:
    """The value x in [lo, hi] (geometric bisection) at which `seconds(x)` meets `target`, for a
    `seconds` that falls as x grows: what a paper's figure implies about a rate we do not know."""
    for _ in range(steps):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if seconds(mid) > target else (lo, mid)
    return (lo * hi) ** 0.5


def _pct(model: float, paper: float) -> str:
    return f"{model / paper - 1:+.0%}"


def strong_scaling(seq: int) -> list[str]:
    rates = load_rates("a800x8_nvlink")
    rows, cal = {}, {}
    for world in (4, 8):
        per = GLOBAL_BATCH // world
        ref = reference(rates, per, seq=seq)
        cal[world] = calibrated(rates, ref, PAPER["reference"][world])
        rows[world] = {
            "reference": (ref, PAPER["reference"][world]),
            "slidedp": (step(rates, per, world, seq=seq), step(cal[world], per, world, seq=seq)),
            "slideformer": (step(rates, per, world, seq=seq, route="replicated/cpu", schedule="slideformer"),
                            step(cal[world], per, world, seq=seq, route="replicated/cpu",
                                 schedule="slideformer")),
        }
    # The update rate of SlideFormer's rank 0 (AdamW and the host sum, every core) at which the
    # model meets the paper's ~43 s on 4 GPUs; then the 8-GPU step at that rate.
    def slideformer_at(scale: float, world: int = 4) -> float:
        base = cal[world]
        slow = replace(base, adam_gparams={t: v * scale for t, v in base.adam_gparams.items()},
                       grad_sum_gelems={t: v * scale for t, v in base.grad_sum_gelems.items()})
        return step(slow, GLOBAL_BATCH // world, world, seq=seq, route="replicated/cpu",
                    schedule="slideformer")

    scale = implied(slideformer_at, PAPER["slideformer"][4], 0.01, 1.0)
    fitted = {world: slideformer_at(scale, world) for world in (4, 8)}
    rate = scale * rates.adam(rates.machine.cores) / 1e9
    lines = [f"Qwen3-14B, global batch {GLOBAL_BATCH} x {seq} tokens, A800 with NVLink bridges "
             f"(a800x8_nvlink.json), seconds per step:", "",
             "| system | GPUs | paper | model (spec rates) | model (GPU calibrated to the paper's reference) |",
             "|---|---|---|---|---|"]
    for world in (4, 8):
        r = rows[world]
        ref = r["reference"][0]
        lines.append(f"| compute reference | {world} | {PAPER['reference'][world]} | {ref:.1f} "
                     f"({_pct(ref, PAPER['reference'][world])}) | {PAPER['reference'][world]} (by construction) |")
        for key, label in (("slidedp", "SlideDP (sharded/gpu)"), ("slideformer", "SlideFormer-style DP")):
            spec_s, cal_s = r[key]
            paper = PAPER[key][world]
            approx = "~" if key == "slideformer" else ""
            lines.append(f"| {label} | {world} | {approx}{paper} | {spec_s:.1f} ({_pct(spec_s, paper)}) | "
                         f"{cal_s:.1f} ({_pct(cal_s, paper)}) |")
        lines.append(f"| SlideFormer-style DP, rank 0 updating at {rate:.2f} Gparam/s (fitted to "
                     f"the paper's 4-GPU step) | {world} | ~{PAPER['slideformer'][world]} | – | "
                     f"{fitted[world]:.1f} ({_pct(fitted[world], PAPER['slideformer'][world])}) |")
    return lines


def routes(seq: int) -> list[str]:
    lines = ["Replicated / sharded step time on 4 A800s (above 1: sharded is faster), Qwen3-14B:", "",
             "| bridges | seq/GPU | paper | model | sharded s | replicated s |", "|---|---|---|---|---|---|"]
    for bridges, name in (("nvlink", "a800x8_nvlink"), ("pcie", "a800x8_pcie")):
        rates = load_rates(name)
        for per in (16, 8):
            sharded = step(rates, per, 4, seq=seq, route="sharded/gpu")
            replicated = step(rates, per, 4, seq=seq, route="replicated/gpu")
            paper = PAPER["routes"][bridges, per]
            lines.append(f"| {'with' if bridges == 'nvlink' else 'without'} | {per} | {paper:.2f} | "
                         f"{replicated / sharded:.2f} | {sharded:.2f} | {replicated:.2f} |")
    # The bridge-less collective bandwidth at which the model meets the paper's 16-seq ratio.
    rates = load_rates("a800x8_pcie")

    def ratio_at(gbs: float, per: int = 16) -> float:
        slow = replace(rates, all_gather_gbs=gbs, reduce_scatter_gbs=gbs)
        return step(slow, per, 4, seq=seq) / step(slow, per, 4, seq=seq, route="replicated/gpu")

    gbs = implied(ratio_at, 1.26, 1.0, 24.0)
    for per in (16, 8):
        lines.append(f"| without, collectives at {gbs:.1f} GB/s (fitted to the paper's 16-seq "
                     f"ratio) | {per} | {PAPER['routes']['pcie', per]:.2f} | "
                     f"{1 / ratio_at(gbs, per):.2f} | | |")
    return lines


def cast_and_copy(rates_of: dict[int, Rates]) -> list[str]:
    """The table for `rates_of`: the rates with which each GPU count copies (a spec file for
    every count, or the probe's of that many ranks)."""
    lines = ["Cast (FP32 -> BF16 on the CPU) and copy of an 800M-parameter layer, GB/s of BF16 per GPU:", "",
             "| GPUs copying at once | rates | H2D per GPU alone / all at once | paper | model, the "
             "cores shared by the GPUs' casts | model, one thread casting per GPU |",
             "|---|---|---|---|---|---|"]
    for gpus, rates in sorted(rates_of.items()):
        shared, single = (cast_and_copy_gbs(rates, elems=800_000_000, gpus=gpus, chunk_elems=16 << 20,
                                            threads=t) for t in (max(1, rates.machine.cores // gpus), 1))
        paper = PAPER["cast"].get(gpus)
        vs = (lambda x: f" ({_pct(x, paper)})") if paper else (lambda x: "")
        lines.append(f"| {gpus} | {rates.machine.source} | {rates.h2d_gbs:.1f} / "
                     f"{rates.h2d_together_gbs:.1f} | {paper or '–'} | {shared:.1f}{vs(shared)} | "
                     f"{single:.1f}{vs(single)} |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=512, help="the assumed sequence length")
    p.add_argument("--cast-and-copy", nargs="+", metavar="RATES",
                   help="only the cast-and-copy table, from these rates files (one per GPU count: "
                        "the probe's on 1, 2, 4, ... ranks)")
    a = p.parse_args()
    if a.cast_and_copy:
        measured = [load_rates(path) for path in a.cast_and_copy]
        print("\n".join(cast_and_copy({r.machine.devices: r for r in measured})))
        return
    a800 = load_rates("a800x8_nvlink")
    print("\n".join([*strong_scaling(a.seq), "", *routes(a.seq), "", *cast_and_copy({1: a800, 2: a800})]))


if __name__ == "__main__":
    main()
