"""Loss curves with narrower host Adam moments (slidedp.moments_dtype) against FP32 moments: the
same SlideDP fine-tune once per moments dtype, with every update on the host, the same seed,
model init, data order, learning-rate schedule and clipping (training.max_norm = 1.0); then each
curve's step-by-step difference from the FP32 one.

No network reaches the GPU machine, so neither pretrained weights nor a downloaded corpus do:
the model (Qwen3-0.6B's shape) trains from random initialisation, on a real text corpus that
every Python install carries, the standard library's sources (one document per module, test
suites and the generated codec tables left out), with a byte-level BPE tokenizer trained on it
first. The model keeps its flavor's vocabulary rows; the tokenizer uses the first `--vocab`.

GPU defaults: qwen3-0.6B, 4 sequences of 2,048 tokens per step, 200 steps, AdamW lr 3e-4 after
20 warm-up steps, cosine to 3e-5, clipping 1.0, activations kept (its time per dtype on one
H200: docs/results/2026-12-04-h200-session21/; the first run on a machine compiles the CPU Adam
kernel, the tokenizer takes seconds once). On the GPU two identical FP32 runs do not match bit for bit
(the kernels' reductions): their difference is the floor a moments dtype is judged against. --tiny:
qwen3-debug on the CPU, 4 sequences of 64 tokens, 20 steps (seconds per dtype). A dtype named
twice runs twice (its second run labelled `<dtype>-run2`): a second float32 run measures that
floor.

A run named `<dtype>+speculative` trains with slidedp.speculative_update as well: exact, so
`float32+speculative` must follow the float32 curve step for step, and its row says how often
its updates were redone (the steps whose norm clipped).

    python -m recipes.reproduce.moments_curve [--dtypes float32,bfloat16,8bit] [--steps 200]
        [--section.key=value ...]     # any other recipes.train flag, passed to every run

Writes moments_curve.{md,csv,png} and runs.jsonl (every run's metrics.jsonl rows, each with
its `run` and `moments_dtype`) into --out-dir, and each run's own metrics.jsonl and log under
runs/<run>/. A non-finite loss in any run (or a run that fails) exits non-zero once the report
is written.
"""

import json
import math
import re
import statistics
import sys
import sysconfig
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import get_args

from recipes.bench.kill import KILLED, run_captured
from recipes.bench.suite_runner import launch_env
from recipes.bpe import train_bpe
from slidedp.config import MomentsDtype
from recipes.reproduce.common import (HOST_RSS, REPO, TOKENS, Column, Runner, parser, start,
                                      write_outputs)

PAPER = ("SlideDP keeps FP32 Adam moments in host memory (8 of its 12 B/param of master and "
         "moments); no curve with narrower moments to set beside these.")

REFERENCE = "float32"
FINAL_STEPS = 10
"""The final loss is the mean of the last this many steps (one step's loss is noisy)."""
LAST_STEPS = 50
LEFT_OUT = {"test", "tests", "idle_test", "site-packages", "dist-packages", "encodings"}
"""Standard-library folders not taken: test suites, installed packages, generated codec tables."""

COLUMNS = [Column("run", "run"), Column("moments_dtype", "moments"), Column("steps", "steps"),
           Column("final_loss", f"final loss (mean of last {FINAL_STEPS})", "{:.4f}"),
           Column("final_rel_diff", "final loss vs FP32", "{:+.2%}"),
           Column("mean_abs_diff", "mean abs Δloss", "{:.4f}"),
           Column("mean_abs_diff_last", f"mean abs Δloss, last {LAST_STEPS}", "{:.4f}"),
           Column("max_abs_diff", "max abs Δloss", "{:.4f}"),
           Column("grad_norm_rel_diff", "mean abs Δgrad norm / FP32's", "{:.2%}"),
           Column("nonfinite_steps", "non-finite steps"),
           Column("skipped_updates", "skipped updates"), TOKENS,
           Column("host_bytes_per_param", "host B/param", "{:.1f}"), HOST_RSS,
           Column("redone", "speculative updates redone", "{:.0%}")]
