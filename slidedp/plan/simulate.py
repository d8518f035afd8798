"""A discrete-event simulation of tasks on lanes and shared capacities (a fluid model).

A *lane* is something that does one thing at a time, in the order its tasks were added: a CUDA
stream, a worker thread. A task holds all of its lanes from start to end (a collective holds
one stream of every rank), and starts once its dependencies are done and it is first in line
on each of its lanes.

A *capacity* is a rate that tasks share while they run: a PCIe link (bytes/s), the host's
memory bandwidth, a GPU or a rank's CPU threads (seconds of work per second). A task needs an
amount of each of its capacities (`work`) and progresses as fast as the scarcest of them allows.
Concurrent tasks share a capacity by weighted max-min fairness: every task runs at the same
fraction of its speed alone, raised until some capacity is full; the tasks on that capacity
keep that fraction and the others go on rising. A task may instead (or first) take `fixed`
seconds that use no capacity: a latency.
"""

import math
from collections import deque
from dataclasses import dataclass, field

_EPS = 1e-12


@dataclass
class Task:
    """One piece of work (see the module docstring)."""

    lanes: tuple[str, ...]
    """Lanes held from start to end, in the order of the tasks added to each."""
    work: dict[str, float]
    """Capacity -> amount (in that capacity's unit: bytes, or seconds of work)."""
    fixed: float
    """Seconds before the work starts that use no capacity (a latency)."""
    deps: tuple[int, ...]
    """Tasks that must finish first."""
    kind: str
    """What it is, for attribution ("compute", "h2d", "collective", ...)."""
    step: int
    """The training step it belongs to."""
    label: str = ""
    """For debugging."""
    start: float = math.nan
    end: float = math.nan
    usage: dict[str, float] = field(default_factory=dict)
    """Capacity -> amount actually used (= work once done)."""


