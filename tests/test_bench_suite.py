"""The benchmark suites' runner (recipes/bench/suite.py) on the CPU, in real processes: a suite
on the debug model writes its rows and the headline table, the peer-peak step relaunches the
sweep's fastest point, a failing correctness stage measures nothing, a launch past its limit is
killed (every descendant too) and the suite goes on, a runner stopped by SIGTERM kills its
launch first, the reproduce scripts' launches end the same way, and every shipped suite file
parses and prints its commands."""

import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from recipes.bench import suite
from recipes.bench.config import BenchConfig, check, mode
from recipes.bench.kill import run_captured, running
from recipes.bench.suite_file import SUITES, SuiteError, load_suite, parse_sets, shipped_suites
from recipes.bench.suite_runner import BENCH, launch_env
from recipes.config import ConfigError, parse_config
from tests.conftest import REPO, subprocess_env

CPU = ("--model.kernels=torch --model.flavor=qwen3-debug --training.seq_len=64 --bench.warmup=0 "
       "--training.steps=1 --slidedp.check_host_memory=false")
"""--extra: any bench launch of a suite on the CPU debug model."""


def _runner(tmp_path: Path, *args: str, correctness: Path | None = None, env=None,
            timeout: float = 240) -> subprocess.CompletedProcess:
    """`python -m recipes.bench.suite OUT ARGS` on one rank, its gate `correctness` (default: a
    check that passes at once; the shipped gate is a pytest run of GPU tests)."""
    if correctness is None:
        correctness = tmp_path / "gate.toml"
        correctness.write_text('[[workload]]\nname = "ok"\ncode = "print(\'1 passed\')"\n')
    cmd = [sys.executable, "-m", "recipes.bench.suite", str(tmp_path / "out"), *args,
           "--ngpu", "1", "--correctness", str(correctness)]
    return subprocess.run(cmd, cwd=REPO, env=env or subprocess_env(), capture_output=True,
                          text=True, timeout=timeout)


def _suite(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


def test_a_sweep_then_its_fastest_point_relaunched_gives_rows_of_every_launch(tmp_path):
    """A peer-peak workload on the debug model: one sweep launch over two batches (launch 1),
    then the fastest of its rows launched once more (launch 2); the rows are valid and the
    headline table gives that point 2 launches."""
    tiny = _suite(tmp_path / "tiny.toml", """
        description = "a sweep and its peak"
        [[workload]]
        name = "sweep"
        flags = ["--parallelism.mode=fsdp2", "--activation_checkpoint.mode=none",
                 "--bench.label=sweep", "--bench.batches", "1", "2"]
        launches = 1
        peak = {launches = 2}
        """)
    proc = _runner(tmp_path, str(tiny), "--extra", CPU)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "out/runs.jsonl").read_text().splitlines()]
    assert all(r["valid"] and r["flavor"] == "qwen3-debug" for r in rows)
    assert [r["launch"] for r in rows] == [1, 1, 2]
    fastest = max(rows[:2], key=lambda r: r["tokens_per_s"])["local_batch"]
    assert rows[2]["local_batch"] == fastest
    assert (f"the fastest point is --activation_checkpoint.mode=none --bench.batches {fastest}"
            in proc.stdout)
    assert "[suite] tiny/sweep peak launch 2: rc 0" in proc.stdout
    table = proc.stdout[proc.stdout.index("| mode | label |"):]
    at_peak = next(line for line in table.splitlines() if f"| none | {fastest} |" in line)
    assert "| 2 |" in at_peak
    assert sorted(p.name for p in (tmp_path / "out/logs").iterdir()) == [
        "001_tiny_sweep_launch_1.log", "002_tiny_sweep_peak_launch_2.log"]


