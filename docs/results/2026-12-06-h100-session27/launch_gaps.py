"""Where the compute stream of a traced SlideDP step sits idle, and why: for each gap of more
than 50 us before a kernel, copy or memset on the compute stream, whether the CUDA call that
launched it came just before it ran (the GPU waited for the host to launch it) or long before
(it waited on the device for another stream), and which host ops of the launching thread
overlap the gap.

    python launch_gaps.py trace1.tgz [STREAM]   (STREAM: the compute stream's id, default 7)
"""

import collections
import gzip
import json
import sys
import tarfile

archive, stream = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 7
with tarfile.open(archive) as tar:
    member = next(m for m in tar.getmembers() if m.name.endswith(".json.gz"))
    events = json.load(gzip.open(tar.extractfile(member)))["traceEvents"]
device = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
                 and e["args"].get("stream") == stream), key=lambda e: e["ts"])
calls = {e["args"].get("correlation"): e for e in events
         if e.get("cat") in ("cuda_runtime", "cuda_driver")}
ops = [e for e in events if e.get("cat") == "cpu_op" and "dur" in e]
span = device[-1]["ts"] + device[-1]["dur"] - device[0]["ts"]
busy = sum(e["dur"] for e in device)
late = waited = 0.0
by_op: collections.Counter = collections.Counter()
for prev, nxt in zip(device, device[1:]):
    start, end = prev["ts"] + prev["dur"], nxt["ts"]
    if end - start < 50:
        continue
    call = calls.get(nxt["args"].get("correlation"))
    if call is None or end - (call["ts"] + call["dur"]) >= 30:
        waited += end - start
        continue
    late += end - start
    for op in ops:
        if op["tid"] == call["tid"] and op["dur"] > 20 and op["ts"] < end and op["ts"] + op["dur"] > start:
            by_op[(op["tid"], op["name"][:60])] += min(end, op["ts"] + op["dur"]) - max(start, op["ts"])
print(f"compute stream {stream}: span {span / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms")
print(f"gaps > 50 us: launched late {late / 1e3:.1f} ms, waited on the device {waited / 1e3:.1f} ms")
print("host ops of the launching thread overlapping the late gaps (nested ops count again):")
for (tid, name), us in by_op.most_common(12):
    print(f"  {us / 1e3:6.2f} ms  thread {tid}  {name}")
