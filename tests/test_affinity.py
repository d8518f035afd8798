"""Thread pinning (slidedp/affinity.py, slidedp.pin_threads): each rank's share of the cores, one
NUMA node's where there are several, and the CPU Adam pool's helpers really pinned. A 2-rank run
with pinning trains as `single` does (tests/test_slidedp.py, the clipping case)."""

import glob
import os

import pytest
import torch

from slidedp import affinity, cpu_adam


def test_ranks_share_one_node_each_where_there_are_several(monkeypatch):
    monkeypatch.setattr(affinity, "numa_nodes", lambda allowed: [list(range(8)), list(range(8, 16))])
    shares = [affinity.rank_cores(r, 4, set(range(16))) for r in range(4)]
    assert shares == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert [affinity.rank_cores(r, 2, set(range(16))) for r in range(2)] == [list(range(8)), list(range(8, 16))]


def test_one_node_splits_the_allowed_cores():
    allowed = set(range(2, 18))  # an affinity mask that starts above core 0
    assert [affinity.rank_cores(r, 3, allowed) for r in range(3)] == [
        list(range(2, 7)), list(range(7, 12)), list(range(12, 17))]
    assert affinity.rank_cores(3, 4, {0, 1}) == [1]  # more ranks than cores: shared round-robin


def test_placement_puts_the_update_last_and_helpers_before_it():
    where = affinity.placement([4, 5, 6, 7], update_threads=6)
    assert (where.update, where.deliver, where.compute) == (7, 4, (4, 5, 6, 7))
    assert where.helpers == (6, 5, 4, 7, 6)  # one core each, cycling once they outnumber the share


def _thread_affinities() -> list[set[int]]:
    out = []
    for status in glob.glob(f"/proc/{os.getpid()}/task/*/status"):
        with open(status) as f:
            line = next(line for line in f if line.startswith("Cpus_allowed_list"))
        out.append(set(affinity._cpulist(line.split(":", 1)[1])))
    return out


@pytest.mark.skipif(cpu_adam.active_isa() == cpu_adam.TORCH_ISA, reason="the torch fallback has no pool")
def test_pool_helpers_are_pinned_and_unpinned():
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    helpers = [cores[1], cores[0], cores[1]]
    cpu_adam.pin_helpers(helpers)
    threads = _thread_affinities()
    assert sum(a == {cores[1]} for a in threads) >= 2 and sum(a == {cores[0]} for a in threads) >= 1
    n = 1 << 16
    p, m, v = torch.ones(n), torch.zeros(n), torch.zeros(n)  # the pinned pool still computes
    cpu_adam.adam_update(p, torch.ones(n), m, v, step=1, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8,
                         weight_decay=0.0, num_threads=4)
    assert torch.allclose(p, torch.full((n,), 0.9))
    cpu_adam.pin_helpers([-1] * len(helpers))
    assert not any(len(a) == 1 for a in _thread_affinities())