SPECULATIVE = "+speculative"
"""A run's suffix for slidedp.speculative_update."""


def write_corpus(path: Path, *, max_mb: float) -> dict:
    """The standard library's modules as `text` records of a JSONL file, in sorted path order up
    to `max_mb` MB; what was taken."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in sorted(root.rglob("*.py"))
             if not LEFT_OUT & set(p.relative_to(root).parts)]
    taken = size = 0
    with path.open("w", encoding="utf-8") as f:
        for file in files:
            try:
                text = file.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):  # a few modules are in other encodings
                continue
            if not text.strip():
                continue
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            taken, size = taken + 1, size + len(text.encode())
            if size >= max_mb * 1e6:
                break
    return {"root": root, "files": taken, "mb": size / 1e6}


def train_tokenizer(corpus: Path, out_dir: Path, *, vocab: int) -> int:
    """A Qwen-style byte-level BPE of `vocab` tokens (its special tokens included) trained on the
    corpus, saved as out_dir/tokenizer.json (its <|endoftext|> is the data's default EOS);
    its size."""
    with corpus.open(encoding="utf-8") as f:
        tokenizer = train_bpe((json.loads(line)["text"] for line in f), vocab_size=vocab)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    return tokenizer.get_vocab_size()


def run_labels(dtypes: list[str]) -> list[str]:
    """One label per run: the dtype, `<dtype>-run<k>` for its k-th run."""
    seen: Counter[str] = Counter()
    labels = []
    for dtype in dtypes:
        seen[dtype] += 1
        labels.append(dtype if seen[dtype] == 1 else f"{dtype}-run{seen[dtype]}")
    return labels


def train(runner: Runner, data: Path, run: str, label: str,
          extra: list[str]) -> tuple[list[dict], float | None]:
    """One training run, `run` a moments dtype (with SPECULATIVE: speculative updates too), into
    runs/<label>/ (metrics.jsonl, train.log): its metrics rows (those written before a failure
    too) and the host state's bytes per parameter it reported."""
    a = runner.args
    dtype = run.removesuffix(SPECULATIVE)
    dump = runner.out_dir / "runs" / label
    flags = [f"--model.flavor={a.flavor}", f"--model.tokenizer_dir={data}",
             f"--model.kernels={a.kernels}", f"--training.steps={a.steps}",
             f"--training.seq_len={a.seq}", f"--training.local_batch_size={a.batch}",
             f"--training.max_norm={a.max_norm}", f"--training.seed={a.seed}",
             "--training.dataset=files", f"--training.dataset_path={data / 'corpus.jsonl'}",
             # Every step logged, none stops the run: the non-finite ones are counted here.
             "--training.nonfinite=skip", f"--optimizer.lr={a.lr}",
             f"--lr_scheduler.warmup_steps={a.lr_warmup}", "--lr_scheduler.decay_type=cosine",
             "--parallelism.mode=slidedp", f"--slidedp.moments_dtype={dtype}",
             # Every unit's update on the host, where moments_dtype applies.
             "--slidedp.embedding_update=host", "--slidedp.gpu_state_blocks=0",
             # No recompute: the fastest policy at these lengths; the numerics do not depend on it.
             "--slidedp.activation=keep",
             f"--slidedp.speculative_update={str(run.endswith(SPECULATIVE)).lower()}",
             f"--job.dump_folder={dump}", "--job.overwrite", "--checkpoint.save_dir=",
             "--metrics.enable_tensorboard=false", f"--metrics.log_freq={max(1, a.steps // 10)}",
             *extra]
    nproc = runner.nproc()
    cmd = ([sys.executable, "-m", "recipes.train"] if nproc == 1 else
           [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", "-m", "recipes.train"])
    runner.launches += 1
    print(f"[{runner.experiment}] {label}: {a.steps} steps with {dtype} moments", flush=True)
    began = time.perf_counter()
    rc, output = run_captured([*cmd, *flags], limit=a.timeout, cwd=REPO, env=launch_env(nproc))
    failed = rc != 0
    if rc in KILLED:
        output += f"\ntimed out after {a.timeout:.0f} s"
    dump.mkdir(parents=True, exist_ok=True)  # a run refused at start made none
    (dump / "train.log").write_text(output)
    metrics = dump / "metrics.jsonl"
    rows = ([json.loads(line) for line in metrics.read_text().splitlines()]
            if metrics.exists() else [])
    print(f"[{runner.experiment}]   {len(rows)} steps in {time.perf_counter() - began:.0f} s"
          + (" - FAILED:\n" + output[-3000:] if failed else ""), flush=True)
    runner.failures += failed
    host = re.search(r"\(([\d.]+) B/param", output)
    return rows, float(host.group(1)) if host else None


def final_loss(rows: list[dict]) -> float:
    return statistics.fmean(r["loss"] for r in rows[-FINAL_STEPS:]) if rows else math.nan


def summary(rows: list[dict], reference: list[dict], *, warmup: int) -> dict:
    """One run's row of the table: its final loss, its differences from the reference run's
    curve (over the steps both have), its non-finite steps, skipped updates and tokens/s (median
    over the steps after `warmup`)."""
    ref = {r["step"]: r for r in reference}
    common = [(r, ref[r["step"]]) for r in rows if r["step"] in ref]
    diffs = [abs(r["loss"] - f["loss"]) for r, f in common]
    final = final_loss(rows)
    timed = [r["tokens_per_s"] for r in rows[warmup:]] or [r["tokens_per_s"] for r in rows]
    out = {"steps": len(rows), "final_loss": final,
           "nonfinite_steps": sum(not (math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]))
                                  for r in rows),
           "skipped_updates": sum(bool(r["update_skipped"]) for r in rows),
           "tokens_per_s": statistics.median(timed) if timed else math.nan,
           "peak_rss_gib": rows[-1]["peak_rss_gib"] if rows else math.nan}
    redone = [r["speculative_redo"] for r in rows if "speculative_redo" in r]
    if redone:
        out["redone"] = statistics.fmean(redone)
    if rows is reference or not diffs:
        return out
    return {**out, "final_rel_diff": final / final_loss(reference) - 1,
            "mean_abs_diff": statistics.fmean(diffs),
            "mean_abs_diff_last": statistics.fmean(diffs[-LAST_STEPS:]), "max_abs_diff": max(diffs),
            "grad_norm_rel_diff": statistics.fmean(abs(r["grad_norm"] - f["grad_norm"])
                                                   / f["grad_norm"] for r, f in common)}


def plot(plt, curves: dict[str, list[dict]]):
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.4), layout="constrained")
    reference = {r["step"]: r["loss"] for r in curves[REFERENCE]}
    for label, curve in curves.items():
        ax.plot([r["step"] for r in curve], [r["loss"] for r in curve], label=label, lw=1)
        if label != REFERENCE:
            common = [r for r in curve if r["step"] in reference]
            bx.plot([r["step"] for r in common], [r["loss"] - reference[r["step"]] for r in common],
                    label=label, lw=1)
    ax.set(xlabel="step", ylabel="training loss", yscale="log")
    bx.set(xlabel="step", ylabel="loss - FP32 moments' loss")
    bx.axhline(0, color="black", lw=0.5)
    for axis in (ax, bx):
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:  # bx has none with float32 alone
            axis.legend(fontsize=8)
    return fig


