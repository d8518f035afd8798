"""Each experiment script of recipes/reproduce/ end to end on the CPU (--tiny: qwen3-debug,
short sequences, a point or two per system): its CSV has the script's columns and a row per
point, its markdown has the table and the paper's figure, its PNG exists; each script that
reads bench rows refuses rows whose steps did not train; and the head-to-head and scaling
arithmetic on known rows."""

import contextlib
import csv
import importlib
import io
import json
import sys
from pathlib import Path
from unittest import mock

import pytest

from recipes.bench.rows import training
from recipes.reproduce import batch_sweep, head_to_head, scaling
from recipes.reproduce.common import geomean

# script -> (extra flags, points its CSV must hold)
SCRIPTS = {
    "batch_sweep": (["--systems", "slidedp-recompute,reference-full"], 4),
    # SlideDP against both peer styles on 2 ranks at one batch: 2 peers x (1 batch + geomean).
    # tests/test_peer_styles.py runs it (check_end_to_end) and checks the styles' rows too.
    "head_to_head": (["--nproc", "2", "--batches", "1", "--systems",
                      "slidedp-recompute,slideformer-recompute,megatrain-recompute"], 4),
    "routes": (["--routes", "sharded/gpu,replicated/cpu"], 2),
    "scaling": ([], 4),  # strong and weak on 1 and 2 ranks
    "chunk_sweep": ([], 2),
    "cpu_adam_scaling": ([], 2),
    "long_context": ([], 2),
    "activation_policy": (["--policies", "recompute,keep", "--batches", "1"], 2),
}


@pytest.mark.parametrize("name", [n for n in SCRIPTS if n != "head_to_head"])
def test_script_end_to_end(name, tmp_path):
    check_end_to_end(name, tmp_path)


def run_script(name: str, *argv: str) -> str:
    """`python -m recipes.reproduce.NAME ARGV` in this process (the script launches its runs
    itself: a process of its own would only import torch once more); what it printed."""
    stdout = io.StringIO()
    with mock.patch.object(sys, "argv", [name, *argv]), contextlib.redirect_stdout(stdout):
        importlib.import_module(f"recipes.reproduce.{name}").main()
    return stdout.getvalue()


