"""The benchmark helpers: per-stream GPU breakdown of a trace, the markdown report, and the
training record of each row (a row whose steps did not train is written invalid, fails the
bench and is refused by the report)."""

import gzip
import itertools
import json
import math
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch

from protocols.backend import StepResult
from recipes.bench import headline, throughput
from recipes.bench.rows import training
from recipes.bench.config import parse_bench_config, point_specs, points, routes
from recipes.bench.report import report
from recipes.bench.timeline import breakdown
from recipes.config import ConfigError, parse_config
from tests.conftest import REPO, free_port, subprocess_env

TRAINED = training([6.2, 6.1], [3.0, 2.9], [False, False])
"""The training record of a row whose two timed steps trained."""


def test_breakdown_attributes_compute_gaps(tmp_path):
    def ev(cat, name, stream, start_s, end_s):
        return {"ph": "X", "cat": cat, "name": name, "ts": start_s * 1e6, "dur": (end_s - start_s) * 1e6,
                "args": {"stream": stream}}

    # Compute stream 7 waits 0.5-0.7 s: first behind an H2D copy, then NCCL, then a D2H copy, then
    # nothing (the host); the step's 0.1 s outside the GPU span is the host's too.
    events = [ev("kernel", "sm90_gemm", 7, 0.0, 0.5), ev("kernel", "flash_fwd", 7, 0.7, 1.0),
              ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 21, 0.45, 0.56),
              ev("kernel", "ncclDevKernel_AllGather", 20, 0.55, 0.62),
              ev("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 22, 0.60, 0.65),
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 9_000_000, "tid": 1}]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    b = breakdown(str(path), step_time_s=1.1)
    assert b["gpu_compute_s"] == pytest.approx(0.8)
    assert b["gpu_nccl_s"] == pytest.approx(0.07)
    assert b["gpu_h2d_s"] == pytest.approx(0.11) and b["gpu_d2h_s"] == pytest.approx(0.05)
    assert b["compute_stream_busy_s"] == pytest.approx(0.8)
    assert b["compute_stream_idle_s"] == pytest.approx(0.3)
    assert b["exposed_h2d_s"] == pytest.approx(0.06)
    assert b["exposed_nccl_s"] == pytest.approx(0.06)
    assert b["exposed_d2h_s"] == pytest.approx(0.03)
    assert b["exposed_host_s"] == pytest.approx(0.15)


def test_report_ratios_per_model(tmp_path):
    base = {"label": "", "route": "-", "kernels": "torch", "world": 2, "seq": 4096,
            "keep_blocks": None, "mfu": 0.5, "tflops_per_gpu": 390.0, "peak_mem_alloc_gib": 50.0,
            "peak_mem_reserved_gib": 60.0, "peak_rss_gib": 1.0, "step_time_s": 1.0, **TRAINED}
    rows = [dict(base, mode="reference", flavor="qwen3-8B", ac="full", local_batch=16, tokens_per_s=1000.0),
            dict(base, mode="fsdp2", flavor="qwen3-8B", ac="full", local_batch=16, tokens_per_s=800.0),
            dict(base, mode="slidedp", flavor="qwen3-8B", ac="recompute", local_batch=16,
                 route="sharded/gpu", tokens_per_s=950.0),
            dict(base, mode="slidedp", flavor="qwen3-8B", ac="recompute", local_batch=16, accum=2,
                 label="clip", route="sharded/gpu", tokens_per_s=900.0),
            dict(base, mode="fsdp2", flavor="qwen3-14B", ac="full", local_batch=8, tokens_per_s=400.0),
            # Fused kernels are compared with the fused reference and FSDP2 only.
            dict(base, mode="reference", flavor="qwen3-8B", ac="full", local_batch=16,
                 kernels="liger", tokens_per_s=1300.0),
            dict(base, mode="slidedp", flavor="qwen3-8B", ac="recompute", local_batch=16,
                 kernels="liger", label="fused", route="sharded/gpu", tokens_per_s=1235.0)]
    path = tmp_path / "runs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = report([str(path)]).splitlines()
    slidedp = next(line for line in lines if "slidedp" in line)
    assert "95.0%" in slidedp and "1.188x" in slidedp  # vs reference (full), vs the 8B FSDP2 peak
    assert "1.000x" in next(line for line in lines if "qwen3-14B" in line)
    assert "| 16 (2x8) | 900 |" in next(line for line in lines if "clip" in line)
    fused = next(line for line in lines if "slidedp fused" in line)
    assert "| liger |" in fused and "95.0%" in fused and fused.endswith("| – |")


