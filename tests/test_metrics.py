"""The logs a person reads: the progress line (step/total, percent, tokens/s, ETA), no GPU figures
on the CPU, a TensorBoard run folder per run, and metrics.jsonl / TensorBoard without duplicate
steps when a run resumes."""

import json
import os

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from recipes.metrics import (MetricsLogger, Progress, format_duration, format_line,
                             keep_rows_through, peak_bf16_tflops, throughput)

CPU_STEP = {"loss": 2.5, "lr": 1e-4, "grad_norm": 0.75, "peak_mem_alloc_gib": None,
            "peak_mem_reserved_gib": None, "peak_rss_gib": 0.5, "step_time_s": 2.0}


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (41.6, "42s"), (725, "12m05s"),
                                           (3 * 3600 + 7 * 60 + 20, "3h07m"),
                                           (2 * 86400 + 4 * 3600 + 59, "2d04h")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def test_eta_is_the_mean_step_time_since_the_first_step_times_the_steps_left():
    clock = FakeClock()
    progress = Progress(150, clock=clock)
    # A resumed run's first step is 41; until a second step ends, its own time stands in.
    assert progress.eta_s(41, step_time=5.0) == 5.0 * 109
    clock.now += 1.0
    assert progress.eta_s(42, step_time=1.0) == 1.0 * 108
    clock.now += 5.0  # steps 43..46 (a save in between) took 5 s: 6 s over 5 steps since 41
    assert progress.eta_s(46, step_time=1.0) == pytest.approx(6.0 / 5 * 104)
    clock.now += 10.0
    assert progress.eta_s(150, step_time=1.0) == 0.0


def test_progress_line():
    m = {**CPU_STEP, **throughput(global_tokens=1024, step_time=2.0, flops_per_token=1e6,
                                  world=1, gpu=None)}
    line = format_line(7, m, total_steps=150, eta_s=286)
    fields = line.split(" | ")
    assert fields[0] == "step   7/150   4.7%"
    assert "512 tok/s" in fields and "eta 4m46s" == fields[-1]
    assert "loss 2.5000" in fields and "2.000 s/step" in fields


def test_cpu_has_no_gpu_figures_cuda_has_them():
    cpu = throughput(global_tokens=1000, step_time=0.5, flops_per_token=6e9, world=2, gpu=None)
    assert cpu == {"tokens_per_s": 2000.0}
    line = format_line(1, {**CPU_STEP, **cpu}, total_steps=10, eta_s=9)
    assert "TFLOP" not in line and "mfu" not in line
    cuda = throughput(global_tokens=1000, step_time=0.5, flops_per_token=6e9, world=2,
                      gpu="NVIDIA H200")
    assert cuda["tflops_per_gpu"] == pytest.approx(6e9 * 2000 / 2 / 1e12)
    assert cuda["peak_bf16_tflops"] == 989.0
    assert cuda["mfu"] == pytest.approx(cuda["tflops_per_gpu"] / 989.0)
    line = format_line(1, {**CPU_STEP, **cuda}, total_steps=10, eta_s=9)
    assert "6 TFLOP/s/gpu" in line.split(" | ") and "mfu 0.6%" in line


