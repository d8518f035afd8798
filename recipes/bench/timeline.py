"""Where a step's time goes on the GPU: per-stream busy time from a torch.profiler trace.

A stream runs its work in order, so the sum of its kernels' and copies' durations is its busy
time; step time minus the compute stream's busy time is what the compute stream spent waiting
(for deliveries, version gates, the host). Communication kernels (NCCL) and copies are reported
apart, so the exposed part of H2D, D2H and collectives can be read next to what overlapped.
"""

import json
from collections import defaultdict


def _kind(event: dict) -> str:
    name = event.get("name", "")
    if event.get("cat") == "gpu_memcpy":
        if "HtoD" in name:
            return "h2d"
        return "d2h" if "DtoH" in name else "d2d"
    if event.get("cat") == "gpu_memset":
        return "memset"
    return "nccl" if "nccl" in name.lower() else "compute"


def stream_busy(trace_path: str) -> dict[str, dict[str, float]]:
    """{"stream <id>": {kind: seconds}} of the GPU events of one exported Chrome trace."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    busy: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        stream = e.get("args", {}).get("stream", e.get("tid"))
        busy[f"stream {stream}"][_kind(e)] += e["dur"] / 1e6
    return {s: dict(kinds) for s, kinds in busy.items()}


def breakdown(trace_path: str, *, step_time_s: float) -> dict[str, float]:
    """Totals over streams, and the compute stream's idle share of the step (the stream with the
    most compute-kernel time is taken as the compute stream)."""
    per_stream = stream_busy(trace_path)
    totals: dict[str, float] = defaultdict(float)
    for kinds in per_stream.values():
        for kind, seconds in kinds.items():
            totals[f"gpu_{kind}_s"] += seconds
    main = max(per_stream.values(), key=lambda k: k.get("compute", 0.0), default={})
    main_busy = sum(main.values())
    return {**totals, "compute_stream_busy_s": main_busy,
            "compute_stream_idle_s": max(0.0, step_time_s - main_busy)}
