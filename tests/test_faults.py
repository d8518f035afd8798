"""Processes that die: the launcher, one rank; a second run on the same folders; Ctrl-C.

Real 2-rank SlideDP runs over gloo, killed with SIGKILL: the ranks of a killed torchrun die with
it, a run folder is locked while its run lives, a rank whose peer died ends within seconds
naming it (with or without torchrun's agent), nothing of the run stays behind (its shared host
state goes with its processes), and a restart resumes from the last complete save exactly.
Ended by the user: a refused run and a Ctrl-C say so in one line with NGPU=2 as with one
process (exit codes 2 and 130), and a Ctrl-C saves first.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recipes.checkpoint import latest_checkpoint
from recipes.run_lock import FolderInUse, lock_folder, lock_run_folders
from tests.conftest import REPO, free_port, kill_process_tree, subprocess_env

SLIDEDP = ["--parallelism.mode=slidedp", "--training.local_batch_size=4", "--training.seq_len=64"]
STEPS = 12


def _alive(pid: int) -> bool:
    """Not yet gone: a zombie has released its memory and files only once all its threads
    have exited (while they exit, its main thread is already a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] not in ("Z", "X") or int(fields[17]) > 1  # state, num_threads


def _children(pid: int) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
        except OSError:
            continue
    return found


def _rank_of(pid: int) -> int:
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    return int(env[b"RANK"])


def _wait_for_steps(out: Path, n: int, procs: list[subprocess.Popen], log: Path) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        metrics = out / "metrics.jsonl"
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= n:
            return
        assert all(p.poll() is None for p in procs), log.read_text()[-3000:]
        time.sleep(0.05)
    raise AssertionError(f"no {n} steps in 120 s:\n{log.read_text()[-3000:]}")


def _wait_for_a_save_in_flight(save_dir: Path, timeout: float = 10) -> None:
    """Until a save's train state is being written (or, rarely, `timeout` passed)."""
    deadline = time.monotonic() + timeout
    while not any(save_dir.glob("step-*.train_state.tmp")) and time.monotonic() < deadline:
        time.sleep(0.002)


def _wait_gone(pids: list[int], timeout: float) -> float:
    start = time.monotonic()
    while any(_alive(p) for p in pids):
        assert time.monotonic() - start < timeout, [p for p in pids if _alive(p)]
        time.sleep(0.02)
    return time.monotonic() - start


def _train_sh_env() -> dict[str, str]:
    # One thread per rank in every run here, so that the resumed run can equal the reference
    # bit for bit whatever the machine's core count.
    return dict(os.environ, NGPU="2", OMP_NUM_THREADS="1")


