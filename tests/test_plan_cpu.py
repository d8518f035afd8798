"""The planner on a CPU machine (`python -m recipes.plan train_configs/debug_cpu.toml`): it
speaks of the device and its host memory, not of a GPU; the probe times blocks in the run's
dtype (FP32 caches apart from BF16 ones) and its compute bound is at most a measured step; a
model too large to time there is refused before anything is measured, naming the shipped rates
files; and a config's [plan] section names the machine it is planned for. The rates cache is a
test folder (SLIDEDP_RATES_DIR), never the user's."""

import json
import re
import statistics
import subprocess
import sys
from dataclasses import replace
from functools import partial

import pytest
import torch

import slidedp.plan.probe as probe_module
from models.kernels import resolve_kernels
from recipes.plan import load_config, load_job, main
from slidedp.plan.predict import policies_of
from slidedp.plan.probe import ProbeSizes, probe
from slidedp.plan.rates import SHIPPED, load_rates
from recipes.preflight import device_memory
from slidedp.plan.memory import estimate_device_memory
from slidedp.plan.report import _gib, plan_text
from tests.conftest import REPO, subprocess_env

DEBUG = "train_configs/debug_cpu.toml"
TINY = ProbeSizes(copy_mib=1, host_elems=100_000, repeats=1)


@pytest.fixture
def rates_dir(tmp_path, monkeypatch):
    """The probe's cache in a test folder."""
    folder = tmp_path / "rates"
    monkeypatch.setenv("SLIDEDP_RATES_DIR", str(folder))
    return folder


@pytest.fixture
def no_measuring(monkeypatch):
    """This process on the CPU, any measurement a failure."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def measured(*args, **kwargs):
        raise AssertionError("the probe measured")

    monkeypatch.setattr(probe_module, "probe_machine", measured)
    monkeypatch.setattr(probe_module, "probe_model", measured)


def cpu_rates():
    """Shipped rates as a CPU machine's."""
    rates = load_rates("h200")
    return replace(rates, machine=replace(rates.machine, name="1 x cpu, 16 cores", device="cpu"))


@pytest.mark.parametrize("mode", ["single", "slidedp"])
def test_a_cpu_plan_speaks_of_the_device_and_host_memory(mode, tmp_path):
    config, job = load_config([f"--job.config_file={DEBUG}", f"--parallelism.mode={mode}",
                               f"--job.dump_folder={tmp_path}"])
    text = "\n".join(plan_text(job, cpu_rates(), world=1,
                               resident_memory=partial(device_memory, config)))
    assert "device memory per rank (the CPU's: host memory): " in text, text
    assert "GPU" not in text and "gpu compute" not in text and "gpu-bound" not in text, text
    if mode == "single":
        assert "(forward + backward, no activation checkpointing)" in text, text
        # The resident mode's own estimate (its FP32 model, gradients and Adam state on the
        # device), not SlideDP's streaming window.
        kw = dict(world=1, kernels="torch")
        own, slidedp = device_memory(config, job.args, **kw), estimate_device_memory(
            job.config, job.args, **kw)
        assert own.total != slidedp.total
        assert f"host memory): {_gib(own.total)} (" in text, text
    else:
        assert "liger" not in text, text  # CUDA's kernels are no advice on the CPU
        assert re.search(r"^  device compute +[\d.]+", text, re.M), text


def test_a_plan_says_when_the_rates_dtype_is_not_the_runs(tmp_path):
    """The shipped rates are BF16's; debug_cpu computes in FP32 (its slidedp mode in BF16)."""
    note = "compute: these rates were timed in bf16, this run computes in fp32"
    flags = [f"--job.config_file={DEBUG}", f"--job.dump_folder={tmp_path}"]
    config, job = load_config(flags)
    single = plan_text(job, load_rates("h200"), world=1,
                       resident_memory=partial(device_memory, config))
    assert any(line.startswith(note) for line in single), single
    slidedp = plan_text(load_job([*flags, "--parallelism.mode=slidedp"]), load_rates("h200"),
                        world=1)
    assert not any(line.startswith("compute: these rates") for line in slidedp), slidedp


def test_the_probe_times_in_the_runs_dtype_and_caches_it_apart(rates_dir, monkeypatch):
    timed = []
    time_block = probe_module._time_block

    def spy(policy, block, *args, **kwargs):
        timed.append(next(block.parameters()).dtype)
        return time_block(policy, block, *args, **kwargs)

    monkeypatch.setattr(probe_module, "_time_block", spy)
    job = load_job(["--model.flavor=qwen3-debug", "--training.seq_len=32",
                    "--training.local_batch_size=2", "--slidedp.autopolicy_candidates=keep"])
    kw = dict(flavor=job.flavor, kernels=resolve_kernels("torch", device_type="cpu"),
              policies=policies_of(job.config, job.args), seq=32, batch=2, loss_chunk=64,
              device=torch.device("cpu"), sizes=TINY, log=lambda _: None)
    fp32 = probe(job.args, compute_dtype="fp32", **kw)
    assert fp32.compute_dtype == "fp32" and fp32.model.endswith("-torch-fp32")
    assert timed and set(timed) == {torch.float32}
    # The device is the CPU: its memory bandwidth is the host's, measured.
    assert fp32.hbm_gbs == fp32.dram_gbs
    timed.clear()
    bf16 = probe(job.args, compute_dtype="bf16", **kw)
    assert bf16.compute_dtype == "bf16" and set(timed) == {torch.bfloat16}
    cached = {p.name.split("--")[1]: json.loads(p.read_text())["compute_dtype"]
              for p in rates_dir.glob("*--*.json")}
    assert cached == {f"{bf16.model}.json": "bf16", f"{fp32.model}.json": "fp32"}


