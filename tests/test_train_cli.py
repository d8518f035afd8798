"""End to end through ./run_train.sh with the debug config: the loss falls, every step is logged,
TensorBoard events and a reloadable Hugging Face checkpoint are written; two FSDP2 ranks on the
same global batch follow the same losses. In every mode the output is the progress lines and the
run's facts only: no Python warnings, no GPU figures on the CPU."""

import json
import math
import os
import re
import subprocess

import pytest
import torch

from models.hf_checkpoint import load_hf_into_model, match_flavor, read_hf_config
from models.loss import chunked_cross_entropy_sum
from protocols.model_spec import spec_of
from recipes.data import PackedDataLoader
from recipes.tokenizer import load_tokenizer
from tests.conftest import REPO, run_torchrun

STEPS = 40
METRIC_KEYS = {"step", "loss", "lr", "grad_norm", "target_tokens", "tokens_per_s",
               "peak_mem_alloc_gib", "peak_mem_reserved_gib", "peak_rss_gib", "step_time_s"}
GPU_FIGURES = {"tflops_per_gpu", "peak_bf16_tflops", "mfu"}


def launch(*flags: str, ngpu: int | str = 1) -> subprocess.CompletedProcess:
    """./run_train.sh FLAGS with the debug config and NGPU=ngpu."""
    env = dict(os.environ, NGPU=str(ngpu), OMP_NUM_THREADS="1")
    # Ranks: run_train.sh splits the cores between them. One process keeps one thread, as
    # subprocess_env gives: the suite's other test file holds the second core, and two threads
    # sharing one core wait on each other at every op.
    if ngpu != 1:
        del env["OMP_NUM_THREADS"]
    return subprocess.run(["./run_train.sh", *flags], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)


def launch_train(out, *flags: str, ngpu: int = 1, steps: int = STEPS) -> str:
    """A successful training run into `out`; returns its stdout and stderr."""
    proc = launch(f"--training.steps={steps}", f"--job.dump_folder={out}",
                  f"--checkpoint.save_dir={out}/hf", "--metrics.log_freq=20", *flags, ngpu=ngpu)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "model qwen3-debug: 205,504 parameters" in proc.stderr
    return proc.stdout + proc.stderr


def read_metrics(out) -> list[dict]:
    with open(out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def run_train(out, *flags: str, ngpu: int = 1, steps: int = STEPS) -> list[dict]:
    """./run_train.sh with the debug config into `out`; returns metrics.jsonl's records."""
    launch_train(out, *flags, ngpu=ngpu, steps=steps)
    return read_metrics(out)


def assert_quiet(output: str) -> None:
    """A normal run prints its facts and progress lines, not warnings or notices."""
    # The one warning a machine may deserve: no C++ compiler for the CPU Adam kernel.
    warnings = [line for line in output.splitlines() if re.search(r"\w+Warning\b", line)
                and "CPU Adam kernel unavailable" not in line]
    assert not warnings, output[-5000:]
    assert "computes in BF16" not in output
    assert "TFLOP" not in output and "mfu" not in output  # the CPU has no GPU figures
    assert re.search(rf"step {STEPS}/{STEPS} 100\.0% \| .* tok/s \| .* \| eta 0s\n", output)


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    output = launch_train(out)
    return out, read_metrics(out), output


def test_debug_config_trains_logs_and_saves(single_run):
    out, records, output = single_run
    assert_quiet(output)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        assert set(r) >= METRIC_KEYS and not set(r) & GPU_FIGURES
        assert r["peak_mem_alloc_gib"] is None  # CPU: no device counters
        assert r["tokens_per_s"] > 0 and r["peak_rss_gib"] > 0
    assert records[0]["loss"] == pytest.approx(math.log(512), abs=0.3)
    assert records[-1]["loss"] < 3.0
    (run,) = os.listdir(out / "tb")  # this run's own folder, <YYYYmmdd-HHMMSS>-single
    assert re.fullmatch(r"\d{8}-\d{6}-single", run)
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(out / "tb" / run))

    hf_dir = out / "hf" / f"step-{STEPS}"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(hf_dir))
    args = read_hf_config(hf_dir)
    assert match_flavor(args) == "qwen3-debug"
    model = spec_of(args).model_cls(args)
    load_hf_into_model(model, hf_dir)
    tokenizer, eos_id = load_tokenizer(hf_dir)
    loader = PackedDataLoader(os.path.join(REPO, "tests/assets/tiny/corpus.jsonl"), tokenizer,
                              eos_id=eos_id, seq_len=128, local_batch_size=8, seed=1)
    input_ids, labels = next(iter(loader))
    with torch.no_grad():
        loss = chunked_cross_entropy_sum(model(input_ids), model.head_weight(), labels)
    # The reloaded (BF16-rounded) model is as good as the end of training.
    assert loss.item() / labels.numel() == pytest.approx(records[-1]["loss"], abs=0.3)


