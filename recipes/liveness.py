"""The ranks of a run end together.

- `exit_with_launcher`: a rank started by torchrun dies with it. torchrun starts each rank in a
  session of its own, so a SIGKILL of the launcher reaches no rank, and the ranks would go on
  training as orphans (writing the same metrics and checkpoints as a restarted run).
- `PeerWatch`: a rank whose peer on the same host has died ends within about a second, naming
  it, wherever it is blocked (a collective, a version gate in shared memory, a save): torchrun
  already stops the others when one exits, but nothing does for ranks launched without its agent,
  and gloo's own errors do not say which rank is gone.
"""

import contextlib
import ctypes
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator

import torch.distributed as dist

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def exit_with_launcher() -> None:
    """Under torchrun (TORCHELASTIC_RUN_ID set), have the kernel SIGKILL this process when its
    parent, torchrun's agent, exits: prctl(PR_SET_PDEATHSIG). Chosen over a thread polling
    os.getppid(): the kernel delivers it at once, even to a rank stuck in C++ (a collective, a
    CUDA call) or holding the GIL, and SIGKILL cannot be caught or delayed by either. The signal
    follows the parent *thread* that forked this process; torchrun forks its ranks from its main
    thread, which lives as long as torchrun. A launcher that died before the call is caught by
    comparing the parent before and after it."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return  # run directly: the parent is a shell or a test, not a launcher
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        print(f"[rank{os.environ.get('RANK', '?')}] error: the launcher (pid {parent}) exited "
              "before this rank started", file=sys.stderr, flush=True)
        os._exit(1)


def _start_time(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/PID/stat), None if it is gone or a zombie:
    with the pid it names one process, even once the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


class PeerWatch:
    """Ends this process (exit code 1) within `interval_s` of the death of another rank on this
    host, with one line naming it. Ranks on other hosts are not watched (their collectives fail).

    Every rank creates it at start (a collective: the ranks exchange host names and pids) and
    calls `finish()` once all its work is done; between the two, a peer that exits normally
    counts as dead, so `finish()` stops the watch before its final barrier, where a peer that
    dies makes gloo fail instead. A rank whose step fails because a peer died (gloo's "connection
    closed", which does not say who) calls `report()` to name the peer."""

    def __init__(self, *, rank: int, world: int, interval_s: float = 0.5) -> None:
        self.rank, self.interval_s = rank, interval_s
        self._group = dist.new_group(backend="gloo")
        table: list = [None] * world
        node = int(os.environ.get("GROUP_RANK", 0))  # torchrun's node group
        dist.all_gather_object(table, (socket.gethostname(), os.getpid(), node), group=self._group)
        here = socket.gethostname()
        self._peers = {r: (pid, _start_time(pid)) for r, (host, pid, _) in enumerate(table)
                       if r != rank and host == here}
        # With several nodes (two may share a host) a dead rank's line names its node too.
        several = len({n for _, _, n in table}) > 1
        self._node_of = {r: f" of node {n}" if several else "" for r, (_, _, n) in enumerate(table)}
        self._announced = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="peer-watch", daemon=True)
        self._thread.start()

    def _dead_peer(self) -> tuple[int, int] | None:
        for r, (pid, started) in self._peers.items():
            if _start_time(pid) != started:
                return r, pid
        return None

    def _announce(self, rank: int, pid: int) -> None:
        if self._announced.acquire(blocking=False):  # one line, from whichever thread sees it
            print(f"[rank{self.rank}] error: rank {rank} (pid {pid}){self._node_of[rank]} is gone "
                  "(killed or failed); "
                  "this rank ends too (resume from the last complete save: "
                  "--checkpoint.resume_from=latest)", file=sys.stderr, flush=True)

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            dead = self._dead_peer()
            if dead is not None and not self._stop.is_set():
                self._announce(*dead)
                os._exit(1)

    def report(self) -> None:
        """After a failure of this rank: name the peer whose end caused it, if one is gone (a
        collective's error can arrive a moment before the kernel shows the peer as gone)."""
        deadline = time.monotonic() + 0.2
        while (dead := self._dead_peer()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if dead is not None:
            self._announce(*dead)

    def stop(self) -> None:
        """Stop watching (every rank is stopping alike, or this one is done)."""
        self._stop.set()
        self._thread.join()

    def finish(self) -> None:
        """This rank's work is done: stop watching, then wait for every rank to be done too."""
        self.stop()
        dist.barrier(group=self._group)


@contextlib.contextmanager
def watching_peers(*, rank: int, world: int,
                   expected: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """Watch the other ranks on this host while the block runs (world > 1). After success every
    rank waits for the others; after an `expected` error (one that every rank raises alike) the
    watch stops; after any other error it stays on while the rank ends, and names a peer that
    is gone."""
    if world == 1:
        yield
        return
    watch = PeerWatch(rank=rank, world=world)
    try:
        yield
    except expected:
        watch.stop()
        raise
    except BaseException:
        watch.report()
        raise
    watch.finish()
