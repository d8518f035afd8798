"""Pinning a rank's threads to cores (slidedp.pin_threads).

A rank's share of the cores: where the host has several NUMA nodes, the cores of one node (rank r
of R on node r * nodes // R, the node's cores split among its ranks), so its update reads and
writes the host state through its own memory controller as far as first touch allows; on one
node, an even split of the process's allowed cores. Within the share the delivery thread takes
one core and the CPU Adam's helpers one core each (slidedp/cpu_adam.py `pin_helpers`); the
update thread (the pool's worker 0) takes the share's last core. The compute thread keeps the
whole share: torch's intra-op threads start from its affinity, and one core would serialise them.
Unpinned, the scheduler may move a helper mid-pass onto a core another helper holds, and a pass
waits for its slowest block.
"""

import glob
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from slidedp import cpu_adam


def _cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]."""
    cpus: list[int] = []
    for part in filter(None, text.strip().split(",")):
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def numa_nodes(allowed: set[int]) -> list[list[int]]:
    """The allowed cores of each NUMA node that has any (one node with them all if sysfs says
    nothing)."""
    nodes = []
    for path in sorted(glob.glob("/sys/devices/system/node/node[0-9]*/cpulist"),
                       key=lambda p: int(p.split("/node")[-1].split("/")[0])):
        with open(path) as f:
            cpus = [c for c in _cpulist(f.read()) if c in allowed]
        if cpus:
            nodes.append(cpus)
    return nodes or [sorted(allowed)]


def rank_cores(local_rank: int, local_world: int, allowed: set[int] | None = None) -> list[int]:
    """This rank's share of the cores (module docstring); at least one."""
    allowed = set(os.sched_getaffinity(0)) if allowed is None else allowed
    nodes = numa_nodes(allowed)
    if len(nodes) > 1 and local_world > 1:
        node = local_rank * len(nodes) // local_world
        ranks_here = [r for r in range(local_world) if r * len(nodes) // local_world == node]
        cores, index, count = nodes[node], ranks_here.index(local_rank), len(ranks_here)
    else:
        cores, index, count = sorted(allowed), local_rank, local_world
    share = len(cores) // count
    if share == 0:  # more ranks than cores: ranks share them round-robin
        return [cores[index % len(cores)]]
    return cores[index * share:(index + 1) * share]


@dataclass(frozen=True)
class Placement:
    """Where a rank's threads run."""

    compute: tuple[int, ...]
    """The compute thread (and torch's intra-op threads it starts): the whole share."""
    deliver: int
    """The delivery thread."""
    update: int
    """The update thread: the CPU Adam pool's worker 0."""
    helpers: tuple[int, ...]
    """The CPU Adam pool's helpers 1 .. threads - 1, one core each (cycling if they outnumber
    the share)."""


def placement(cores: list[int], *, update_threads: int) -> Placement:
    """The threads of a rank with `cores` and `update_threads` CPU Adam workers: the update
    thread on the last core, helpers on the cores before it, the delivery thread on the first."""
    order = cores[::-1]
    helpers = tuple(order[(1 + i) % len(order)] for i in range(max(0, update_threads - 1)))
    return Placement(compute=tuple(cores), deliver=cores[0], update=order[0], helpers=helpers)


def pin_this_thread(cores: tuple[int, ...] | int) -> None:
    """The calling thread (Linux: pid 0 is the caller's thread) runs only on `cores`."""
    os.sched_setaffinity(0, {cores} if isinstance(cores, int) else set(cores))



class RuntimeThreads:
    """A rank's delivery and update threads: one-thread pools, each started by `initializer`."""

    def __init__(self, initializer: Callable[[], None]):
        self.deliverer = ThreadPoolExecutor(1, thread_name_prefix="slidedp-deliver",
                                            initializer=initializer)
        self.updater = ThreadPoolExecutor(1, thread_name_prefix="slidedp-update",
                                          initializer=initializer)

    def pin(self, *, local_rank: int, local_world: int, update_threads: int) -> None:
        """This rank's threads on its share of the cores, each runtime thread pinned from inside
        itself, then the caller's (compute)."""
        where = placement(rank_cores(local_rank, local_world), update_threads=update_threads)
        self.deliverer.submit(pin_this_thread, where.deliver).result()
        self.updater.submit(pin_this_thread, where.update).result()
        self.updater.submit(cpu_adam.pin_helpers, list(where.helpers)).result()
        pin_this_thread(where.compute)

    def shutdown(self) -> None:
        self.deliverer.shutdown(wait=True, cancel_futures=True)
        self.updater.shutdown(wait=True, cancel_futures=True)
