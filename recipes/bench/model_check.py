"""The step-time model (slidedp/plan/steptime.py) against measured bench rows
(recipes/bench/throughput.py):

    python -m recipes.bench.model_check check --rates h200x2 \\
        docs/results/2026-11-30-h200x2/h200x2_call*_runs.jsonl
    python -m recipes.bench.model_check predict --rates OUT/rates_4b.json --flavor qwen3-4B \\
        --points keep:1,4 recompute:16 --out OUT/predicted.jsonl
    python -m recipes.bench.model_check compare OUT/predicted.jsonl OUT/runs.jsonl [--within 0.10]

`check` plans each recorded row's configuration with a rates file now (a shipped one, or the
probe's: `python -m recipes.probe CONFIG --out OUT/rates.json`). `predict` writes the model's
rows before anything is measured: the bench's point syntax, one row per point with the keys
of the bench's rows and `predicted_s`, and the rates file it used. `compare` joins them with
the measured rows; rows nobody predicted beforehand (AutoPolicy's choice) are predicted then,
from the rates of the same model and marked so, and each model's AutoPolicy row is set beside
the best hand-picked row at its batch. SlideDP rows are simulated (the SlideFormer-style runtime
with its own schedule, `--runtime slideformer`); compute-reference rows are the model's GPU work
alone; other modes and the MegaTrain-style runtime (the model has no schedule for it) are
skipped. Each prints a markdown table and the error summary; with `--within`, exits 1 unless
every row compared is within that relative error.
"""

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import get_args

from recipes.bench.rows import emit
from recipes.bench.config import point_specs
from recipes.bench.report import system_name
from recipes.config import JobConfig, resolve_model, run_config
from slidedp.activations import KEEP, RECOMPUTE
from slidedp.host_state import updates_deferred
from slidedp.peer_styles import RUNTIME_STYLES
from slidedp.plan.predict import plan_run
from slidedp.plan.rates import MissingRate, Rates, load_rates, timing_key
from slidedp.plan.report import kernels_for
from slidedp.plan.step_spec import Schedule
from slidedp.plan.workload import Workload

SUPERSEDED = {
    "h200x2_call1_runs": "the first gradient norm, on the host (3.5 s per step), replaced before "
                         "every later run",
    "h200x2_call2_runs": "code before aedc014: recompute replayed each block's last projection",
    "h200x2_call3_runs": "code before aedc014 (first session)",
    "h200x2_call4_runs": "code before aedc014 (first session)",
    "h200x2_call5_runs": "code before aedc014: the cpu route's host sum and norm in torch",
    "h200x2_call6_runs": "code before aedc014; its clip rows also time the first clipped update's "
                         "page faults",
}
"""Recorded SlideDP rows of a runtime since changed (docs/results/2026-11-30-h200x2/README.md says
how), by file."""
ARTIFACTS = {
    ("h200x2_call8_runs", "clip", 16, 1): "the first clipped update's page faults fell in the "
                                          "timed steps (docs/results/2026-11-30-h200x2/README.md)",
}
"""Recorded rows a bench artifact spoiled: (file, label, local batch, accum) -> why."""
KEY = ("mode", "runtime", "flavor", "kernels", "route", "ac", "activation_blocks", "keep_blocks",
       "slots", "chunk_mib", "world", "seq", "local_batch", "accum", "max_norm", "nonfinite",
       "embedding_update", "gpu_state_blocks", "moments_dtype", "speculative_update")
"""What identifies a point in the predicted and the measured rows alike."""
DEFAULTS = {"runtime": "slidedp", "activation_blocks": "", "keep_blocks": 0, "slots": 3,
            "chunk_mib": 32.0, "accum": 1, "max_norm": 0.0, "nonfinite": "off",
            "embedding_update": "host", "gpu_state_blocks": 0, "moments_dtype": "float32",
            "speculative_update": False}
"""For rows from before the bench recorded a key: its defaults, and max_norm 0 as every SlideDP
launch of the GPU runs ran then (the non-finite guard did not exist; nor the embedding's update
on the GPU)."""


def _get(row: dict, key: str):
    value = row.get(key)
    return DEFAULTS.get(key) if value is None else value


def modelled(row: dict) -> bool:
    """Whether the model predicts `row`: the compute reference, or SlideDP under a runtime style
    it has a schedule for."""
    return row["mode"] == "reference" or (row["mode"] == "slidedp"
                                          and _get(row, "runtime") in get_args(Schedule))