def test_point_specs_take_per_point_block_policies():
    specs = point_specs(["recompute:16,32", "selective|0-3:keep, 30-35:recompute@offload=0.5:24",
                         "segments(qkv+mlp_up):8"], blocks="0:keep")
    assert specs == [("recompute", "0:keep", [16, 32]),
                     ("selective", "0-3:keep, 30-35:recompute@offload=0.5", [24]),
                     ("segments(qkv+mlp_up)", "0:keep", [8])]


def test_the_bench_reads_the_trainers_config_with_its_own_bench_section(tmp_path):
    """A config file's [bench] and trainer sections, flags over them (the last wins), and the
    sweep's points in the order measured; the trainer's own parser refuses [bench]."""
    path = tmp_path / "bench.toml"
    path.write_text('[parallelism]\nmode = "slidedp"\n[model]\nflavor = "qwen3-debug"\n'
                    '[bench]\nbatches = [1, 2]\nupdate_orders = ["arrival", "next_use"]\n'
                    'label = "from-file"\n')
    config, args = parse_bench_config([f"--job.config_file={path}", "--bench.cpu_threads", "0",
                                       "4", "--bench.label=sweep", "--bench.batches", "4",
                                       "--bench.batches", "2", "8"])
    assert config.bench.label == "sweep" and config.bench.batches == [2, 8]
    assert config.training.seq_len == 4096  # the bench's default
    assert args.n_layers == 4
    assert [(p.batch, p.update_order, p.cpu_threads) for p in points(config)] == [
        (b, order, t) for b in (2, 8) for order in ("arrival", "next_use") for t in (0, 4)]
    assert routes(config) == ["sharded/gpu"]
    with pytest.raises(ConfigError, match=r"unknown section \[bench\]"):
        parse_config([f"--job.config_file={path}"])