def _train_sh(out: Path, *flags: str) -> list[dict]:
    proc = subprocess.run(["./run_train.sh", *_train_flags(out, *flags)], cwd=REPO,
                          env=_train_sh_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _train_flags(out: Path, *extra: str) -> list[str]:
    return ["--job.config_file", "train_configs/debug_cpu.toml", f"--job.dump_folder={out}",
            f"--checkpoint.save_dir={out}/hf", "--metrics.log_freq=1000", *SLIDEDP, *extra]


def test_a_folder_is_locked_by_its_run(tmp_path):
    folder = str(tmp_path / "run")
    # dump_folder and save_dir may be one folder: it is locked once.
    locks = lock_run_folders({"job.dump_folder": folder, "checkpoint.save_dir": folder})
    assert len(locks) == 1
    with pytest.raises(FolderInUse, match=rf"^checkpoint.save_dir: {folder} is in use by another "
                                          rf"run \(pid {os.getpid()}; lock file {folder}/.lock\)"):
        lock_folder(folder, key="checkpoint.save_dir")  # another open file: another holder
    locks[0].release()  # the folder it created holds nothing else: it goes
    assert not os.path.exists(folder)
    lock_folder(folder, key="checkpoint.save_dir").release()  # free once its holder lets go


def test_a_released_lock_removes_only_an_unused_folder_it_created(tmp_path):
    """A folder that existed stays; one the run created stays once anything else is in it."""
    kept, used = tmp_path / "kept", tmp_path / "used"
    kept.mkdir()
    lock_folder(str(kept), key="job.dump_folder").release()
    assert kept.is_dir() and [p.name for p in kept.iterdir()] == [".lock"]
    lock = lock_folder(str(used), key="job.dump_folder")
    (used / "metrics.jsonl").write_text("{}\n")
    lock.release()
    assert (used / "metrics.jsonl").read_text() == "{}\n"


def test_a_killed_launcher_takes_its_ranks_along(tmp_path):
    """SIGKILL of torchrun alone: its ranks die at once; until then, a second run on the same
    folder is refused with one line naming the holder."""
    out, log, ranks = tmp_path / "run", tmp_path / "log.txt", []
    with open(log, "w") as f:
        launcher = subprocess.Popen(["./run_train.sh", *_train_flags(out, "--training.steps=100000",
                                                                     "--checkpoint.save_dir=")],
                                    cwd=REPO, env=_train_sh_env(), stdout=f,
                                    stderr=subprocess.STDOUT)
    try:
        _wait_for_steps(out, 2, [launcher], log)
        ranks = _children(launcher.pid)  # run_train.sh execs torchrun: the launcher itself
        assert len(ranks) == 2
        rank0 = next(p for p in ranks if _rank_of(p) == 0)
        flags = _train_flags(out, "--training.steps=1", "--parallelism.mode=single")
        second = subprocess.run([sys.executable, "-m", "recipes.train", *flags],
                                cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                                timeout=120)
        assert second.returncode == 2
        assert second.stderr.strip().splitlines()[-1] == (
            f"error: job.dump_folder: {out} is in use by another run (pid {rank0}; lock file "
            f"{out}/.lock); wait for it to end, or use another folder")
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        gone = _wait_gone(ranks, timeout=10)
        print(f"the ranks were gone {gone:.2f} s after their launcher was killed")
        assert gone < 5
    finally:
        for pid in [launcher.pid, *ranks]:
            kill_process_tree(pid)
    # The folder is free again, and its metrics are whole lines of JSON.
    lock_folder(str(out), key="job.dump_folder").release()
    for line in (out / "metrics.jsonl").read_text().splitlines():
        json.loads(line)


def _launch_without_agent(out: Path, log: Path, *flags: str) -> list[subprocess.Popen]:
    """Two ranks started as a non-torchrun launcher (or another host's agent) would."""
    port = free_port()
    procs = []
    with open(log, "w") as f:
        for rank in range(2):
            env = subprocess_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                                 WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
            procs.append(subprocess.Popen([sys.executable, "-m", "recipes.train",
                                           *_train_flags(out, *flags)], cwd=REPO, env=env,
                                          stdout=f, stderr=subprocess.STDOUT))
    return procs


BLOCKED_SURVIVOR = """
import os, signal, time, torch.distributed as dist
from recipes.liveness import watching_peers
dist.init_process_group("gloo")
with watching_peers(rank=dist.get_rank(), world=2):
    if dist.get_rank() == 1:
        time.sleep(2)  # let rank 0 finish setting up its watch (a collective) first
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)  # a wait no collective notices: a version gate, a disk, a save's gate
"""


def test_a_rank_blocked_outside_any_collective_ends_when_its_peer_dies(tmp_path):
    script = tmp_path / "blocked.py"
    script.write_text(BLOCKED_SURVIVOR)
    port, procs = free_port(), []
    for rank in range(2):
        env = subprocess_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                             WORLD_SIZE="2")
        procs.append(subprocess.Popen([sys.executable, str(script)], cwd=REPO, env=env,
                                      stderr=subprocess.PIPE, text=True))
    try:
        assert procs[1].wait(timeout=60) == -signal.SIGKILL
        died = time.monotonic()
        _, err = procs[0].communicate(timeout=30)
        assert time.monotonic() - died < 5
    finally:
        for p in procs:
            p.kill()
    assert procs[0].returncode == 1
    assert err.strip().splitlines()[-1].startswith(
        f"[rank0] error: rank 1 (pid {procs[1].pid}) is gone (killed or failed)"), err


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    """The run never killed."""
    return _train_sh(tmp_path_factory.mktemp("reference"), f"--training.steps={STEPS}",
                     "--checkpoint.save_dir=")


@pytest.mark.parametrize("launcher", ["torchrun", "none"])
def test_a_killed_rank_ends_the_other_and_the_run_resumes_exactly(tmp_path, launcher, reference):
    """Rank 1 is SIGKILLed while steps and background saves (one per step) are in flight. The
    survivor ends within seconds, the failure names rank 1 (torchrun's summary, or the
    survivor's own line without it), and `latest` resumes to the losses of a run never killed."""
    out, log = tmp_path / "run", tmp_path / "log.txt"
    flags = [f"--training.steps={STEPS}", "--checkpoint.interval=1"]
    if launcher == "torchrun":
        with open(log, "w") as f:
            procs = [subprocess.Popen(["./run_train.sh", *_train_flags(out, *flags)], cwd=REPO,
                                      env=_train_sh_env(), stdout=f, stderr=subprocess.STDOUT)]
        ranks = []
    else:
        procs = _launch_without_agent(out, log, *flags)
        ranks = [p.pid for p in procs]
    try:
        _wait_for_steps(out, 3, procs, log)
        _wait_for_a_save_in_flight(out / "hf")
        ranks = ranks or sorted(_children(procs[0].pid), key=_rank_of)
        killed_at = time.monotonic()
        os.kill(ranks[1], signal.SIGKILL)
        for p in procs:
            p.wait(timeout=30)
        ended = time.monotonic() - killed_at
        print(f"{launcher}: the run ended {ended:.2f} s after rank 1 was killed")
    finally:
        for p in procs:
            kill_process_tree(p.pid)
    text = log.read_text()
    cut_short = sorted(p.name for p in (out / "hf").glob("step-*.train_state.tmp"))
    print(f"{launcher}: saves cut short by the kill: {cut_short}")
    assert ended < 10, text[-3000:]
    assert not any(_alive(p) for p in ranks)  # so the shared host state is gone too
    if launcher == "torchrun":
        assert "rank      : 1 (local_rank: 1)\n  exitcode  : -9" in text, text[-3000:]
    else:
        assert procs[0].returncode == 1
        assert f"[rank0] error: rank 1 (pid {ranks[1]}) is gone (killed or failed)" in text, \
            text[-3000:]
    latest = latest_checkpoint(str(out / "hf"))
    assert latest is not None
    resumed_at = int(latest.name.split("-")[1])
    assert resumed_at < STEPS

    resumed = _train_sh(tmp_path / "resumed", f"--training.steps={STEPS}",
                        f"--checkpoint.save_dir={out}/hf", "--checkpoint.resume_from=latest")
    assert [r["step"] for r in resumed] == list(range(resumed_at + 1, STEPS + 1))
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in resumed] == [r[key] for r in reference[resumed_at:]], key