def test_mfu_is_against_the_datasheet_peak_and_unknown_without_one():
    """Each device's dense BF16 datasheet figure by the name torch gives it; a GPU not in the
    table gets no MFU, and the progress line says why."""
    assert {name: peak_bf16_tflops(name) for name in (
        "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H200", "NVIDIA H200 NVL",
        "NVIDIA A800-SXM4-80GB", "NVIDIA A100-SXM4-80GB", "NVIDIA GeForce RTX 4090",
        "NVIDIA L40S")} == {
        "NVIDIA H100 80GB HBM3": 989.0, "NVIDIA H100 PCIe": 756.0, "NVIDIA H200": 989.0,
        "NVIDIA H200 NVL": 835.0, "NVIDIA A800-SXM4-80GB": 312.0,
        "NVIDIA A100-SXM4-80GB": 312.0, "NVIDIA GeForce RTX 4090": 165.0, "NVIDIA L40S": None}
    unknown = throughput(global_tokens=1000, step_time=0.5, flops_per_token=6e9, world=2,
                         gpu="NVIDIA L40S")
    assert unknown["tflops_per_gpu"] == pytest.approx(6.0)
    assert unknown["peak_bf16_tflops"] is None and unknown["mfu"] is None
    line = format_line(1, {**CPU_STEP, **unknown}, total_steps=10, eta_s=9)
    assert "mfu unknown (no datasheet BF16 peak for this GPU)" in line.split(" | ")


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_keep_rows_through_drops_later_steps_duplicates_and_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": float(s)} for s in (1, 2, 3, 4, 5)]
    rows.insert(3, {"step": 2, "loss": 20.0})  # logged twice: the later row is the history kept
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "lo')
    assert keep_rows_through(path, 3) == 4  # the first row of step 2, steps 4 and 5, the torn line
    assert _rows(path) == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 20.0},
                           {"step": 3, "loss": 3.0}]
    assert os.listdir(tmp_path) == ["metrics.jsonl"]  # no temporary file left
    assert keep_rows_through(tmp_path / "absent.jsonl", 3) == 0


def test_keep_rows_through_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    text = "".join(json.dumps({"step": s}) + "\n" for s in range(1, 6))
    path.write_text(text)

    def crash(src, dst):
        raise OSError("killed before the rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        keep_rows_through(path, 2)
    assert path.read_text() == text  # the old file, whole


def _log_steps(logger: MetricsLogger, steps, *, loss_offset: float = 0.0) -> None:
    for step in steps:
        logger.log(step, {**CPU_STEP, "loss": step + loss_offset, "tokens_per_s": 1.0})
    logger.close()


def _scalars(run_dir, tag="loss"):
    accumulator = EventAccumulator(str(run_dir))
    accumulator.Reload()
    return [(s.step, s.value) for s in accumulator.Scalars(tag)]


def _logger(folder, **kw) -> MetricsLogger:
    return MetricsLogger(str(folder), enabled=True, log_freq=2, total_steps=6, jsonl=True,
                         tensorboard=True, **kw)


def test_each_run_gets_its_own_tensorboard_folder(tmp_path):
    first = _logger(tmp_path, run_name="20261201-120000-single")
    _log_steps(first, range(1, 7))
    second = _logger(tmp_path, run_name="20261201-120000-single")  # started the same second
    _log_steps(second, range(1, 4), loss_offset=100.0)
    assert second.run_name == "20261201-120000-single-2"
    assert sorted(os.listdir(tmp_path / "tb")) == [first.run_name, second.run_name]
    assert _scalars(tmp_path / "tb" / first.run_name) == [(s, s) for s in range(1, 7)]
    assert _scalars(tmp_path / "tb" / second.run_name) == [(s, s + 100) for s in range(1, 4)]
    assert [r["step"] for r in _rows(tmp_path / "metrics.jsonl")] == [1, 2, 3]  # a fresh start


def test_a_resumed_run_continues_its_run_without_duplicate_steps(tmp_path):
    crashed = _logger(tmp_path, run_name="20261201-120000-slidedp")
    _log_steps(crashed, range(1, 6))  # logged steps 1..5; its last save was at step 3
    resumed = _logger(tmp_path, run_name=crashed.run_name, start_step=3)
    _log_steps(resumed, range(4, 7), loss_offset=100.0)
    assert os.listdir(tmp_path / "tb") == [crashed.run_name]
    expected = [(1, 1.0), (2, 2.0), (3, 3.0), (4, 104.0), (5, 105.0), (6, 106.0)]
    assert _scalars(tmp_path / "tb" / crashed.run_name) == expected
    assert [(r["step"], r["loss"]) for r in _rows(tmp_path / "metrics.jsonl")] == expected


def test_other_ranks_write_nothing(tmp_path):
    logger = MetricsLogger(str(tmp_path / "dump"), enabled=False, log_freq=1, total_steps=2,
                           jsonl=True, tensorboard=True, run_name="r")
    _log_steps(logger, [1, 2])
    assert not (tmp_path / "dump").exists()
