"""The order of the host updates, decided in one place.

The update thread (slidedp/gradient_flow.py) has two kinds of work. Gradient returns
(`GradientReturn.start` and what must follow it at once) run first and in the order backward hands
them over, which every rank shares, so the collectives and staging handshakes inside them match up
across ranks. Updates touch only this rank's shard of the host state, so they may run in any
order: each becomes runnable once its unit's gradient is home (a deferred update: once the step's
global norm is known too), and an `UpdateOrder` picks which runnable update runs next. Every unit
is still updated exactly once per step, and the version gates hold each of the next step's
deliveries until its own unit's update is done, so the order changes timing, never results.

- `next_use`: the unit the next step needs first. The next step uses the units in
  index order (embedding, block 0, 1, ..., head: slidedp/schedule.py), while backward returns
  them head first; so what is left when backward ends, in the host-bound regime most of the
  updates, runs embedding first, and the next step's forward follows the updates unit by unit
  through the version gates instead of waiting for the whole queue.
- `arrival` (the default): in the order the gradients came home, each update as early as
  possible: when backward ends the embedding's update, needed first, is the last in line.
  docs/PERFORMANCE.md has how the two compare.
"""

import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

UpdateOrderName = Literal["next_use", "arrival"]
"""The update orders (slidedp.update_order)."""


class UpdateOrder:
    """Which of the runnable updates runs next."""

    name: UpdateOrderName

    def pick(self, units: Sequence[int]) -> int:
        """The position in `units` (the runnable updates' unit indices, in the order they became
        runnable) of the update to run next."""
        raise NotImplementedError


class NextUse(UpdateOrder):
    """The unit the next step's forward uses first: the lowest index."""

    name = "next_use"

    def pick(self, units: Sequence[int]) -> int:
        return min(range(len(units)), key=units.__getitem__)


class Arrival(UpdateOrder):
    """The update that became runnable first."""

    name = "arrival"

    def pick(self, units: Sequence[int]) -> int:
        return 0


UPDATE_ORDERS: dict[str, UpdateOrder] = {o.name: o for o in (NextUse(), Arrival())}


class UpdateQueue:
    """The update thread's work: gradient returns first, in the order they were added, then the
    runnable update that `order` picks. Each item added submits one call of `_run_next` to the
    one-thread executor, and each call runs whichever item comes first at that moment, so the
    executor's FIFO order never decides which update runs. An update added with `after` (its
    unit's return, added before it) becomes runnable when that is done; when no return is
    queued, all of those are done, so a call always finds an item to run."""

    def __init__(self, executor: ThreadPoolExecutor, order: UpdateOrder, *,
                 on_failure: Callable[[], None]):
        """`on_failure` is called on the update thread when an item raises."""
        self.executor, self.order, self._on_failure = executor, order, on_failure
        self._lock = threading.Lock()
        self._returns: deque[tuple[Callable[[], Any], Future]] = deque()
        self._updates: list[tuple[int, Future | None, Callable[[], Any], Future, bool]] = []

    def add_return(self, job: Callable[[], Any]) -> Future:
        """Queue a gradient return; the future gets what `job` returns (or raises)."""
        done: Future = Future()
        with self._lock:
            self._returns.append((job, done))
        self.executor.submit(self._run_next)
        return done

    def add_update(self, unit: int, job: Callable[[], Any], *, after: Future | None = None,
                   first: bool = False) -> Future:
        """Queue the update of `unit`, runnable once `after` is done (now if None); a `first`
        one (issued on the GPU: milliseconds, where a host update takes tens) runs before any
        other runnable update, whatever the order."""
        done: Future = Future()
        with self._lock:
            self._updates.append((unit, after, job, done, first))
        self.executor.submit(self._run_next)
        return done

    def _run_next(self) -> None:
        with self._lock:
            if self._returns:
                job, done = self._returns.popleft()
            else:
                runnable = [i for i, (_, after, _, _, _) in enumerate(self._updates)
                            if after is None or after.done()]
                runnable = [i for i in runnable if self._updates[i][4]] or runnable
                pick = runnable[self.order.pick([self._updates[i][0] for i in runnable])]
                _, _, job, done, _ = self._updates.pop(pick)
        try:
            done.set_result(job())
        except BaseException as e:  # the waiter re-raises it
            self._on_failure()
            done.set_exception(e)