def check_end_to_end(name: str, tmp_path) -> Path:
    """`name` run as SCRIPTS says, its outputs checked; the bench rows it recorded."""
    flags, points = SCRIPTS[name]
    said = run_script(name, "--tiny", "--out-dir", str(tmp_path), *flags)
    assert "FAILED" not in said, said[-3000:]
    module = __import__(f"recipes.reproduce.{name}", fromlist=["COLUMNS"])
    with open(tmp_path / f"{name}.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == [c.key for c in module.COLUMNS]
    assert len(rows) == points
    md = (tmp_path / f"{name}.md").read_text()
    header = "| " + " | ".join(c.header for c in module.COLUMNS) + " |"
    assert header in md and md.count("\n| ") == points + 1  # header + one line per point
    assert f"**Paper:** {module.PAPER}" in md
    png = (tmp_path / f"{name}.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 5000
    if name != "cpu_adam_scaling":  # it times the CPU itself: no bench rows to read back
        return _same_from_recorded_rows(name, flags, tmp_path)
    return tmp_path / "runs.jsonl"


def _same_from_recorded_rows(name: str, flags: list[str], run_dir) -> Path:
    """--rows makes the same table from the rows the run recorded, launching nothing; the rows'
    file."""
    recorded, again = run_dir / "recorded.jsonl", run_dir / "again"
    (run_dir / "runs.jsonl").rename(recorded)
    said = run_script(name, "--tiny", "--out-dir", str(again), "--rows", str(recorded), *flags)
    assert " x1: " not in said and " x2: " not in said  # no launch line
    assert (again / f"{name}.csv").read_text() == (run_dir / f"{name}.csv").read_text()
    assert "Rows recorded before" in (again / f"{name}.md").read_text()
    return recorded


@pytest.mark.parametrize("name", [n for n in SCRIPTS if n != "cpu_adam_scaling"])
@pytest.mark.parametrize("fault, why", [({"loss": [float("nan")]}, "invalid: timed step 1: loss nan"),
                                        ({"valid": None}, "lacks valid")])
def test_recorded_rows_that_did_not_train_are_refused(monkeypatch, tmp_path, name, fault, why):
    """--rows with a file holding one row whose step did not train (or that does not say, as
    rows from before the record): the script stops with an error naming the file and the row,
    and writes no table."""
    row = {"mode": "slidedp", "label": "slidedp-recompute", "flavor": "qwen3-debug",
           "route": "sharded/gpu", "ac": "recompute", "world": 1, "seq": 64, "local_batch": 1,
           "accum": 1, "tokens_per_s": 100.0, "step_time_s": 0.64,
           **training([6.9], [3.0], [False])}
    bad = {k: v for k, v in {**row, **fault}.items() if v is not None}
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps(row) + "\n" + json.dumps(bad) + "\n")
    monkeypatch.setattr(sys, "argv", [name, "--tiny", "--rows", str(rows), "--out-dir",
                                      str(tmp_path / "out"), *SCRIPTS[name][0]])
    with pytest.raises(SystemExit) as refused:
        importlib.import_module(f"recipes.reproduce.{name}").main()
    message = str(refused.value)
    assert message.startswith(f"error: {rows}: 1 of 2 rows refused")
    assert ("line 2 (mode=slidedp, label=slidedp-recompute, flavor=qwen3-debug, "
            f"route=sharded/gpu, ac=recompute, world=1, seq=64, local_batch=1, accum=1): {why}"
            ) in message
    assert not (tmp_path / "out" / f"{name}.md").exists()


@pytest.mark.filterwarnings("ignore:No artists with labels")  # the plot of no rows
@pytest.mark.parametrize("warmup, expected", [([], [1, 0]), (["--warmup", "2"], [2, 2])])
def test_long_context_warms_up_only_the_short_lengths(monkeypatch, tmp_path, warmup, expected):
    """Without --warmup, a length below WARM_BELOW gets one warm-up step and a longer one none;
    an explicit --warmup holds for every length (launching nothing: each launch's setting is
    recorded instead)."""
    from recipes.reproduce import common, long_context

    seen = []

    def bench(self, flags, *, nproc, label="", common=True):
        seq = next(f for f in flags if f.startswith("--training.seq_len="))
        seen.append((int(seq.partition("=")[2]), self.args.warmup))
        return []

    monkeypatch.setattr(common.Runner, "bench", bench)
    rows = tmp_path / "none.jsonl"
    rows.write_text("")
    short, long = long_context.WARM_BELOW // 2, long_context.WARM_BELOW
    monkeypatch.setattr(sys, "argv", ["long_context", "--seqs", f"{short},{long}", "--rows",
                                      str(rows), "--out-dir", str(tmp_path), *warmup])
    long_context.main()
    assert seen == list(zip((short, long), expected))


def test_head_to_head_ratios_and_geometric_mean():
    rows = [{"system": s, "family": f, "local_batch": b, "tokens_per_s": t} for s, f, b, t in [
        ("slidedp-recompute", "slidedp", 4, 1000.0), ("slidedp-keep", "slidedp", 4, 1200.0),
        ("slidedp-recompute", "slidedp", 16, 1500.0),
        ("zero2-offload", "zero-offload", 4, 400.0), ("zero2-offload-noac", "zero-offload", 4, 600.0),
        ("zero2-offload", "zero-offload", 16, 1000.0), ("fsdp2-full", "fsdp2", 8, 900.0)]]
    out = head_to_head.matched(rows)
    at4 = next(r for r in out if r["local_batch"] == 4)
    # Each side's best setting at that batch.
    assert (at4["slidedp_system"], at4["peer_system"], at4["ratio"]) == ("slidedp-keep", "zero2-offload-noac", 2.0)
    mean = next(r for r in out if r["local_batch"] == "geomean")
    assert mean["ratio"] == pytest.approx(geomean([2.0, 1.5])) == pytest.approx(3 ** 0.5)
    assert not any(r["peer"] == "fsdp2" for r in out)  # no SlideDP point at batch 8


def test_every_offloading_peer_has_a_no_checkpointing_option_in_its_family():
    """A peer's peak is its best over its options (docs/PERFORMANCE.md rule 5): each offloading
    peer runs with full checkpointing and without, under one family, so the head-to-head takes
    the faster at each batch."""
    from recipes.reproduce.common import SYSTEMS
    for name in ("fsdp2-offload", "zero2-offload", "zero3-offload"):
        full, none = SYSTEMS[name], SYSTEMS[f"{name}-noac"]
        assert full.family == none.family != "slidedp"
        assert "--activation_checkpoint.mode=full" in full.flags
        assert "--activation_checkpoint.mode=none" in none.flags
        assert set(full.flags) - {"--activation_checkpoint.mode=full"} == \
            set(none.flags) - {"--activation_checkpoint.mode=none"}


def test_head_to_head_sets_median_launches_against_each_other():
    """Three launches of SlideDP's setting against one of the peer's: SlideDP counts as its median
    launch, not its best (docs/PERFORMANCE.md rule 6), and each side says how many it ran and
    their min–max (rule 3)."""
    rows = [{"system": s, "family": f, "local_batch": 2, "tokens_per_s": t} for s, f, t in [
        ("slidedp-keep", "slidedp", 900.0), ("slidedp-keep", "slidedp", 1500.0),
        ("slidedp-keep", "slidedp", 1000.0), ("zero2-offload", "zero-offload", 500.0)]]
    at2 = head_to_head.matched(rows)[0]
    assert (at2["ratio"], at2["slidedp_launches"], at2["peer_launches"]) == (2.0, 3, 1)
    assert (at2["slidedp_range"], at2["peer_range"]) == ("900–1,500", "500–500")


def test_batch_sweep_plots_one_point_per_batch():
    """Rows of several launches at the same batches plot as one line: the median launch at each
    batch (tokens/s the mean of the middle two of an even count, as the headline's median)."""
    rows = [{"system": "s", "local_batch": b, "tokens_per_s": t, "step_time_s": 100 * b / t}
            for b, t in [(4, 10.0), (8, 30.0), (4, 12.0), (8, 20.0), (1, 5.0), (8, 25.0)]]
    rows.append({"system": "other", "local_batch": 4, "tokens_per_s": 99.0})
    picked = batch_sweep.lines(rows)
    assert [(r["local_batch"], r["tokens_per_s"]) for r in picked["s"]] == [(1, 5.0), (4, 11.0), (8, 25.0)]
    assert picked["s"][1]["step_time_s"] == pytest.approx((40.0 + 400 / 12) / 2)  # a median too
    assert [(r["min"], r["max"], r["launches"]) for r in picked["s"]] == [(5.0, 5.0, 1), (10.0, 12.0, 2), (20.0, 30.0, 3)]
    assert [r["tokens_per_s"] for r in picked["other"]] == [99.0]


def test_scaling_efficiency():
    rows = [{"scaling": "strong", "system": "s", "world": 1, "step_time_s": 8.0, "tokens_per_s": 1.0},
            {"scaling": "strong", "system": "s", "world": 4, "step_time_s": 2.5, "tokens_per_s": 3.2},
            {"scaling": "weak", "system": "s", "world": 2, "step_time_s": 1.0, "tokens_per_s": 200.0},
            {"scaling": "weak", "system": "s", "world": 8, "step_time_s": 1.0, "tokens_per_s": 760.0}]
    eff = [r["efficiency"] for r in scaling.with_efficiency(rows)]
    assert eff == pytest.approx([1.0, 0.8, 1.0, 0.95])


def test_recorded_rows_are_those_of_the_named_batches():
    """--rows takes a launch's rows at the batches its flags name, from bench.batches (the last
    given) or from the batch list ending each bench.points entry (one file may hold a policy's
    rows at other batches)."""
    from recipes.reproduce.common import _named_batches

    assert _named_batches(["--parallelism.mode=slidedp", "--bench.batches", "1", "4"]) == {1, 4}
    assert _named_batches(["--bench.batches", "2", "--bench.batches=8"]) == {8}
    assert _named_batches(["--bench.points", "keep:4,16", "recompute:8", "--bench.label=x"]) == {
        4, 8, 16}
    assert _named_batches(["--bench.points", "selective|0-13:keep:16"]) == {16}
    assert _named_batches(["--parallelism.mode=slidedp"]) is None
