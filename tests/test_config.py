"""Config parsing: defaults < TOML < CLI, and one-line errors naming the key for every mistake."""

import os
import subprocess
import sys

import pytest

from models.hf_checkpoint import save_hf_checkpoint
from models.flavors import get_flavor
from recipes.config import ConfigError, JobConfig, parse_config, resolve_model
from recipes.lr_schedule import LRSchedule
from recipes.parallelize import build_model
from tests.conftest import REPO, subprocess_env

TINY = os.path.join(REPO, "tests", "assets", "tiny")


def write_toml(tmp_path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def parse_error(args: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(args)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_defaults_parse():
    assert parse_config([]) == JobConfig()


def test_help_shows_field_docs(capsys):
    with pytest.raises(SystemExit) as info:
        parse_config(["--help"])
    assert info.value.code == 0
    assert "Global gradient-norm clipping threshold" in capsys.readouterr().out


def test_cli_overrides_toml_overrides_defaults(tmp_path):
    path = write_toml(tmp_path, "[training]\nsteps = 5\nseq_len = 64\n[optimizer]\nlr = 1\n"
                                '[slidedp]\ndelivery = "replicated"\n')
    config = parse_config(["--job.config_file", path, "--training.steps=7"])
    assert config.training.steps == 7  # CLI beats TOML
    assert config.training.seq_len == 64  # TOML beats the default
    assert config.training.local_batch_size == JobConfig().training.local_batch_size
    assert config.optimizer.lr == 1.0 and isinstance(config.optimizer.lr, float)  # int -> float
    assert config.slidedp.delivery == "replicated"
    assert config.job.config_file == path


@pytest.mark.parametrize("toml, key", [
    ("[trainingg]\nsteps = 1\n", "[trainingg]"),
    ("[training]\nstep = 1\n", "training.step"),
    ("training = 3\n", "training"),
    ('[training]\nsteps = "5"\n', "training.steps"),
    ("[training]\nsteps = true\n", "training.steps"),  # bool is not an int
    ("[training]\nsteps = 2.5\n", "training.steps"),
    ('[training]\nmax_norm = "1"\n', "training.max_norm"),
    ("[metrics]\njsonl = 1\n", "metrics.jsonl"),
    ("[training]\nsteps = 0\n", "training.steps"),
    ("[optimizer]\nlr = -1e-3\n", "optimizer.lr"),
    ('[parallelism]\nmode = "ddp"\n', "parallelism.mode"),
    ('[training]\ndtype = "fp16"\n', "training.dtype"),
    ('[lr_scheduler]\ndecay_type = "step"\n', "lr_scheduler.decay_type"),
    ('[activation_checkpoint]\nmode = "selective"\n', "activation_checkpoint.mode"),
    ('[slidedp]\ndelivery = "both"\n', "slidedp.delivery"),
    ('[slidedp]\nreduction = "host"\n', "slidedp.reduction"),
    ('[slidedp]\nactivation = "offload"\n', "slidedp.activation"),
    ('[slidedp]\nactivation = "segments(qkvv)"\n', "slidedp.activation"),
    ('[slidedp]\nactivation = "recompute@offload=2"\n', "slidedp.activation"),
    ('[slidedp]\nactivation_blocks = "4:keep"\n', "slidedp.activation_blocks"),  # 4 blocks: 0-3
    ('[slidedp]\nkeep_blocks = 5\n', "slidedp.keep_blocks"),
    ('[model]\nflavor = "qwen3-9B"\n', "model.flavor"),
    ('[model]\ntokenizer_dir = "/nonexistent/tok"\n', "model.tokenizer_dir"),
    ('[model]\nhf_dir = "/nonexistent/model"\n', "model.hf_dir"),
    (f'[training]\ndataset = "files"\ndataset_path = "/nonexistent/x.jsonl"\n'
     f'[model]\ntokenizer_dir = "{TINY}"\n', "training.dataset_path"),
    ('[training]\ndataset = "files"\n', "training.dataset_path"),
    (f'[training]\ndataset_path = "{TINY}/corpus.jsonl"\n', "training.dataset_path"),
    ("[training]\ninit_on_meta = true\n", "training.init_on_meta"),
    ("[training\n", "job.config_file"),
])
def test_toml_mistakes_are_one_line_naming_the_key(tmp_path, toml, key):
    assert key in parse_error(["--job.config_file", write_toml(tmp_path, toml)])


def test_missing_config_file():
    assert "job.config_file" in parse_error(["--job.config_file=/nonexistent/job.toml"])


@pytest.mark.parametrize("flag, key", [
    ("--slidedp.reduction=host", "slidedp.reduction"),  # a plain-str field: checked after tyro
    ("--training.grad_accum_steps=0", "training.grad_accum_steps"),
    ("--training.dataset_path=/nonexistent", "training.dataset_path"),
    ("--slidedp.activation_blocks=0-1:kep", "slidedp.activation_blocks"),
])
def test_cli_mistakes_are_one_line_naming_the_key(flag, key):
    assert key in parse_error([flag])


def test_flavor_is_inferred_from_hf_dir_and_checked(tmp_path):
    args = get_flavor("qwen3-debug")
    save_hf_checkpoint(build_model(args, seed=0).named_parameters(), args, tmp_path / "hf")
    hf_dir = str(tmp_path / "hf")
    assert resolve_model(parse_config([f"--model.hf_dir={hf_dir}"])) == ("qwen3-debug", args)
    parse_config([f"--model.hf_dir={hf_dir}", "--model.flavor=qwen3-debug"])
    message = parse_error([f"--model.hf_dir={hf_dir}", "--model.flavor=qwen2.5-debug"])
    assert "model.flavor" in message and "qwen3-debug" in message


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "recipes.train", *args], cwd=REPO,
                          env=subprocess_env(), capture_output=True, text=True, timeout=300)


def test_entry_point_reports_one_line_and_exit_code_2(tmp_path):
    proc = run_cli("--job.config_file", write_toml(tmp_path, "[training]\nsteps = \"many\"\n"))
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert proc.stderr.startswith("error: ") and "training.steps" in proc.stderr


def test_entry_point_bad_cli_choice_exits_2():
    proc = run_cli("--parallelism.mode=ddp")  # tyro reports it (a boxed message)
    assert proc.returncode == 2
    assert "--parallelism.mode" in proc.stderr + proc.stdout


@pytest.mark.parametrize("decay_type, expected", [
    # lr 1.0, 2 warmup steps, 10 steps, floor 0.1
    ("linear", [0.5, 1.0, 1.0 - 0.9 / 8, 0.55, 0.1]),
    ("cosine", [0.5, 1.0, None, 0.55, 0.1]),
    ("none", [0.5, 1.0, 1.0, 1.0, 1.0]),
])
def test_lr_schedule(decay_type, expected):
    schedule = LRSchedule(lr=1.0, total_steps=10, warmup_steps=2, decay_type=decay_type,
                          min_lr_factor=0.1)
    got = [schedule.lr_at(step) for step in (1, 2, 3, 6, 10)]
    for g, e in zip(got, expected):
        if e is not None:
            assert g == pytest.approx(e)
    assert all(a >= b for a, b in zip(got[1:], got[2:]))  # never rises after warmup