def test_two_ranks_of_the_default_config_follow_the_single_run(single_run, tmp_path):
    """`NGPU=2 ./run_train.sh` of the debug config (mode "single") runs FSDP2, with one notice."""
    _, single, _ = single_run
    # Same global batch: 2 ranks x 4 samples = the debug config's 8.
    output = launch_train(tmp_path, "--training.local_batch_size=4", ngpu=2)
    assert output.count('notice: parallelism.mode = "single" runs one process; 2 ranks run '
                        '"fsdp2"') == 1
    assert "mode fsdp2 on 2 x cpu" in output
    assert_quiet(output)
    records = read_metrics(tmp_path)
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in single], rel=1e-3)
    assert [r["target_tokens"] for r in records] == [r["target_tokens"] for r in single]
    assert (tmp_path / "hf" / f"step-{STEPS}" / "model.safetensors").is_file()


def test_two_slidedp_ranks_train_the_debug_model(single_run, tmp_path):
    """`parallelism.mode = "slidedp"` through the CLI: same data, same loss curve within BF16
    compute noise (the single run computes in FP32), and an HF checkpoint from the host state."""
    _, single, _ = single_run
    output = launch_train(tmp_path, "--parallelism.mode=slidedp", "--training.local_batch_size=4",
                          ngpu=2)
    assert_quiet(output)
    # The start-up line says what SlideDP computes in, whatever training.dtype (fp32 here) says.
    assert "mode slidedp on 2 x cpu, bf16 compute (training.dtype = 'fp32' applies" in output
    records = read_metrics(tmp_path)
    assert [r["target_tokens"] for r in records] == [r["target_tokens"] for r in single]
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in single], rel=3e-2)
    assert records[-1]["traffic_h2d_mb"] > 0 and records[-1]["traffic_reduce_scatter_mb"] > 0
    assert (tmp_path / "hf" / f"step-{STEPS}" / "model.safetensors").is_file()


def assert_one_error_line(proc: subprocess.CompletedProcess, *expected: str) -> None:
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout == "" and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    assert proc.stderr.startswith("error: ")
    for text in expected:
        assert text in proc.stderr


@pytest.mark.parametrize("ngpu", ["0", "two", "-1"])
def test_bad_ngpu(ngpu):
    assert_one_error_line(launch(ngpu=ngpu), "NGPU must be the number of ranks", repr(ngpu))


@pytest.fixture(scope="module")
def malformed_jsonl(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"text": broken\n')
    return path


@pytest.mark.parametrize("ngpu, flag, expected", [
    (1, "--training.dataset_path={bad}", "training.dataset_path: {bad}:2: malformed JSON"),
    (2, "--training.dataset_path={bad}", "training.dataset_path: {bad}:2: malformed JSON"),
    (2, "--training.lr=1", "unknown key training.lr"),
])
def test_bad_input_is_one_line_with_any_ngpu(ngpu, flag, expected, malformed_jsonl, tmp_path):
    """With NGPU >= 2 run_train.sh checks before torchrun starts any rank (recipes.preflight):
    one line, exit code 2, nothing written. (Each class of bad input: tests/test_preflight.py.)"""
    proc = launch(f"--job.dump_folder={tmp_path}/out", f"--checkpoint.save_dir={tmp_path}/hf",
                  flag.format(bad=malformed_jsonl), ngpu=ngpu)
    assert_one_error_line(proc, expected.format(bad=malformed_jsonl))
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_run_refused_after_locking_its_folders_leaves_none_behind(tmp_path):
    """A corpus smaller than one sample is found by the rank once it holds its folders' locks:
    its error last, exit code 2, and the folders it created are gone again."""
    small = tmp_path / "small.jsonl"
    small.write_text('{"text": "hello world"}\n')
    proc = launch(f"--job.dump_folder={tmp_path}/out", f"--checkpoint.save_dir={tmp_path}/hf",
                  "--training.dataset=files", f"--training.dataset_path={small}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "fewer than one sample" in proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "out").exists() and not (tmp_path / "hf").exists()


def test_ranks_that_find_bad_data_print_it_once(malformed_jsonl, tmp_path):
    """Without run_train.sh's check (plain torchrun), the ranks find the bad line while
    tokenizing: rank 0 alone prints it, every rank exits with code 2 before building a model."""
    proc = run_torchrun(["-m", "recipes.train", "--job.config_file=train_configs/debug_cpu.toml",
                         "--parallelism.mode=fsdp2", f"--job.dump_folder={tmp_path}/out",
                         f"--checkpoint.save_dir={tmp_path}/hf",
                         f"--training.dataset_path={malformed_jsonl}"], nproc=2, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    lines = [line for line in output.splitlines() if line.startswith("error: ")]
    assert lines == [f"error: training.dataset_path: {malformed_jsonl}:2: malformed JSON "
                     "(Expecting value)"], output[-3000:]
    assert "exitcode  : 2" in output  # the root cause torchrun reports
    assert "global batch" not in output  # refused before the step was set up
