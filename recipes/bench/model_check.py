"""The step-time model against measured bench rows: each row's configuration planned with a
rates file, predicted against measured step time.

    python -m recipes.bench.model_check --rates h200x2 docs/results/h200x2_call9_runs.jsonl ...
    python -m recipes.bench.model_check --rates OUT/rates.json OUT/runs.jsonl --within 0.10

`--rates` is a shipped rates file (slidedp/plan/rates/) or one the probe wrote on the machine
that ran the rows (`python -m recipes.probe CONFIG --out OUT/rates.json`). SlideDP rows are
simulated (slidedp/plan/steptime.py); compute-reference rows are the model's GPU work alone.
FSDP2 rows are skipped (the model simulates SlideDP's schedule). Prints a markdown table and
the error summary; with `--within`, exits 1 unless every row is within that relative error.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

from recipes.config import JobConfig, resolve_model
from slidedp.activations import KEEP, RECOMPUTE
from slidedp.plan.predict import plan_run
from slidedp.plan.rates import Rates, load_rates
from slidedp.plan.workload import Workload


def config_of(row: dict) -> JobConfig:
    """The configuration recipes/bench/throughput.py ran for `row` (rows from before the bench
    recorded slots, chunk and the guard ran its defaults: 3 slots, 32 MiB, no guard)."""
    cfg = JobConfig()
    cfg.parallelism.mode = "slidedp" if row["mode"] == "slidedp" else "single"
    cfg.model.flavor = row["flavor"]
    cfg.model.kernels = row.get("kernels", "torch")
    accum = row.get("accum", 1)
    cfg.training.seq_len = row["seq"]
    cfg.training.local_batch_size = row["local_batch"] // accum
    cfg.training.grad_accum_steps = accum
    cfg.training.max_norm = row["max_norm"] if row.get("max_norm") is not None else 1.0
    cfg.training.nonfinite = row.get("nonfinite", "off")
    cfg.activation_checkpoint.mode = row["ac"] if row["mode"] != "slidedp" else "none"
    if row["mode"] == "slidedp":
        s = cfg.slidedp
        s.delivery, s.reduction = row["route"].split("/")
        s.activation, s.keep_blocks = row["ac"], row.get("keep_blocks") or 0
        s.activation_blocks = row.get("activation_blocks") or ""
        s.window_slots, s.chunk_mib = row.get("slots") or 3, row.get("chunk_mib") or 32.0
    return cfg


def predict(row: dict, rates: Rates) -> tuple[float, str]:
    """(predicted step seconds, regime) of a slidedp or reference row."""
    cfg = config_of(row)
    flavor, args = resolve_model(cfg)
    kernels = cfg.model.kernels
    if row["mode"] == "reference":
        policy = RECOMPUTE if row["ac"] == "full" else KEEP
        work = Workload(rates, args, flavor=flavor, kernels=kernels, seq=cfg.training.seq_len)
        return work.micro_batch([policy] * args.n_layers, cfg.training.local_batch_size).total, "compute"
    plan = plan_run(cfg, args, flavor=flavor, kernels=kernels, world=row["world"], rates=rates)
    return plan.step.step_s, plan.step.regime


def activations(row: dict) -> str:
    text = row["ac"] + (f"+keep{row['keep_blocks']}" if row.get("keep_blocks") else "")
    return text + (f" [{row['activation_blocks']}]" if row.get("activation_blocks") else "")


def check(paths: list[str], rates: Rates) -> tuple[list[str], list[float]]:
    lines = ["| rows | system | model | kernels | route | activations | seq/GPU | measured s | "
             "predicted s | error | regime |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    errors = []
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            if row["mode"] not in ("slidedp", "reference"):
                continue
            predicted, regime = predict(row, rates)
            error = predicted / row["step_time_s"] - 1
            errors.append(error)
            accum = row.get("accum", 1)
            batch = f"{row['local_batch']} ({accum}x{row['local_batch'] // accum})" if accum > 1 else row["local_batch"]
            system = row["mode"] + (" clip" if row.get("max_norm") else "") + (
                f" {row['label']}" if row.get("label") else "")
            lines.append(f"| {Path(path).stem} | {system} | {row['flavor']} | "
                         f"{row.get('kernels', 'torch')} | {row['route']} | {activations(row)} | "
                         f"{batch} | {row['step_time_s']:.3f} | {predicted:.3f} | {error:+.1%} | {regime} |")
    return lines, errors


def summary(errors: list[float]) -> str:
    if not errors:
        return "no rows"
    absolute = [abs(e) for e in errors]
    return (f"{len(errors)} rows: mean |error| {statistics.mean(absolute):.1%}, median "
            f"{statistics.median(absolute):.1%}, max {max(absolute):.1%}; within 10%: "
            f"{sum(a <= 0.10 for a in absolute)} of {len(errors)}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("rows", nargs="+", help="JSONL files of recipes/bench/throughput.py")
    p.add_argument("--rates", required=True, help="a rates file or the name of a shipped one")
    p.add_argument("--within", type=float, default=0.0,
                   help="exit 1 unless every row's |error| is at most this (e.g. 0.10)")
    a = p.parse_args()
    lines, errors = check(a.rows, load_rates(a.rates))
    print("\n".join(lines))
    print()
    print(summary(errors))
    return 1 if a.within and any(abs(e) > a.within for e in errors) else 0


if __name__ == "__main__":
    sys.exit(main())
