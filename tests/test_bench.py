"""The benchmark helpers: per-stream GPU breakdown of a trace, and the markdown report."""

import json

import pytest

from recipes.bench.throughput import report
from recipes.bench.timeline import breakdown


def test_breakdown_sums_streams_by_kind(tmp_path):
    def ev(cat, name, stream, dur_us):
        return {"ph": "X", "cat": cat, "name": name, "dur": dur_us, "args": {"stream": stream}}

    events = [ev("kernel", "sm90_gemm", 7, 500_000), ev("kernel", "flash_fwd", 7, 300_000),
              ev("kernel", "ncclDevKernel_AllGather", 20, 40_000),
              ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 21, 60_000),
              ev("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 22, 30_000),
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 9_000_000, "tid": 1}]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    b = breakdown(str(path), step_time_s=1.0)
    assert b["gpu_compute_s"] == pytest.approx(0.8)
    assert b["gpu_nccl_s"] == pytest.approx(0.04)
    assert b["gpu_h2d_s"] == pytest.approx(0.06) and b["gpu_d2h_s"] == pytest.approx(0.03)
    assert b["compute_stream_busy_s"] == pytest.approx(0.8)
    assert b["compute_stream_idle_s"] == pytest.approx(0.2)


def test_report_ratios_per_model(tmp_path):
    base = {"label": "", "route": "-", "world": 2, "seq": 4096, "keep_blocks": None, "mfu": 0.5,
            "tflops_per_gpu": 390.0, "peak_mem_alloc_gib": 50.0, "peak_mem_reserved_gib": 60.0,
            "peak_rss_gib": 1.0, "step_time_s": 1.0}
    rows = [dict(base, mode="reference", flavor="qwen3-8B", ac="full", local_batch=16, tokens_per_s=1000.0),
            dict(base, mode="fsdp2", flavor="qwen3-8B", ac="full", local_batch=16, tokens_per_s=800.0),
            dict(base, mode="slidedp", flavor="qwen3-8B", ac="recompute", local_batch=16,
                 route="sharded/gpu", tokens_per_s=950.0),
            dict(base, mode="fsdp2", flavor="qwen3-14B", ac="full", local_batch=8, tokens_per_s=400.0)]
    path = tmp_path / "runs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = report([str(path)]).splitlines()
    slidedp = next(line for line in lines if "slidedp" in line)
    assert "95.0%" in slidedp and "1.188x" in slidedp  # vs reference (full), vs the 8B FSDP2 peak
    assert "1.000x" in next(line for line in lines if "qwen3-14B" in line)
