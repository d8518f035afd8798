"""Ending a benchmark launch that ran past its time limit, as timeout(1) would but for its whole
process tree, and then waiting for the machine to settle, so that the next launch does not start
beside a dying one still holding a GPU or freeing host memory."""

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

KILL_GRACE_S = 15
"""After SIGTERM, how long a killed launch gets to exit before SIGKILL."""
SETTLE_S, SETTLE_POLL_S, SETTLE_RISE_KIB = 60, 2, 1 << 20


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun starts its workers in sessions of their own, out of
    reach of a process-group signal)."""
    parent_of: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent_of[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    below, frontier = [], {pid}
    while frontier:
        frontier = {child for child, parent in parent_of.items() if parent in frontier}
        below.extend(frontier)
    return below


def kill_launch(proc: subprocess.Popen) -> int:
    """SIGTERM to the launch's process group (torchrun passes it on to its workers), then
    SIGKILL to whatever of it is left after KILL_GRACE_S; 124 or 137, as timeout(1)."""
    tree = [proc.pid, *descendants(proc.pid)]
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=KILL_GRACE_S)
        rc = 124
    except subprocess.TimeoutExpired:
        rc = 137
    for pid in [*tree, *descendants(proc.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    return rc


def _mem_available_kib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1])
    return 0


def _gpu_busy() -> bool:
    """Whether any process holds a GPU (False where there is no nvidia-smi)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return bool(out.strip())


def settle() -> float:
    """After a killed launch: wait (at most SETTLE_S) until no process holds a GPU and host
    memory stops coming back, so that the next launch does not share the machine with one
    still freeing its memory. Returns the seconds waited."""
    waited, after = 0.0, _mem_available_kib()
    while waited < SETTLE_S:
        time.sleep(SETTLE_POLL_S)
        waited += SETTLE_POLL_S
        before, after = after, _mem_available_kib()
        if not _gpu_busy() and after - before < SETTLE_RISE_KIB:
            break
    print(f"settled after {waited:.0f} s; MemAvailable {after / (1 << 20):.0f} GiB", flush=True)
    return waited
