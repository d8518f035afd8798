"""Shared test helpers: launching real multi-rank runs on the CPU (gloo).

Two ways, both importable (`from tests.conftest import run_ranks, run_torchrun`):
- `run_ranks(fn, world=W, args=...)`: W spawned processes in one gloo group, each returning
  `fn(rank, world, *args)` to the test (fn must be a module-level function); `ranks_fixture`
  makes one launch of those for several tests;
- `run_torchrun([...], nproc=W)`: `torchrun --standalone` of a module or script, as a user runs it.
"""

import io
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.rank_exit import assert_no_gloo_thread_left

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SESSION_CACHE = ""


def pytest_configure(config: pytest.Config) -> None:
    """The suite's compiled kernels and measured rates go to a folder of its own, removed at
    the end, never the user's ~/.cache/slidedp (a later `recipes.plan` would read test rates);
    every child process inherits it. A SLIDEDP_CACHE_DIR set by the caller is kept."""
    global _SESSION_CACHE
    if not os.environ.get("SLIDEDP_CACHE_DIR"):
        _SESSION_CACHE = tempfile.mkdtemp(prefix="slidedp-tests-")
        os.environ["SLIDEDP_CACHE_DIR"] = _SESSION_CACHE
    # An xdist worker computes on its share of the cores: more threads contend with the other
    # workers' and wait on each other at every op (the suite runs two on 2 cores).
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))
    # Children that take a share of the whole machine (the bench launches of recipes/reproduce
    # and recipes.bench.suite) wait for their OpenMP threads asleep, not spinning on the cores
    # that the other workers need.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_unconfigure(config: pytest.Config) -> None:
    if _SESSION_CACHE:
        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for child processes: this repo importable, one thread per rank (the test
    machine has 2 cores shared by all ranks)."""
    path = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))  # keep the rest
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", **extra)


def selected(request: pytest.FixtureRequest, names: Iterable[str]) -> list[str]:
    """Those of `names` (tests of the requesting module) that this session runs: a module
    fixture that launches ranks once for several tests (a start-up costs seconds per rank) runs
    only the cases of the tests selected."""
    chosen = {item.name for item in request.session.items if item.module is request.module}
    return [name for name in names if name in chosen]


def free_port() -> int:
    """A TCP port free right now on localhost (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(args: list[str], *, nproc: int, timeout: float = 600,
                 env: dict[str, str] | None = None,
                 check: bool = True) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=nproc ARGS` (e.g. ["-m", "recipes.train", ...]) from
    the repo root; with `check`, fails the test with the output's tail unless every rank exits 0."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env or subprocess_env(), capture_output=True,
                          text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def kill_process_tree(pid: int) -> None:
    """SIGKILL `pid` and every descendant (torchrun starts its workers in their own sessions, so
    a process group kill misses them)."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue  # it has just exited
        children.setdefault(ppid, []).append(int(entry))
    stack = [pid]
    while stack:
        p = stack.pop()
        stack.extend(children.get(p, []))
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _rank_main(fn: Callable, rank: int, world: int, port: int, args: tuple,
               results: mp.Queue, nodes: int = 1) -> None:
    local_world = world // nodes  # torchrun's node groups: node n holds ranks n*L .. n*L+L-1
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank % local_world),
                      LOCAL_WORLD_SIZE=str(local_world), GROUP_RANK=str(rank // local_world))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        # As bytes: tensors sent through the queue would live in shared memory that the exiting
        # child owns.
        buffer = io.BytesIO()
        torch.save(fn(rank, world, *args), buffer)
        dist.destroy_process_group()
        assert_no_gloo_thread_left()
        results.put((rank, buffer.getvalue(), None))
    except BaseException:
        results.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], *, world: int, args: tuple = (), nodes: int = 1,
              timeout: float = 300) -> list[Any]:
    """Run `fn(rank, world, *args)` on `world` spawned CPU processes sharing a gloo process
    group, grouped into `nodes` nodes as torchrun's environment says; returns the results by
    rank. A failing rank fails the test with its traceback."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, rank, world, port, args, results, nodes))
             for rank in range(world)]
    for p in procs:
        p.start()
    by_rank: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, value, error = results.get(timeout=timeout)
            assert error is None, f"rank {rank} failed:\n{error}"
            by_rank[rank] = torch.load(io.BytesIO(value), weights_only=False)
    except queue.Empty:
        raise AssertionError(f"ranks {sorted(set(range(world)) - set(by_rank))} timed out "
                             f"after {timeout} s") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():  # a peer failed and this rank waits in a collective forever
                p.kill()
    return [by_rank[r] for r in range(world)]


def _calls(rank: int, world: int, calls: dict[str, tuple[Callable, tuple]]) -> dict[str, Any]:
    return {name: fn(rank, world, *args) for name, (fn, args) in calls.items()}


def ranks_fixture(calls: dict[str, tuple[Callable, tuple]], *, world: int):
    """A module fixture over `calls`, keyed by the name of the test that checks each:
    `fixture[name]` is, by rank, `fn(rank, world, *args)` for `calls[name] = (fn, args)`. The
    selected tests' calls run one after another in one run_ranks launch."""

    @pytest.fixture(scope="module")
    def results(request) -> dict[str, list[Any]]:
        chosen = {name: calls[name] for name in selected(request, calls)}
        by_rank = run_ranks(_calls, world=world, args=(chosen,))
        return {name: [r[name] for r in by_rank] for name in chosen}

    return results