def config_of(row: dict) -> JobConfig:
    """The configuration recipes/bench/throughput.py ran for `row`."""
    cfg = JobConfig()
    slidedp = row["mode"] == "slidedp"
    cfg.parallelism.mode = "slidedp" if slidedp else "single"
    cfg.model.flavor = row["flavor"]
    cfg.model.kernels = _get(row, "kernels") or "torch"  # rows from before the switch: torch
    accum = _get(row, "accum")
    cfg.training.seq_len = row["seq"]
    cfg.training.local_batch_size = row["local_batch"] // accum
    cfg.training.grad_accum_steps = accum
    cfg.training.max_norm = _get(row, "max_norm")
    cfg.training.nonfinite = _get(row, "nonfinite")
    cfg.activation_checkpoint.mode = "none" if slidedp else row["ac"]
    if slidedp:
        s = cfg.slidedp
        s.runtime = _get(row, "runtime")
        s.delivery, s.reduction = row["route"].split("/")
        s.activation, s.keep_blocks = row["ac"], _get(row, "keep_blocks")
        s.activation_blocks = _get(row, "activation_blocks")
        s.window_slots, s.chunk_mib = _get(row, "slots"), _get(row, "chunk_mib")
        s.embedding_update = _get(row, "embedding_update")
        s.gpu_state_blocks = _get(row, "gpu_state_blocks")
        s.moments_dtype = _get(row, "moments_dtype")
        s.speculative_update = _get(row, "speculative_update")
    return cfg


def predict(row: dict, rates: Rates) -> dict:
    """The model's step seconds, regime and bottleneck for a slidedp or reference row."""
    cfg = config_of(row)
    flavor, args = resolve_model(cfg)
    kernels = cfg.model.kernels
    if row["mode"] == "reference":
        policy = RECOMPUTE if row["ac"] == "full" else KEEP
        work = Workload(rates, args, flavor=flavor, kernels=kernels, seq=cfg.training.seq_len)
        seconds = work.micro_batch([policy] * args.n_layers, cfg.training.local_batch_size).total
        return {"predicted_s": seconds, "regime": "compute", "why": "GPU work alone"}
    # Rows without `sync` waited for the device after every step, as "step" does.
    plan = plan_run(run_config(cfg), args, flavor=flavor, kernels=kernels, world=row["world"],
                    rates=rates, schedule=cfg.slidedp.runtime,
                    device_sync=row.get("sync", "step") == "step")
    step, seconds = plan.step, plan.step.step_s
    if plan.speculation is not None:  # the timed steps' mix of standing and redone updates
        redo = row.get("speculative_redo", 0.0)
        seconds = (1 - redo) * seconds + redo * plan.speculation.redone.step_s
    return {"predicted_s": seconds, "regime": step.regime, "why": step.why}


def _activations(row: dict) -> str:
    text = row["ac"] + (f"+keep{row['keep_blocks']}" if row.get("keep_blocks") else "")
    return text + (f" [{row['activation_blocks']}]" if row.get("activation_blocks") else "")


def _batch(row: dict) -> str:
    accum = _get(row, "accum")
    return f"{row['local_batch']} ({accum}x{row['local_batch'] // accum})" if accum > 1 else str(row["local_batch"])


def _updates(row: dict) -> str:
    if row["mode"] != "slidedp":
        return "-"
    style_routes = RUNTIME_STYLES[row.get("runtime") or "slidedp"].routes
    reduction = (style_routes or row["route"].split("/"))[-1]
    deferred = updates_deferred(max_norm=_get(row, "max_norm"), nonfinite=_get(row, "nonfinite"),
                                reduction=reduction)
    where = {"gpu": ", embedding on the GPU", "resident": ", embedding resident on the GPU"}.get(
        _get(row, "embedding_update"), "")
    if _get(row, "gpu_state_blocks"):
        where += f", {_get(row, 'gpu_state_blocks')} blocks resident on the GPU"
    where += {"bfloat16": ", BF16 moments", "8bit": ", 8-bit moments"}.get(_get(row, "moments_dtype"), "")
    if _get(row, "speculative_update"):
        where += f", speculative ({row.get('speculative_redo', 0.0):.0%} redone)"
    return ("deferred" if deferred else "in backward") + where


