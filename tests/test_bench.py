"""The benchmark helpers: per-stream GPU breakdown of a trace, and the markdown report."""

import gzip
import json

import pytest

from recipes.bench.throughput import point_specs, report
from recipes.bench.timeline import breakdown


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
    base = {"label": "", "route": "-", "world": 2, "seq": 4096, "keep_blocks": None, "mfu": 0.5,
            "tflops_per_gpu": 390.0, "peak_mem_alloc_gib": 50.0, "peak_mem_reserved_gib": 60.0,
            "peak_rss_gib": 1.0, "step_time_s": 1.0}
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


def test_trace_dir_is_made_and_each_point_gets_its_own_trace(tmp_path):
    """--trace-dir that does not exist yet: the bench makes it, and two points at the same batch
    each write their own profiled step (and report its time in their row)."""
    import subprocess
    import sys

    from tests.conftest import REPO, free_port, subprocess_env

    traces, out = tmp_path / "new" / "traces", tmp_path / "runs.jsonl"
    env = dict(subprocess_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
               WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    proc = subprocess.run([sys.executable, "-m", "recipes.bench.throughput", "--mode", "slidedp",
                           "--kernels", "torch", "--flavor", "qwen3-debug", "--seq", "32",
                           "--max-norm", "1.0", "--warmup", "0", "--steps", "1",
                           "--no-memory-check", "--points", "selective:2", "selective|0-1:keep:2",
                           "--trace-dir", str(traces), "--trace-batch", "2", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert sorted(p.name for p in traces.iterdir()) == [
        "slidedp_sharded-gpu_p0_b2x1.json.gz", "slidedp_sharded-gpu_p1_b2x1.json.gz"]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["activation_blocks"] for r in rows] == ["", "0-1:keep"]
    assert all(r["traced_step_s"] > 0 for r in rows)