class Simulation:
    """Add tasks, then `run`; each task then has its start and end."""

    def __init__(self, capacities: dict[str, float]):
        for name, rate in capacities.items():
            if not rate > 0:
                raise ValueError(f"capacity {name} must be > 0, got {rate!r}")
        self.capacities = dict(capacities)
        self.tasks: list[Task] = []
        self.intervals: list[tuple[float, float, dict[str, float]]] = []
        """(start, end, capacity -> rate used) between consecutive events."""

    def add(self, lanes: tuple[str, ...] | str, *, work: dict[str, float] | None = None,
            fixed: float = 0.0, deps=(), kind: str, step: int, label: str = "") -> int:
        """A task; returns its id (deps are ids of tasks added before)."""
        lanes = (lanes,) if isinstance(lanes, str) else tuple(lanes)
        work = {k: v for k, v in (work or {}).items() if v > 0}
        for k in work:
            if k not in self.capacities:
                raise KeyError(f"unknown capacity {k!r}")
        deps = tuple(d for d in deps if d is not None)
        if any(d >= len(self.tasks) for d in deps):
            raise ValueError("a task can only depend on tasks added before it")
        self.tasks.append(Task(lanes=lanes, work=work, fixed=max(0.0, fixed), deps=deps,
                               kind=kind, step=step, label=label))
        return len(self.tasks) - 1

    # ---- the event loop ------------------------------------------------------------------------

    def run(self) -> float:
        """Simulate every task; returns the time the last one ends."""
        tasks = self.tasks
        waiting_on = [len(t.deps) for t in tasks]
        dependents: list[list[int]] = [[] for _ in tasks]
        for i, t in enumerate(tasks):
            for d in t.deps:
                dependents[d].append(i)
        queues: dict[str, deque[int]] = {}
        for i, t in enumerate(tasks):
            for lane in t.lanes:
                queues.setdefault(lane, deque()).append(i)
        now = 0.0
        started = [False] * len(tasks)
        progress = [0.0] * len(tasks)  # fraction of the work done
        fixed_end: dict[int, float] = {}  # running tasks still in their fixed part
        working: set[int] = set()  # running tasks in their work part
        # A stack, not a set: a set's table stays sized for every task, and its pop walks the
        # slots that earlier pops emptied, from where the last one stopped, round and round.
        candidates = list(range(len(tasks) - 1, -1, -1))
        done = 0

        def startable(i: int) -> bool:
            return (not started[i] and waiting_on[i] == 0
                    and all(queues[lane][0] == i for lane in tasks[i].lanes))

        while done < len(tasks):
            finished: list[int] = []
            while candidates:  # start what can start; zero-length tasks end at once
                i = candidates.pop()
                if not startable(i):
                    continue
                started[i] = True
                tasks[i].start = now
                if tasks[i].fixed > 0:
                    fixed_end[i] = now + tasks[i].fixed
                elif tasks[i].work:
                    working.add(i)
                else:
                    finished.append(i)
                    self._finish(i, now, queues, waiting_on, dependents, candidates)
            done += len(finished)
            if done == len(tasks):
                break
            if not fixed_end and not working:
                stuck = next(i for i in range(len(tasks)) if not started[i])
                raise RuntimeError(f"deadlock: task {stuck} ({tasks[stuck].label or tasks[stuck].kind}) "
                                   "can never start")
            speeds = self._speeds(working)
            dt = min([t - now for t in fixed_end.values()]
                     + [(1.0 - progress[i]) / speeds[i] for i in working])
            dt = max(dt, 0.0)
            used: dict[str, float] = {}
            for i in working:
                progress[i] += speeds[i] * dt
                for k, amount in tasks[i].work.items():
                    used[k] = used.get(k, 0.0) + speeds[i] * amount
            if dt > 0:
                self.intervals.append((now, now + dt, used))
            now += dt
            for i in [i for i, t in fixed_end.items() if t <= now + _EPS]:
                del fixed_end[i]
                if tasks[i].work:
                    working.add(i)
                else:
                    self._finish(i, now, queues, waiting_on, dependents, candidates)
                    done += 1
            for i in [i for i in working if progress[i] >= 1.0 - 1e-9]:
                working.discard(i)
                self._finish(i, now, queues, waiting_on, dependents, candidates)
                done += 1
        return now

    def _finish(self, i: int, now: float, queues, waiting_on, dependents, candidates) -> None:
        task = self.tasks[i]
        task.end = now
        task.usage = dict(task.work)
        for lane in task.lanes:
            queues[lane].popleft()
            if queues[lane]:
                candidates.append(queues[lane][0])
        for j in dependents[i]:
            waiting_on[j] -= 1
            if waiting_on[j] == 0:
                candidates.append(j)

    def _speeds(self, working: set[int]) -> dict[int, float]:
        """Fractions of the work per second, by weighted max-min fairness (module docstring)."""
        tasks, caps = self.tasks, self.capacities
        alone = {i: max(a / caps[k] for k, a in tasks[i].work.items()) for i in working}
        left = dict(caps)
        level: dict[int, float] = {}
        active = set(working)
        while active:
            load: dict[str, float] = {}
            for i in active:
                for k, a in tasks[i].work.items():
                    load[k] = load.get(k, 0.0) + a / alone[i]
            k_min = min(load, key=lambda k: max(left[k], 0.0) / load[k])
            t = max(left[k_min], 0.0) / load[k_min]
            frozen = [i for i in active if k_min in tasks[i].work]
            for i in frozen:
                level[i] = t
                active.discard(i)
                for k, a in tasks[i].work.items():
                    left[k] -= t * a / alone[i]
        return {i: max(level[i], _EPS) / alone[i] for i in working}


def union_length(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of `intervals` within [lo, hi]."""
    total, end = 0.0, lo
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def subtract(intervals: list[tuple[float, float]], holes: list[tuple[float, float]]
             ) -> list[tuple[float, float]]:
    """`intervals` less the union of `holes` (both lists of (start, end))."""
    out = []
    holes = sorted(holes)
    for a, b in sorted(intervals):
        cur = a
        for h0, h1 in holes:
            if h1 <= cur or h0 >= b:
                continue
            if h0 > cur:
                out.append((cur, h0))
            cur = max(cur, h1)
            if cur >= b:
                break
        if cur < b:
            out.append((cur, b))
    return out
