"""Consistency between a save written in the background and the updates of later steps.

A save of step N writes the host state as it is after step N while training goes on; the host
state is too large to copy. So each unit's next update waits for the unit instead: the save arms
the gate with every unit and its writer releases each one as soon as that unit's shards are
written. Written in the order the next step updates them, the save holds up training only by the
part of the write that outlasts the next step's forward and backward.
"""

import threading
import time
from collections.abc import Iterable

from slidedp.host_state import StepAborted


class SaveGate:
    """Holds back updates of units that the save in flight has not written yet."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._saved_step = 0
        self._unwritten: set[int] = set()

    def arm(self, step: int, units: Iterable[int]) -> None:
        """A save of the state after `step` begins: updates of later steps to `units` wait."""
        with self._cond:
            self._saved_step, self._unwritten = step, set(units)

    def release(self, unit: int) -> None:
        """`unit` is written: its later updates may go."""
        with self._cond:
            self._unwritten.discard(unit)
            self._cond.notify_all()

    def release_all(self) -> None:
        """The save ended (or failed): nothing waits any more."""
        with self._cond:
            self._unwritten.clear()
            self._cond.notify_all()

    def wait(self, unit: int, step: int, aborted: threading.Event) -> float:
        """Before the update of `unit` for `step`: until the save in flight has written the unit
        (no wait for the saved step's own updates); returns the seconds waited. Raises
        StepAborted once `aborted` is set."""
        start = time.perf_counter()
        with self._cond:
            if step <= self._saved_step or unit not in self._unwritten:
                return 0.0
            while unit in self._unwritten:
                if aborted.is_set():
                    raise StepAborted(f"SlideDP: stopped waiting for the save of unit {unit}: "
                                      "this rank's step failed")
                self._cond.wait(timeout=0.05)
        return time.perf_counter() - start