@pytest.mark.parametrize("flags, error", [
    (["--bench.batches", "0"], "bench.batches[0] must be >= 1, got 0"),
    (["--bench.update_orders", "first"], "bench.update_orders[0] must be one of 'next_use', "
                                         "'arrival', got 'first'"),
    (["--bench.points", "keep"], "bench.points: 'keep': expected POLICY[|BLOCKS]:B1,B2,..."),
    (["--bench.reference", "--parallelism.mode=fsdp2"], 'parallelism.mode must stay "single"'),
    (["--parallelism.mode=deepspeed", "--bench.accum", "1", "2"],
     "bench.accum: deepspeed takes one"),
    (["--batches", "4"], "unexpected argument '--batches' (flags are --section.key=value)"),
])
def test_a_bad_bench_setting_is_one_error_line_and_exit_2_before_any_work(tmp_path, flags, error):
    proc = subprocess.run([sys.executable, "-m", "recipes.bench.throughput", *flags,
                           f"--bench.out={tmp_path / 'runs.jsonl'}"],
                          cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and error in proc.stderr, proc.stderr
    assert proc.stderr.startswith("error: ") and not (tmp_path / "runs.jsonl").exists()


TINY = ["--model.kernels=torch", "--model.flavor=qwen3-debug", "--training.seq_len=32",
        "--training.max_norm=1.0", "--bench.warmup=0", "--slidedp.check_host_memory=false"]
"""The bench on the CPU debug model, one rank."""


def _bench(flags: list[str], out) -> list[dict]:
    """One launch of the bench on one rank (env:// by hand) with `flags`; the rows it wrote."""
    env = dict(subprocess_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
               WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    proc = subprocess.run([sys.executable, "-m", "recipes.bench.throughput", *TINY, *flags,
                           f"--bench.out={out}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_trace_dir_is_made_and_each_point_gets_its_own_trace(tmp_path):
    """bench.trace_dir that does not exist yet: the bench makes it, and two points at the same
    batch each write their own profiled step (and report its time in their row)."""
    traces = tmp_path / "new" / "traces"
    rows = _bench(["--parallelism.mode=slidedp", "--training.steps=1", "--bench.points",
                   "selective:2", "selective|0-1:keep:2", f"--bench.trace_dir={traces}",
                   "--bench.trace_batch=2"],
                  tmp_path / "runs.jsonl")
    assert sorted(p.name for p in traces.iterdir()) == [
        "slidedp_sharded-gpu_p0_b2x1.json.gz", "slidedp_sharded-gpu_p1_b2x1.json.gz"]
    assert [r["activation_blocks"] for r in rows] == ["", "0-1:keep"]
    assert all(r["traced_step_s"] > 0 for r in rows)
    assert all(len(r["loss"]) == 1 for r in rows)  # the traced step is not a timed one


@pytest.mark.parametrize("sync, expected", [("window", 0.01), ("step", 0.04)])
def test_a_step_is_timed_from_its_start_to_the_next_ones_unless_each_step_waits(
        monkeypatch, sync, expected):
    """A fake GPU: each step returns after 10 ms of host work and leaves 30 ms queued on the
    device that the next step does not wait for (SlideDP's clipped GPU updates overlap the next
    forward). `window`: a step is timed from its start to the next one's, as the training loop
    runs them, and only the window's end waits for the device: 10 ms. `step`: each step waits
    for its queued work: 40 ms."""
    queued_until = [0.0]

    def synchronize():
        time.sleep(max(0.0, queued_until[0] - time.perf_counter()))

    def step(data):
        time.sleep(0.01)
        queued_until[0] = time.perf_counter() + 0.03
        return StepResult(loss_sum=1.0, grad_norm=1.0)

    monkeypatch.setattr(throughput.torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(throughput.torch.cuda, "reset_peak_memory_stats", lambda device: None)
    cfg, args = parse_bench_config(["--model.flavor=qwen3-debug", "--training.seq_len=16",
                                    "--training.steps=5", f"--bench.sync={sync}"])
    measured = throughput._measure(cfg, step, args=args, batch=1, name="fake", rank=0, world=1,
                                   device=torch.device("cuda"))
    assert measured["step_time_s"] == pytest.approx(expected, abs=0.006)


@pytest.mark.parametrize("mode", ["slidedp", "fsdp2", "reference"])
def test_each_row_records_what_its_timed_steps_trained(mode, tmp_path):
    """Every mode's row: per timed step a finite loss near ln(vocab) (random weights), a finite
    gradient norm and no skipped update, so the row is valid and the report reads it; and the
    machine it ran on."""
    out = tmp_path / "runs.jsonl"
    flags = ["--bench.reference"] if mode == "reference" else [f"--parallelism.mode={mode}"]
    rows = _bench([*flags, "--bench.batches", "1", "2", "--training.steps=2"], out)
    assert len(rows) == 2
    for r in rows:
        assert len(r["loss"]) == len(r["grad_norm"]) == len(r["skipped"]) == 2
        assert all(abs(loss - math.log(2048)) < 1.5 for loss in r["loss"]), r["loss"]
        assert all(math.isfinite(g) and g > 0 for g in r["grad_norm"]), r["grad_norm"]
        assert r["skipped"] == [False, False]
        assert r["valid"] is True and r["invalid_reason"] is None
        # What it ran on: no GPU here, this host's CPU and the cores the process may use.
        assert r["gpu"] is None and r["host_cpu"] and r["host_cores"] >= 1
        assert r["cuda_alloc_conf"] == subprocess_env().get("PYTORCH_CUDA_ALLOC_CONF")
    assert report([str(out)]).count(f"| {mode} |") == 2


def _poison_step(monkeypatch, call: int, **fault) -> None:
    """The bench's backends return `fault` (StepResult fields) from their `call`-th step."""
    build = throughput.build_backend

    def poisoned_build(*args, **kwargs):
        backend = build(*args, **kwargs)
        train_step, calls = backend.train_step, itertools.count(1)

        def train_step_with_fault(*a, **kw):
            result = train_step(*a, **kw)
            return replace(result, **fault) if next(calls) == call else result

        backend.train_step = train_step_with_fault
        return backend

    monkeypatch.setattr(throughput, "build_backend", poisoned_build)


@pytest.mark.parametrize("fault, reason", [
    ({"loss_sum": float("nan")}, "timed step 1: loss nan, gradient norm"),
    ({"skipped": True}, "timed step 1: update skipped")])
def test_a_row_whose_step_did_not_train_is_written_invalid_and_fails_the_bench(
        monkeypatch, tmp_path, fault, reason):
    """SlideDP at 1 and 2 sequences (one warm-up step each, then 2 timed ones) with the first
    point's first timed step faulty: both rows are written, the first marked invalid with the
    reason, and the bench exits non-zero after the last; the report refuses the file."""
    _poison_step(monkeypatch, call=2, **fault)
    out = tmp_path / "runs.jsonl"
    monkeypatch.setattr(sys, "argv", ["throughput", "--parallelism.mode=slidedp", *TINY,
                                      "--bench.batches", "1", "2", "--training.steps=2",
                                      f"--bench.out={out}"])
    with pytest.raises(SystemExit) as failed:
        throughput.main()
    assert failed.value.code not in (None, 0)
    assert "1 of 2 rows invalid" in str(failed.value) and reason in str(failed.value)
    first, second = [json.loads(line) for line in out.read_text().splitlines()]
    assert first["valid"] is False and first["invalid_reason"].startswith(reason)
    assert second["valid"] is True and second["skipped"] == [False, False]
    if "loss_sum" in fault:
        assert math.isnan(first["loss"][0]) and math.isfinite(first["loss"][1])
    with pytest.raises(SystemExit, match=f"{out}: 1 of 2 rows refused"):
        report([str(out)])


@pytest.mark.parametrize("row, why", [
    ({"grad_norm": [3.0, float("inf")]}, "invalid: timed step 2: loss 6.1, gradient norm inf"),
    ({"skipped": [True, False]}, "invalid: timed step 1: update skipped"),
    ({"loss": None}, "lacks loss"),
    ({"loss": None, "grad_norm": None, "skipped": None, "valid": None},
     "lacks loss, grad_norm, skipped, valid")])
def test_report_refuses_rows_that_did_not_train_or_do_not_say(tmp_path, row, why):
    """--report: one row whose steps did not train, or one without the training record (rows
    from before it existed), and the whole file is refused, naming it and the row."""
    good = {"mode": "slidedp", "label": "", "flavor": "qwen3-8B", "route": "sharded/gpu",
            "kernels": "torch", "ac": "recompute", "world": 1, "seq": 4096, "local_batch": 4,
            "accum": 1, "tokens_per_s": 900.0, "peak_rss_gib": 1.0, **TRAINED}
    bad = {k: v for k, v in {**good, "local_batch": 8, **row}.items() if v is not None}
    path = tmp_path / "runs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (good, bad)))
    with pytest.raises(SystemExit) as refused:
        report([str(path)])
    message = str(refused.value)
    assert f"{path}: 1 of 2 rows refused" in message
    assert ("line 2 (mode=slidedp, label=, flavor=qwen3-8B, route=sharded/gpu, ac=recompute, "
            f"world=1, seq=4096, local_batch=8, accum=1): {why}") in message
    assert "line 1" not in message


def test_headline_is_the_median_of_launches_and_refuses_rows_that_did_not_train(tmp_path, capsys,
                                                                              monkeypatch):
    """Three launches of one FSDP2 point and one of another (rows as the bench writes them:
    tests above launch it): the headline table gives each point its launch count, median and
    min-max, a second file's launch 1 counting as another launch; best_point names the fastest point's flags; a row of a step that did not train
    refuses the file."""
    def row(batch: int, launch: int, tokens_per_s: float) -> dict:
        return {"mode": "fsdp2", "label": "sweep", "flavor": "qwen3-debug", "route": "-",
                "kernels": "torch", "ac": "none", "activation_blocks": None, "world": 1,
                "seq": 32, "local_batch": batch, "accum": 1, "max_norm": 1.0, "launch": launch,
                "tokens_per_s": tokens_per_s, "mfu": None,
                **training([6.2], [1.5], [False])}

    rows = [row(1, 1, 900.0), row(2, 1, 1500.0), row(2, 2, 1100.0), row(2, 3, 1300.0)]
    out = tmp_path / "runs.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = {line.split(" | ")[5]: line for line in headline.table(rows).splitlines()[2:]}
    assert "| 3 | 1,300 | 1,100-1,500 |" in lines["2"] and "| 1 | 900 | 900-900 |" in lines["1"]
    assert headline.best_point(str(out), mode="fsdp2", label="sweep") == (
        "--activation_checkpoint.mode=none --bench.batches 2")
    second = tmp_path / "call2_runs.jsonl"  # another call of the start: its own launch 1
    second.write_text(json.dumps(row(1, 1, 700.0)) + "\n")
    monkeypatch.setattr(sys, "argv", ["headline", str(out), str(second)])
    headline.main()
    printed = capsys.readouterr().out
    assert "| 2 | 800 | 700-900 |" in printed and "| 3 | 1,300 | 1,100-1,500 |" in printed
    # A launch on another host is another point, named by its machine.
    elsewhere = {**row(1, 1, 2000.0), "gpu": "NVIDIA H200", "host_cpu": "Xeon"}
    lines = headline.table([*rows, elsewhere]).splitlines()[2:]
    assert len(lines) == 3 and lines[-1].endswith("| 1 | 2,000 | 2,000-2,000 |  | NVIDIA H200 / Xeon |")
    rows[-1]["loss"] = [float("nan")]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(SystemExit, match="1 of 4 rows refused"):
        headline.best_point(str(out), mode="fsdp2", label="sweep")


def test_the_stream_bench_times_the_update_in_both_layouts():
    """recipes.bench.stream's row: the pool's triad, the update with its output apart from the
    gradient, in the runtime's layout (the gradient in the shadow) and on a memfd and on huge-page
    hinted memory, each against the triad; the memory the last two run on holds the update."""
    from recipes.bench.cpu_adam import Workload
    from recipes.bench.stream import BACKINGS, HUGE, backed_arrays, backed_update_seconds, describe, measure

    row = measure(1, elements=50_000, repeats=2, openmp=False, work=Workload(40_000))
    for key in ("pool_best_gbs", "adam_best_gbs", "adam_in_shadow_best_gbs", "adam_memfd_best_gbs",
                "adam_thp_best_gbs", "adam_pinned_best_gbs"):
        assert row[key] > 0, key
    assert row["adam_over_triad"] == pytest.approx(row["adam_best_gbs"] / row["pool_best_gbs"])
    assert row["adam_in_shadow_over_triad"] == pytest.approx(row["adam_in_shadow_best_gbs"] / row["pool_best_gbs"])
    assert "gradient in the shadow" in describe(row) and "on thp" in describe(row)
    assert all(0 <= row[f"adam_{b}_huge_page_share"] <= 1.01 for b in BACKINGS)
    for backing in BACKINGS:
        arrays = backed_arrays(3000, backing)
        for name, t in arrays.items():
            assert t.numel() == 3000 and t.data_ptr() % HUGE == arrays["param"].data_ptr() % HUGE, name
        backed_update_seconds(arrays, threads=1, repeats=1)
        want = arrays["param"].to(torch.bfloat16)
        assert torch.equal(arrays["bf16_out"], want) and not torch.equal(arrays["exp_avg"], torch.zeros(3000))
