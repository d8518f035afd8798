"""Where a rank's time goes: the build's phases, the runtime threads' host times, the update tail.

Each step reports where the threads' time went (`host_*_s`: version-gate waits, delivery issue,
gradient returns, updates, clipped updates, the compute thread's waits for deliveries) and
`update_tail_s` (how long after a step's GPU compute its last update ended, reported when
known).
"""

import contextlib
import time
from collections import defaultdict
from typing import Iterator


class Laps:
    """Wall seconds of the build's phases (SlideDPBackend.build_s), each from the end of the one
    before: where a start of a minute goes."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def __call__(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase], self._last = now - self._last, now


class UpdateTail:
    """When the last update of a step ended, against the end of the step's GPU compute."""

    def __init__(self, units: int):
        self.left = units  # updates still to end (the update thread counts them down)
        self.compute_end: float | None = None
        self.end: float | None = None

    def unit_done(self) -> None:
        self.left -= 1
        if not self.left:
            self.end = time.perf_counter()


class StepTimes:
    """The runtime threads' running host times and the steps' update tails, reported per step."""

    def __init__(self):
        self._totals: defaultdict[str, float] = defaultdict(float)
        self._reported: dict[str, float] = {}  # the totals at the last step's report
        self._tails: list[UpdateTail] = []  # steps whose updates have not all been reported

    def add(self, key: str, seconds: float) -> None:
        self._totals[key] += seconds

    @contextlib.contextmanager
    def timed(self, key: str) -> Iterator[None]:
        """Adds the block's wall time to the running total of `host_<key>` (each key has one
        thread)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._totals[key] += time.perf_counter() - start

    def new_tail(self, units: int) -> UpdateTail:
        """The tail of a step whose `units` updates are about to be issued."""
        tail = UpdateTail(units)
        self._tails.append(tail)
        return tail

    def report(self) -> dict[str, float]:
        """`update_tail_s` of the latest step whose updates all ended since the last report
        (the previous step's, when its updates outlast it): from the end of its GPU compute to
        its last update; and `host_<key>` seconds since the previous report: updates that run
        after a step returns count in the next step instead of being lost."""
        done = [t for t in self._tails if t.end is not None]
        self._tails = [t for t in self._tails if t.end is None]
        out = {"update_tail_s": max(0.0, done[-1].end - done[-1].compute_end)} if done else {}
        totals = dict(self._totals)
        out.update({f"host_{key}": total - self._reported.get(key, 0.0)
                    for key, total in totals.items() if total > self._reported.get(key, 0.0)})
        self._reported = totals
        return out