def main() -> None:
    p = parser(__doc__, recorded=False)  # it trains through recipes.train, not the bench
    p.add_argument("--dtypes", default=f"{REFERENCE},bfloat16,8bit",
                   help="slidedp.moments_dtype values, one run each (float32 among them)")
    p.add_argument("--batch", type=int, help="sequences per step and rank")
    p.add_argument("--lr", type=float, help="peak learning rate")
    p.add_argument("--lr-warmup", type=int, help="warm-up steps of the learning rate")
    p.add_argument("--seed", type=int, default=0, help="model init and data order, every run")
    p.add_argument("--corpus-mb", type=float,
                   help="standard-library text taken, MB (default: all of it)")
    p.add_argument("--vocab", type=int, help="tokens of the trained tokenizer")
    args, extra = p.parse_known_args()
    unknown = [f for f in extra if not re.fullmatch(r"--\w+\.[\w-]+(=.*)?", f)]
    if unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)}")
    runner = start(args, "moments_curve",
                   gpu={"flavor": "qwen3-0.6B", "seq": 2048, "batch": 4, "steps": 200,
                        "warmup": 5, "lr": 3e-4, "lr_warmup": 20, "corpus_mb": math.inf,
                        "vocab": 32768},
                   tiny={"seq": 64, "batch": 4, "steps": 20, "warmup": 2, "lr": 3e-3,
                         "lr_warmup": 3, "corpus_mb": 0.3, "vocab": 512})
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    moments = get_args(MomentsDtype)
    bad = [d for d in dtypes if d.removesuffix(SPECULATIVE) not in moments]
    if bad:
        p.error(f"--dtypes: {', '.join(bad)}: each is one of {', '.join(moments)}, optionally "
                f"with {SPECULATIVE}")
    if REFERENCE not in dtypes:
        p.error(f"--dtypes: {REFERENCE} is the reference every curve is compared with")
    labels = run_labels(dtypes)
    runner.jsonl.write_text("")
    curves: dict[str, list[dict]] = {}
    host_bytes: dict[str, float | None] = {}
    with tempfile.TemporaryDirectory(prefix="moments_curve_") as tmp:
        data = Path(tmp)  # not kept: tens of MB that any machine rebuilds in seconds
        corpus = write_corpus(data / "corpus.jsonl", max_mb=args.corpus_mb)
        vocab = train_tokenizer(data / "corpus.jsonl", data, vocab=args.vocab)
        print(f"[moments_curve] corpus: {corpus['files']} modules, {corpus['mb']:.1f} MB from "
              f"{corpus['root']}; tokenizer: {vocab} tokens", flush=True)
        for dtype, label in zip(dtypes, labels):
            curves[label], host_bytes[label] = train(runner, data, dtype, label, extra)
            with runner.jsonl.open("a") as f:
                f.writelines(json.dumps({"run": label, "moments_dtype": dtype.removesuffix(SPECULATIVE),
                                         **r}) + "\n"
                             for r in curves[label])
    rows = [{"run": label, "moments_dtype": dtype.removesuffix(SPECULATIVE),
             "host_bytes_per_param": host_bytes[label],
             **summary(curves[label], curves[REFERENCE], warmup=args.warmup)}
            for dtype, label in zip(dtypes, labels)]
    notes = (f"Every run: {args.flavor} from random initialisation (seed {args.seed}; no "
             f"pretrained weights can reach the GPU machine), SlideDP on {runner.nproc()} "
             f"rank(s) with every update on the host, {args.batch} x {args.seq} tokens per step "
             f"and rank, {args.steps} steps, AdamW lr {args.lr:g} ({args.lr_warmup} warm-up "
             f"steps, cosine to 0.1 x), clipping {args.max_norm}"
             + (f", {' '.join(extra)}" if extra else "") + ". Data: the Python "
             f"{sys.version.split()[0]} standard library ({corpus['files']} modules, "
             f"{corpus['mb']:.1f} MB, one document per module), tokenized by a {vocab}-token "
             f"byte-level BPE trained on it. Δ is each step's loss minus the {REFERENCE} run's "
             f"at the same step; a `{REFERENCE}-run2` row (where run) is the same run again, the "
             f"drift between identical runs. Tokens/s is the median after {args.warmup} steps. "
             "Per-step rows: runs.jsonl, runs/<run>/metrics.jsonl.")
    write_outputs(runner, rows, COLUMNS, title="Loss curves against the Adam moments' dtype",
                  paper=PAPER, plot=lambda plt, _: plot(plt, curves), notes=notes)
    nonfinite = [r["run"] for r in rows if r["nonfinite_steps"]]
    if nonfinite or runner.failures:
        raise SystemExit(f"error: {runner.failures} of {runner.launches} runs failed; "
                         f"non-finite steps in: {', '.join(nonfinite) or 'none'}")


if __name__ == "__main__":
    main()