def test_a_failing_correctness_stage_measures_nothing(tmp_path):
    failing = tmp_path / "test_fails.py"
    failing.write_text("def test_fails():\n    assert False\n")
    gate = _suite(tmp_path / "gate.toml", f"""
        [[workload]]
        name = "pytest"
        module = "pytest"
        flags = ["-q", "-p", "no:cacheprovider", "{failing}"]
        limit = 60
        """)
    proc = _runner(tmp_path, "fsdp2_peak_4b", correctness=gate)
    assert proc.returncode == 1
    assert "nothing measured" in proc.stdout and "1 failed" in proc.stdout
    assert "1 failed" in (tmp_path / "out/correctness.log").read_text()
    assert not (tmp_path / "out/runs.jsonl").exists() and not (tmp_path / "out/logs").exists()
    assert "=== fsdp2_peak_4b" not in proc.stdout


def _worker(pids: Path) -> str:
    """A launch's code, as torchrun's workers run: a child in a session of its own, both pids
    written to `pids` once started, then a sleep past any limit."""
    return textwrap.dedent(f"""
        import os, subprocess, time
        c = subprocess.Popen(["sleep", "120"], start_new_session=True)
        open({str(pids)!r}, "w").write(f"{{os.getpid()}} {{c.pid}}")
        print("worker started", flush=True)
        time.sleep(120)
        """)


def _sleeper_suite(tmp_path: Path, *, limit: int, more: str = "") -> tuple[Path, Path, dict]:
    """A suite whose first launch runs _worker under `limit`, then the workloads `more`: the
    worker's pids file, the suite file, and the environment that finds the worker's module."""
    pids = tmp_path / "pids"
    (tmp_path / "sleeper.py").write_text(_worker(pids))
    head = f'[[workload]]\nname = "sleeps"\nmodule = "sleeper"\nlimit = {limit}\n'
    suite = _suite(tmp_path / "slow.toml", head + textwrap.dedent(more))
    return pids, suite, dict(subprocess_env(), PYTHONPATH=os.pathsep.join([str(tmp_path), REPO]))


