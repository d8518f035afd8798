"""Running a benchmark launch to a time limit and ending it there, as timeout(1) would but for its
whole process tree (and when the caller itself is stopped), then waiting for the machine to
settle, so that the next launch does not start beside a dying one still holding a GPU or freeing
host memory."""

import contextlib
import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

KILL_GRACE_S = 15
"""After SIGTERM, how long a killed launch gets to exit before SIGKILL."""
KILLED = (124, 137)
"""The exit statuses kill_launch gives a launch it ended (SIGTERM, SIGKILL), as timeout(1)'s."""
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
    tree += descendants(proc.pid)
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    # SIGKILL is delivered asynchronously: the next launch starts once the tree is gone.
    deadline = time.monotonic() + KILL_GRACE_S
    while any(running(pid) for pid in tree) and time.monotonic() < deadline:
        time.sleep(0.05)
    return rc


def running(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead and not yet reaped by its new parent, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """SIGTERM (an outer timeout's) as an exit that unwinds, while a launch runs, so that its
    tree is ended first: by default Python dies at once and leaves it running. Only the main
    thread can take signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stopped(signum, frame):
        print(f"[launch] stopped by signal {signum}", flush=True)
        raise SystemExit(128 + signum)

    before = signal.signal(signal.SIGTERM, stopped)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def run_launch(cmd: list[str], *, limit: float | None, out: IO[str], **popen) -> int:
    """`cmd`'s exit status, its output (both streams) written to `out`, in a session of its own
    so that the whole tree can be ended: at `limit` (124 or 137, kill_launch), or when the caller
    is stopped (SIGTERM, Ctrl-C), which then goes on up (SIGTERM as exit status 143); a launch
    left running would share the GPU with the next one and write into its rows."""
    with _sigterm_unwinds():
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, **popen)
        try:
            return proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            return kill_launch(proc)
        except BaseException:
            kill_launch(proc)
            raise


def run_captured(cmd: list[str], *, limit: float | None, **popen) -> tuple[int, str]:
    """run_launch with its output kept in a temporary file (no pipe to fill and stall it) and
    returned."""
    with tempfile.TemporaryFile("w+") as out:
        rc = run_launch(cmd, limit=limit, out=out, **popen)
        out.seek(0)
        return rc, out.read()


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