HEADER = ["| rows | system | model | kernels | route | activations | updates | seq | seq/GPU | "
          "measured s | predicted s | error | regime | note |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]


def _line(source: str, row: dict, predicted: dict, note: str) -> str:
    error = predicted["predicted_s"] / row["step_time_s"] - 1
    return (f"| {source} | {system_name(row)} | {row['flavor']} | {_get(row, 'kernels') or 'torch'} | "
            f"{row['route']} | {_activations(row)} | {_updates(row)} | {row['seq']} | "
            f"{_batch(row)} | {row['step_time_s']:.3f} | {predicted['predicted_s']:.3f} | "
            f"{error:+.1%} | {predicted['regime']} | {note} |")


def _rows(paths: list[str]):
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if line.strip():
                yield Path(path).stem, json.loads(line)


def _why_not_current(source: str, row: dict) -> str:
    if row["mode"] != "slidedp":
        return ""
    key = (source, row.get("label") or "", row["local_batch"], _get(row, "accum"))
    return ARTIFACTS.get(key) or SUPERSEDED.get(source, "")


def check(paths: list[str], rates: Rates) -> tuple[list[str], list[float], list[float]]:
    """The table of recorded rows predicted with `rates`, the errors of the rows of the current
    runtime, and those of the superseded or spoiled ones."""
    lines, current, old = list(HEADER), [], []
    for source, row in _rows(paths):
        if not modelled(row):
            continue
        try:
            predicted = predict(row, rates)
        except MissingRate as e:  # said in the table, counted in neither summary
            lines.append(f"| {source} | {row.get('label', '')} | {row['flavor']} | not predicted: "
                         f"{e} |")
            continue
        note = _why_not_current(source, row)
        (old if note else current).append(predicted["predicted_s"] / row["step_time_s"] - 1)
        lines.append(_line(source, row, predicted, f"not counted: {note}" if note else ""))
    return lines, current, old


def summary(errors: list[float]) -> str:
    if not errors:
        return "no rows"
    absolute = [abs(e) for e in errors]
    return (f"{len(errors)} rows: mean |error| {statistics.mean(absolute):.1%}, median "
            f"{statistics.median(absolute):.1%}, max {max(absolute):.1%}; within 10%: "
            f"{sum(a <= 0.10 for a in absolute)} of {len(errors)}")


# ---- predictions written before measuring ------------------------------------------------------------


def with_attention(rates: Rates, paths: list[str], *, attention: str) -> Rates:
    """`rates` with the attention rates of recipes/bench/attention.py's rows for the backend
    `attention` (the bench's --attention); SystemExit when none of them timed it."""
    timed = {timing_key(r["flavor"], r["seq"]): r["tflops"] for _, r in _rows(paths)
             if r.get("backend") == attention and "tflops" in r}
    if not timed:
        raise SystemExit(f"error: {', '.join(paths)}: no timed row of the {attention} backend")
    return replace(rates, attention_tflops={**rates.attention_tflops, **timed})


def prediction_rows(rates_path: str, *, flavor: str, seq: int, points: list[str], world: int,
                    route: str, kernels: str, slots: int, chunk_mib: float, max_norm: float,
                    nonfinite: str, accum: int = 1, runtime: str = "slidedp",
                    attention_rows: list[str] = (), attention: str = "auto") -> list[dict]:
    """One row per point of the bench's syntax (POLICY[|BLOCKS]:B1,B2; B sequences per GPU, split
    into `accum` micro-batches), keyed as the bench keys its; with `attention_rows`, the
    attention rate measured there (`with_attention`). A peer runtime style runs its own routes,
    as the bench records them."""
    style_routes = RUNTIME_STYLES[runtime].routes
    route = "/".join(style_routes) if style_routes else route
    rates = load_rates(rates_path)
    if attention_rows:
        rates = with_attention(rates, list(attention_rows), attention=attention)
    rows = []
    for policy, blocks, batches in point_specs(points):
        for batch in batches:
            row = {"mode": "slidedp", "runtime": runtime, "label": "", "flavor": flavor,
                   "kernels": kernels, "route": route, "ac": policy, "activation_blocks": blocks,
                   "keep_blocks": 0, "slots": slots, "chunk_mib": chunk_mib, "world": world,
                   "seq": seq, "local_batch": int(batch), "accum": accum, "max_norm": max_norm,
                   "nonfinite": nonfinite, "rates": rates_path,
                   "attention_tflops": rates.attention(flavor, seq)}
            if kernels == "auto":
                row["kernels"] = kernels_for(run_config(config_of(row)), rates)
            rows.append({**row, **predict(row, rates)})
    return rows


def _key(row: dict) -> tuple:
    return tuple(_get(row, k) for k in KEY)


def compare(predicted_path: str, measured_paths: list[str]) -> tuple[list[str], list[float]]:
    """The measured rows beside the predictions (module docstring), and the errors."""
    predictions = {_key(r): r for _, r in _rows([predicted_path])}
    rates_of = {(r["flavor"], r["seq"]): r["rates"] for r in predictions.values()}
    lines, errors, measured = list(HEADER), [], []
    for source, row in _rows(measured_paths):
        if row["mode"] != "slidedp" or not modelled(row):
            continue
        measured.append(row)
        before = predictions.get(_key(row))
        note = ""
        if before is None:
            path = rates_of.get((row["flavor"], row["seq"]))
            if path is None:
                continue
            before, note = predict(row, load_rates(path)), "predicted after it ran, same rates"
        errors.append(before["predicted_s"] / row["step_time_s"] - 1)
        lines.append(_line(source, row, before, note))
    return lines + ["", *_autopolicy_lines(measured)], errors


def _autopolicy_lines(rows: list[dict]) -> list[str]:
    """Each AutoPolicy row beside the fastest hand-picked row of its model, batch and length."""
    out = []
    for auto in (r for r in rows if r.get("label") == "autopolicy"):
        same = [r for r in rows if r.get("label") != "autopolicy" and
                (r["flavor"], r["seq"], r["local_batch"]) == (auto["flavor"], auto["seq"], auto["local_batch"])]
        best = min(same, key=lambda r: r["step_time_s"], default=None)
        against = (f"best hand-picked {_activations(best)} {best['step_time_s']:.3f} s: "
                   f"{best['step_time_s'] / auto['step_time_s']:.3f}x" if best else "no hand-picked row")
        gain = auto["autopolicy_given_s"] - auto["step_time_s"]
        amortized = (f"amortized after {auto['selection_s'] / gain:,.0f} steps" if gain > 0
                     else "not faster than the configuration it started from")
        out.append(f"AutoPolicy, {auto['flavor']} at {auto['local_batch']} x {auto['seq']}: "
                   f"{_activations(auto)}, {auto['route']}, {auto['slots']} slots, chunk "
                   f"{auto['chunk_mib']:g} MiB: {auto['step_time_s']:.3f} s per step ({against}); "
                   f"selection {auto['selection_s']:.1f} s over {auto['selection_steps']} steps, "
                   f"{amortized}")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="recorded rows, predicted now")
    c.add_argument("rows", nargs="+", help="JSONL files of recipes/bench/throughput.py")
    c.add_argument("--rates", required=True, help="a rates file or the name of a shipped one")
    w = sub.add_parser("predict", help="rows of predictions, written before measuring")
    w.add_argument("--rates", required=True, help="a rates file or the name of a shipped one")
    w.add_argument("--flavor", required=True)
    w.add_argument("--seq", type=int, default=4096)
    w.add_argument("--points", nargs="+", required=True, help="POLICY[|BLOCKS]:B1,B2 as the bench takes them")
    w.add_argument("--world", type=int, default=1)
    w.add_argument("--route", default="sharded/gpu")
    w.add_argument("--runtime", default="slidedp", choices=get_args(Schedule),
                   help="as the bench's --runtime (a peer style's routes replace --route)")
    w.add_argument("--accum", type=int, default=1,
                   help="micro-batches each point's sequences per GPU are split into")
    w.add_argument("--kernels", default="auto", help="as the bench's --kernels")
    w.add_argument("--slots", type=int, default=3)
    w.add_argument("--chunk-mib", type=float, default=32.0)
    w.add_argument("--max-norm", type=float, default=0.0)
    w.add_argument("--nonfinite", default="off")
    w.add_argument("--attention-rows", nargs="*", default=[],
                   help="JSONL of recipes/bench/attention.py: time attention at its measured rate")
    w.add_argument("--attention", default="auto", help="the backend of those rows (the bench's --attention)")
    w.add_argument("--out", required=True, help="JSONL file the rows are appended to")
    m = sub.add_parser("compare", help="predictions against the rows measured after them")
    m.add_argument("predicted", help="the rows `predict` wrote")
    m.add_argument("rows", nargs="+", help="JSONL files of recipes/bench/throughput.py")
    for parser in (c, m):
        parser.add_argument("--within", type=float, default=0.0,
                            help="exit 1 unless every row's |error| is at most this (e.g. 0.10)")
    a = p.parse_args()
    if a.command == "predict":
        for row in prediction_rows(a.rates, flavor=a.flavor, seq=a.seq, points=a.points,
                                   world=a.world, route=a.route, kernels=a.kernels, slots=a.slots,
                                   chunk_mib=a.chunk_mib, max_norm=a.max_norm,
                                   nonfinite=a.nonfinite, accum=a.accum, runtime=a.runtime,
                                   attention_rows=a.attention_rows,
                                   attention=a.attention):
            emit("predicted", row, a.out)
        return 0
    if a.command == "check":
        lines, errors, old = check(a.rows, load_rates(a.rates))
        tail = [f"current runtime: {summary(errors)}", f"superseded or spoiled: {summary(old)}"]
    else:
        lines, errors = compare(a.predicted, a.rows)
        tail = [summary(errors)]
    print("\n".join([*lines, "", *tail]))
    return 1 if a.within and any(abs(e) > a.within for e in errors) else 0


if __name__ == "__main__":
    sys.exit(main())
