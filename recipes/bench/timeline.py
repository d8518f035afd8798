"""Where a step's time goes on the GPU, from one torch.profiler Chrome trace.

A stream runs its work in order, so the sum of its kernels' and copies' durations is its busy
time. The compute stream (the one with the most compute-kernel time) is what sets the step time;
every gap in it is time the step waited. Each gap is attributed to what the other streams were
doing meanwhile, in the order H2D copy, collective (NCCL), D2H copy; a gap with none of these is
`host` (the GPU waited for the host: a version gate on the CPU update, a launch, the step edge).
That gives the exposed part of each resource next to its total (overlapped) busy time.

    python -m recipes.bench.timeline TRACE.json[.gz] --step-time 9.5
"""

import argparse
import gzip
import json
from collections import defaultdict

_EXPOSED_ORDER = ("h2d", "nccl", "d2h")


def _kind(event: dict) -> str:
    name = event.get("name", "")
    if event.get("cat") == "gpu_memcpy":
        if "HtoD" in name:
            return "h2d"
        return "d2h" if "DtoH" in name else "d2d"
    if event.get("cat") == "gpu_memset":
        return "memset"
    return "nccl" if "nccl" in name.lower() else "compute"


def _gpu_events(trace_path: str) -> list[tuple[str, str, float, float]]:
    """(stream, kind, start_s, end_s) of every kernel, copy and memset in the trace."""
    opener = gzip.open if trace_path.endswith(".gz") else open
    with opener(trace_path, "rt") as f:
        events = json.load(f)["traceEvents"]
    out = []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        stream = e.get("args", {}).get("stream", e.get("tid"))
        start = float(e.get("ts", 0.0)) / 1e6
        out.append((f"stream {stream}", _kind(e), start, start + e["dur"] / 1e6))
    return out


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def _subtract(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """a minus b, both merged and sorted."""
    out, j = [], 0
    for start, end in a:
        cur = start
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < end:
            out.append((cur, end))
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)


def _busy(events: list[tuple[str, str, float, float]]) -> dict[str, dict[str, float]]:
    busy: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for stream, kind, start, end in events:
        busy[stream][kind] += end - start
    return {s: dict(kinds) for s, kinds in busy.items()}


def stream_busy(trace_path: str) -> dict[str, dict[str, float]]:
    """{"stream <id>": {kind: seconds}} of the GPU events of one exported Chrome trace."""
    return _busy(_gpu_events(trace_path))


def breakdown(trace_path: str, *, step_time_s: float) -> dict[str, float]:
    """Busy seconds per kind summed over streams (`gpu_<kind>_s`), the compute stream's busy and
    idle time, and the idle time split by what it waited behind (`exposed_<kind>_s`, `exposed_host_s`;
    the host part includes the step time outside the trace's first and last GPU event)."""
    events = _gpu_events(trace_path)
    per_stream = _busy(events)
    totals: dict[str, float] = defaultdict(float)
    for kinds in per_stream.values():
        for kind, seconds in kinds.items():
            totals[f"gpu_{kind}_s"] += seconds
    if not events:
        return dict(totals)
    main = max(per_stream, key=lambda s: per_stream[s].get("compute", 0.0))
    main_busy = _merge([(s, e) for stream, _, s, e in events if stream == main])
    span = (min(s for *_, s, _ in events), max(e for *_, e in events))
    gaps = _subtract([span], main_busy)
    exposed = {}
    for kind in _EXPOSED_ORDER:
        others = _merge([(s, e) for stream, k, s, e in events if stream != main and k == kind])
        rest = _subtract(gaps, others)
        exposed[f"exposed_{kind}_s"] = _length(gaps) - _length(rest)
        gaps = rest
    main_busy_s = _length(main_busy)
    idle = max(0.0, step_time_s - main_busy_s)
    return {**totals, "compute_stream_busy_s": main_busy_s, "compute_stream_idle_s": idle, **exposed,
            "exposed_host_s": max(0.0, idle - sum(exposed.values()))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("--step-time", type=float, required=True, help="the traced step's wall time (s)")
    a = p.parse_args()
    for stream, kinds in sorted(stream_busy(a.trace).items()):
        print(stream, {k: round(v, 4) for k, v in sorted(kinds.items())})
    print(json.dumps({k: round(v, 4) for k, v in breakdown(a.trace, step_time_s=a.step_time).items()}))


if __name__ == "__main__":
    main()