def _isolated_env(tmp_path: Path, ngpu: int) -> dict[str, str]:
    """run_train.sh's environment for NGPU=ngpu, with measured rates under tmp_path (the
    compiled kernels stay in the suite's cache, tests/conftest.py)."""
    return subprocess_env(NGPU=str(ngpu), SLIDEDP_RATES_DIR=str(tmp_path / "rates"))


def test_a_folder_in_use_is_one_line_and_exit_code_2_with_two_ranks(tmp_path):
    """The ranks find the lock (after torchrun started them): rank 0's line, and nothing of
    torchrun's."""
    out = tmp_path / "run"
    lock = lock_folder(str(out), key="job.dump_folder")
    try:
        proc = subprocess.run(["./run_train.sh", *_train_flags(out, "--parallelism.mode=fsdp2",
                                                               "--checkpoint.save_dir=")],
                              cwd=REPO, env=_isolated_env(tmp_path, 2), capture_output=True,
                              text=True, timeout=120)
    finally:
        lock.release()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        f"error: job.dump_folder: {out} is in use by another run (pid {os.getpid()}; lock file "
        f"{out}/.lock); wait for it to end, or use another folder"], proc.stderr[-3000:]


def _interrupt(tmp_path: Path, ngpu: int, *flags: str) -> tuple[int, list[str], int]:
    """run_train.sh with NGPU=ngpu, and a Ctrl-C (SIGINT to its process group, as a terminal
    sends it) once it logged a step; returns the exit code, the lines printed since then other
    than rank 0's log, and the steps logged before the Ctrl-C."""
    out, log = tmp_path / "run", tmp_path / "log.txt"
    with open(log, "w") as f:
        # As a terminal starts it: with SIGINT's default action even where this suite runs as a
        # background job of a script (which starts with SIGINT ignored, and so its children).
        proc = subprocess.Popen(["./run_train.sh", *_train_flags(out, "--training.steps=100000",
                                                                 *flags)],
                                cwd=REPO, env=_isolated_env(tmp_path, ngpu), stdout=f, stderr=f,
                                start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        _wait_for_steps(out, 1, [proc], log)
        logged = len((out / "metrics.jsonl").read_text().splitlines())
        before = log.read_text()
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=60)
    finally:
        kill_process_tree(proc.pid)
    since = log.read_text()[before.rfind("\n") + 1:]
    said = [line for line in since.splitlines()
            if not re.match(r"\[rank0\] \d\d:\d\d:\d\d ", line)]
    return code, said, logged


def _steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("ngpu, mode", [(1, "single"), (2, "slidedp")])
def test_ctrl_c_saves_and_says_so_in_one_line(tmp_path, ngpu, mode):
    """Every rank stops after the same step and saves it (its records and its save end there);
    rank 0 says where, exit code 130, and the other rank says nothing."""
    code, said, logged = _interrupt(tmp_path, ngpu, f"--parallelism.mode={mode}")
    out = tmp_path / "run"
    steps = _steps(out)
    stop = steps[-1]
    assert code == 130, said
    assert said == [f"interrupted at step {stop}; last save {out}/hf/step-{stop} (continue with "
                    "--checkpoint.resume_from=latest)"]
    assert steps == list(range(1, stop + 1)) and stop >= logged
    assert latest_checkpoint(str(out / "hf")) == out / "hf" / f"step-{stop}"


def test_ctrl_c_without_a_save_dir_says_there_is_no_save(tmp_path):
    code, said, _ = _interrupt(tmp_path, 1, "--parallelism.mode=single", "--checkpoint.save_dir=")
    assert code == 130, said
    assert said == [f"interrupted at step {_steps(tmp_path / 'run')[-1]}; not saved "
                    "(checkpoint.save_dir is not set)"]