def test_the_probe_times_blocks_at_its_floor_and_again_where_a_cache_holds_fewer(rates_dir,
                                                                                  monkeypatch):
    """At fewer sequences than ProbeSizes.block_min_batch a block's kernels wait on the host's
    launches: the probe times at the floor where it fits, even for a run of one sequence, and a
    timing cached at fewer (an older probe's) is timed again and the cache rewritten; a cache at
    the floor is used as it is."""
    timed = []
    time_block = probe_module._time_block

    def spy(policy, block, *args, batch, **kwargs):
        timed.append(batch)
        return time_block(policy, block, *args, batch=batch, **kwargs)

    monkeypatch.setattr(probe_module, "_time_block", spy)
    job = load_job(["--model.flavor=qwen3-debug", "--training.seq_len=32",
                    "--training.local_batch_size=1", "--slidedp.autopolicy_candidates=keep"])
    kw = dict(flavor=job.flavor, kernels=resolve_kernels("torch", device_type="cpu"),
              policies=policies_of(job.config, job.args), seq=32, batch=1, loss_chunk=64,
              device=torch.device("cpu"), log=lambda _: None)
    one = probe(job.args, sizes=replace(TINY, block_min_batch=1), **kw)
    assert set(timed) == {1} and {t.batch for t in one.blocks.values()} == {1}
    timed.clear()
    two = probe(job.args, sizes=replace(TINY, block_min_batch=2), **kw)
    assert set(timed) == {2} and {t.batch for t in two.blocks.values()} == {2}
    assert set(two.blocks) == set(one.blocks)
    timed.clear()
    again = probe(job.args, sizes=replace(TINY, block_min_batch=2), **kw)
    assert timed == [] and again.blocks == two.blocks


def test_the_compute_bound_is_at_most_a_measured_step(rates_dir, tmp_path, capsys, monkeypatch):
    """debug_cpu's compute alone, probed here in its FP32, against its steps trained here (the
    median after the first few), both on one thread. The step adds the optimizer and the data;
    10% covers two timings on a shared machine, not BF16 blocks timed for an FP32 run (slower on
    CPUs without BF16 matmuls). One thread because a pool of threads on oversubscribed cores
    (the suite runs two workers, CI may run more beside them) waits at every barrier for a
    descheduled peer, and the probe's short timed blocks suffer that far more than a step does.
    Another test worker may load the cores during one timing and not the other, and load only
    slows a timing: so each of up to five tries times the steps and then the probe, one right
    after the other (each probe into a fresh cache), and one try whose pair meets the bound
    passes (three were not enough once, with the two-rank tests beside them for all three)."""
    pairs, threads = [], torch.get_num_threads()
    for attempt in range(5):
        run = tmp_path / f"run{attempt}"
        proc = subprocess.run([sys.executable, "-m", "recipes.train", f"--job.config_file={DEBUG}",
                               "--training.steps=25", f"--job.dump_folder={run}",
                               "--checkpoint.save_dir=", "--metrics.no_enable_tensorboard"],
                              cwd=REPO, env={**subprocess_env(), "OMP_NUM_THREADS": "1"},
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
        measured = statistics.median(r["step_time_s"] for r in rows[5:])
        monkeypatch.setenv("SLIDEDP_RATES_DIR", str(rates_dir / str(attempt)))
        torch.set_num_threads(1)
        try:
            assert main([DEBUG, f"--job.dump_folder={tmp_path}/plan{attempt}"]) == 0
        finally:
            torch.set_num_threads(threads)
        out = capsys.readouterr().out
        bound = float(re.search(r"^compute alone .*?: ([\d.]+) s per step", out, re.M)[1])
        pairs.append((bound, measured))
        if bound <= 1.1 * measured:
            break
    assert any(bound <= 1.1 * measured for bound, measured in pairs), (pairs, out)


def test_a_model_too_large_for_the_cpu_is_refused_before_measuring(rates_dir, no_measuring,
                                                                    tmp_path, capsys):
    assert main([DEBUG, "--model.flavor=qwen3-8B", f"--job.dump_folder={tmp_path}"]) == 2
    out, err = capsys.readouterr()
    assert "[probe]" not in out and not rates_dir.exists()
    assert err.startswith("error: qwen3-8B (") and err.count("\n") == 1, err
    shipped = sorted(p.stem for p in SHIPPED.glob("*.json"))
    assert len(shipped) > 1 and all(name in err for name in shipped), err


def test_the_plan_section_names_the_machine(no_measuring, tmp_path, capsys):
    config = tmp_path / "config.toml"
    config.write_text(open(f"{REPO}/{DEBUG}").read() + '\n[plan]\nrates = "h200x2"\nngpu = 1\n')
    flags = [f"--job.dump_folder={tmp_path}", "--parallelism.mode=slidedp"]
    assert main([str(config), *flags]) == 0
    out = capsys.readouterr().out
    assert "on 2 x NVIDIA H200" in out and " 1 rank(s) x " in out, out
    # The command line overrides it.
    assert main([str(config), *flags, "--rates=h200x4", "--ngpu=3"]) == 0
    out = capsys.readouterr().out
    assert "on 4 x NVIDIA H200" in out and " 3 rank(s) x " in out, out
    # Not more GPUs than the rates' machine has.
    assert main([str(config), *flags, "--rates=h200", "--ngpu=2"]) == 2
    assert capsys.readouterr().err.startswith(
        "error: 2 GPUs, but the rates' machine has 1: 1 x NVIDIA H200")
    assert main([str(config), *flags, "--plan.rates=no-such-machine"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: plan.rates: no rates file 'no-such-machine' (shipped: ")
    assert "h200x2" in err