def test_a_launch_past_its_limit_is_killed_with_its_descendants_and_the_suite_goes_on(tmp_path):
    """The first launch starts a child in a session of its own (as torchrun starts its
    workers), then sleeps past its 1 s limit: both are killed, the runner settles and runs the
    next workloads, and exits 1 for the killed launch. A `largest` workload stops at the first
    batch that runs; the one that failed before it is no failure."""
    pids, slow, env = _sleeper_suite(tmp_path, limit=1, more="""
        [[workload]]
        name = "after"
        code = "print('ran after the kill')"
        show = true
        [[workload]]
        name = "fits"
        code = "import sys; sys.exit(sys.argv[-1] == '32')"
        largest = [32, 28, 24]
        """)
    proc = _runner(tmp_path, str(slow), env=env, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "[suite] slow/sleeps: rc 124" in proc.stdout and "killed at its 1 s limit" in proc.stdout
    assert "settled after" in proc.stdout and "ran after the kill" in proc.stdout
    assert not any(running(int(pid)) for pid in pids.read_text().split())
    assert "fits batch 32: rc 1" in proc.stdout and "fits batch 28: rc 0" in proc.stdout
    assert "batch 24" not in proc.stdout
    assert "4 launches, 1 failed" in proc.stdout


def test_a_runner_stopped_by_sigterm_kills_its_launch_first(tmp_path):
    """An outer timeout sends SIGTERM to the runner while a launch (in a session of its own, with
    a child in another) runs: the runner kills both before it exits 143, so no launch goes on
    writing rows into the next invocation's OUT_DIR."""
    pids, slow, env = _sleeper_suite(tmp_path, limit=100)
    gate = tmp_path / "gate.toml"
    gate.write_text('[[workload]]\nname = "ok"\ncode = "print(\'1 passed\')"\n')
    runner = subprocess.Popen([sys.executable, "-m", "recipes.bench.suite", str(tmp_path / "out"),
                               str(slow), "--ngpu", "1", "--correctness", str(gate)], cwd=REPO,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while not (pids.exists() and len(pids.read_text().split()) == 2):
        assert time.monotonic() < deadline and runner.poll() is None, runner.communicate()[0]
        time.sleep(0.2)
    runner.send_signal(signal.SIGTERM)
    out = runner.communicate(timeout=60)[0]
    assert runner.returncode == 143, out
    assert "[launch] stopped by signal 15" in out
    assert not any(running(int(pid)) for pid in pids.read_text().split())


def test_a_captured_launch_past_its_limit_ends_with_its_tree_and_keeps_its_output(tmp_path):
    """The reproduce scripts' launches (recipes/bench/kill.py run_captured): torchrun starts its
    workers in sessions of their own, which killing torchrun alone would leave on the GPU."""
    pids = tmp_path / "pids"
    rc, output = run_captured([sys.executable, "-c", _worker(pids)], limit=3)
    assert rc == 124 and "worker started" in output
    assert not any(running(int(pid)) for pid in pids.read_text().split())
    assert run_captured([sys.executable, "-c", "print('done')"], limit=30) == (0, "done\n")


def test_a_launch_whose_limit_exceeds_the_time_left_is_skipped_not_started(tmp_path):
    """With 20 s left of the suite's deadline, a launch limited to 30 s would be killed by the
    deadline and counted failed: it is skipped instead, and the suite exits 0; a launch whose
    limit fits still runs."""
    tight = _suite(tmp_path / "tight.toml", """
        seconds = 20
        [[workload]]
        name = "long"
        code = "print('the long launch ran')"
        limit = 30
        show = true
        [[workload]]
        name = "short"
        code = "print('the short launch ran')"
        limit = 5
        show = true
        """)
    proc = _runner(tmp_path, str(tight))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "out of time, skipped: tight/long" in proc.stdout and "its limit 30 s" in proc.stdout
    assert "the long launch ran" not in proc.stdout and "the short launch ran" in proc.stdout
    assert "1 launches, 0 failed, 1 skipped" in proc.stdout


SHIPPED = sorted(p.stem for p in SUITES.glob("*.toml"))


def test_every_shipped_suite_parses_and_prints_its_commands(tmp_path):
    """--dry-run of every suite file, on the largest machine kind: each prints its commands
    (the correctness stage's first) and runs nothing."""
    proc = subprocess.run(
        [sys.executable, "-m", "recipes.bench.suite", str(tmp_path / "out"), *SHIPPED, "--dry-run",
         "--ngpu", "8", "--set", "predicted=predicted.jsonl", "--set", "ds_wheels=/wheels",
         "--extra", CPU],
        cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    sections = out.split("\n=== ")[1:]
    named = {s.split()[0]: s for s in sections}
    assert sections[0].startswith("correctness") and "tests/test_gpu_options.py" in sections[0]
    assert set(SHIPPED) - {"correctness"} <= set(named)
    for name, text in named.items():
        if name != "done":
            assert "python" in text or "skipped" in text, name
    assert "skipped, needs" not in out  # 8 ranks: every launch of every suite is printed
    assert "--bench.launch=3" in named["headline_4b"]
    assert "--nproc_per_node=2" in named["multi_gpu_8b"]
    assert all(f"--bench.batches {b}" in named["strong_scaling_14b"] for b in (32, 64))
    assert named["million_tokens"].count("recipes.bench.throughput") == 1  # the first that fits
    assert "castcopy_x8.json" in named["cast_copy"]
    assert not (tmp_path / "out").exists()


def test_every_bench_launch_of_every_shipped_suite_parses_with_the_benchs_parser(tmp_path,
                                                                                 capsys):
    """Each bench command that --dry-run prints for the shipped suites (8 ranks), read by the
    bench's own parser as at launch (with the CPU's kernels in place of Liger's): every flag is a
    trainer key or a [bench] key with a value it takes, and the settings agree with each other
    and with the model (DeepSpeed's are only parsed where the package is missing)."""
    sets = ["--set", "predicted=predicted.jsonl", "--set", "ds_wheels=/wheels"]
    assert suite.main([str(tmp_path / "out"), *SHIPPED, "--dry-run", "--ngpu", "8", *sets]) == 0
    lines = [line.partition("   # limit")[0] for line in capsys.readouterr().out.splitlines()
             if BENCH in line]
    assert len(lines) > 100
    deepspeed = importlib.util.find_spec("deepspeed") is not None
    modes = set()
    for line in lines:
        cmd = shlex.split(line)
        ranks = [int(a.partition("=")[2]) for a in cmd if a.startswith("--nproc_per_node=")]
        # A peak's relaunch names its point by a placeholder until the sweep has run.
        flags = [*(a for a in cmd[cmd.index(BENCH) + 1:] if not a.startswith("<")),
                 "--model.kernels=torch"]
        try:
            config = parse_config(flags, BenchConfig)
            if config.parallelism.mode != "deepspeed" or deepspeed:
                check(config, world=ranks[0] if ranks else 1)
        except ConfigError as e:
            pytest.fail(f"{line}: {e}")
        assert config.bench.out == str(tmp_path / "out" / "runs.jsonl") or "--bench.out" in line
        modes.add(mode(config))
    assert modes == {"slidedp", "fsdp2", "deepspeed", "reference"}


@pytest.mark.parametrize("text, error", [
    ('[[workload]]\nname = "a"\nflags = "--bench.points ${nowhere}"\n', "${nowhere} is not set"),
    ('[[workload]]\nname = "a"\nlimits = 3\n', "unknown key 'limits'"),
    ('[[workload]]\nflags = "--parallelism.mode=fsdp2"\n', "no name"),
])
def test_a_suite_that_cannot_run_as_written_is_refused_before_anything_runs(tmp_path, text, error):
    bad = _suite(tmp_path / "bad.toml", text)
    with pytest.raises(SuiteError, match=error.replace("$", r"\$").replace("{", r"\{")):
        load_suite(str(bad), {}, {"out": "o", "repo": REPO, "ngpu": 1})


def test_a_launch_runs_with_run_train_shs_allocator_unless_the_caller_sets_one(monkeypatch):
    """The bench launches with run_train.sh's expandable segments (the planner's fit assumes
    them), a caller's own setting wins, and NVLink multicast stays off whatever the caller says."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    env = launch_env(2)
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert env["NCCL_NVLS_ENABLE"] == "0"
    assert env["OMP_NUM_THREADS"] == str(max(1, len(os.sched_getaffinity(0)) // 2))
    assert str(REPO) in env["PYTHONPATH"].split(os.pathsep)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")
    assert launch_env(1)["PYTORCH_CUDA_ALLOC_CONF"] == "backend:cudaMallocAsync"


def test_set_overrides_a_suites_variables_and_its_deadline():
    sets = parse_sets(["weak_scaling_32b.gpus=[8, 4]", "seconds=100", "predicted=p.jsonl"])
    builtins = {"out": "o", "repo": REPO, "ngpu": 8}
    weak = load_suite("weak_scaling_32b", sets, builtins)
    assert weak.workloads[0]["ngpu"] == [8, 4] and weak.seconds == 100
    assert load_suite("cast_copy", sets, builtins).workloads[0]["ngpu"] == [1, 2, 4, 8]
    long = load_suite("long_context", parse_sets(["flavor=qwen3-4B"]), builtins)
    assert "--out o/attention_qwen3-4B_262k.jsonl" in long.workloads[0]["flags"]


def test_the_head_to_heads_suites_take_one_workload_from_a_vars_only_include():
    """slidedp_best, head_to_head and the peers' suites are set against each other, so their
    workload's flags and launch count live once, in suites/vars/h2h.toml: variables and no
    workloads, left out of --list, and overridden by --set as a suite's own variables are."""
    builtins = {"out": "o", "repo": REPO, "ngpu": 1}
    shared = load_suite("vars/h2h", {}, builtins)
    assert shared.workloads == [] and "--model.flavor qwen3-4B" in shared.vars["h2h"]
    for name in ("slidedp_best", "head_to_head", "peers", "peers2", "offload"):
        workloads = load_suite(name, {}, builtins).workloads
        assert workloads and all(w["flags"].startswith(shared.vars["h2h"] + " ")
                                 for w in workloads), name
    # Both sides of a ratio launch each setting as often (rule 6).
    assert all(w["launches"] == shared.vars["launches"] == 3 for name in ("slidedp_best",
               "head_to_head") for w in load_suite(name, {}, builtins).workloads)
    other = load_suite("peers", parse_sets(["h2h=--model.flavor qwen3-1.7B"]), builtins)
    assert other.workloads[0]["flags"].startswith("--model.flavor qwen3-1.7B --parallelism")
    assert not {"vars/h2h", "h2h"} & set(shipped_suites())


def _flag_values(flags: str) -> dict[str, str]:
    """`--key value ...` and `--key=value` flags as {key: "value ..."}."""
    out, key = {}, None
    for token in shlex.split(flags):
        if token.startswith("--"):
            key, _, value = token.partition("=")
            out[key] = value
            key = None if value else key
        elif key is not None:
            out[key] = " ".join(filter(None, (out[key], token)))
    return out


def test_a_launch_labelled_with_a_head_to_head_system_runs_that_systems_flags():
    """The head-to-head finds a system's recorded rows by their label (recipes/reproduce/
    common.py), so a suite launch labelled with a system's name must run that system's setting:
    a label on another setting would set the wrong figure against a peer."""
    from recipes.reproduce.common import SYSTEMS
    builtins = {"out": "o", "repo": REPO, "ngpu": 1}
    sets = parse_sets(["predicted=p", "ds_wheels=w"])
    checked = 0
    for name in shipped_suites():
        for w in load_suite(name, sets, builtins).workloads:
            for variant in w.get("variants") or [""]:  # a variant: its flags, or a table
                own = variant["flags"] if isinstance(variant, dict) else variant
                flags = _flag_values(f"{w.get('flags', '')} {own}")
                system = SYSTEMS.get(flags.get("--bench.label", ""))
                if system is None:
                    continue
                wanted = _flag_values(" ".join(system.flags))
                assert {k: flags.get(k) for k in wanted} == wanted, (name, system.name)
                checked += 1
    assert checked >= 10


def test_an_out_dir_an_earlier_invocation_used_is_refused_before_the_correctness_stage(tmp_path):
    """A second invocation into the same folder would append its launch logs to the first's (the
    numbering restarts) and print the first's correctness lines as its own."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out/correctness.log").write_text("27 failed\n")
    gate = _suite(tmp_path / "gate.toml", f"""
        [[workload]]
        name = "marker"
        code = "open('{tmp_path / 'gate_ran'}', 'w')"
        """)
    proc = _runner(tmp_path, "fsdp2_peak_4b", correctness=gate)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'out'} holds an earlier invocation's correctness.log; give a new OUT_DIR"]
    assert not (tmp_path / "gate_ran").exists() and "=== correctness" not in proc.stdout


def test_a_module_the_launches_import_but_this_python_lacks_is_refused_first(tmp_path):
    """The bench's modules are imported in a child with the launches' environment: with pulp
    hidden from it (as on a GPU machine that lacks it), the invocation ends before its
    correctness stage."""
    hide = tmp_path / "site"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(textwrap.dedent("""
        import sys

        class HidePulp:
            def find_spec(self, name, path=None, target=None):
                if name == "pulp":
                    raise ModuleNotFoundError("No module named 'pulp'")

        sys.meta_path.insert(0, HidePulp())
        """))
    env = subprocess_env()
    env["PYTHONPATH"] += os.pathsep + str(hide)
    proc = _runner(tmp_path, "fsdp2_peak_4b", env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: a launch would fail: ModuleNotFoundError: No module named 'pulp'; install it, or "
        "carry its wheel to the GPU machine"]
    assert "=== correctness" not in proc.stdout and not (tmp_path / "out").exists()
