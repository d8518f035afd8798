"""Config parsing: defaults < TOML < CLI, and one-line errors naming the key for every mistake."""

import os
import re
import subprocess
import sys
from typing import Literal, get_origin, get_type_hints

import pytest

from models.hf_checkpoint import save_hf_checkpoint
from protocols.model_spec import get_flavor
from protocols.bounds import FieldError
from recipes.config import ConfigError, JobConfig, parse_config, resolve_model, run_config
from recipes.job_config import Training
from slidedp.config import SlideDPConfig
from slidedp.run_config import Optimizer, RunConfig, RunModel, RunTraining
from recipes.lr_schedule import LRSchedule
from recipes.model import build_model
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
    ('[activation_checkpoint]\nmode = "op"\n', "activation_checkpoint.mode"),
    ("[deepspeed]\nzero_stage = 1\n", "deepspeed.zero_stage"),
    ("[parallelism]\nfsdp_cpu_offload = 1\n", "parallelism.fsdp_cpu_offload"),
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


@pytest.mark.parametrize("flags, key", [
    (["--training.seq_lenn=5"], "unknown key training.seq_lenn"),
    (["--trainingg.steps=5"], "unknown section [trainingg]"),
    (["--training.steps=many"], "training.steps must be an integer, got 'many'"),
    (["--training.steps=2.5"], "training.steps must be an integer"),
    (["--optimizer.lr=fast"], "optimizer.lr must be a number"),
    (["--parallelism.mode=ddp"], "parallelism.mode must be one of 'single', 'fsdp2', 'deepspeed', 'slidedp'"),
    (["--slidedp.delivery=both"], "slidedp.delivery must be one of"),
    (["--slidedp.reduction=host"], "slidedp.reduction must be one of"),
    (["--slidedp.update_order=fifo"], "slidedp.update_order must be one of"),
    (["--slidedp.activation=offload"], "slidedp.activation: unknown activation policy"),
    (["--slidedp.activation_blocks=0-1:kep"], "slidedp.activation_blocks"),
    (["--lr_scheduler.decay-type=step"], "lr_scheduler.decay_type must be one of"),
    (["--metrics.jsonl=maybe"], "metrics.jsonl must be true or false"),
    (["--metrics.no_jsonl=false"], "metrics.jsonl must be true or false"),
    (["--training.steps"], "training.steps: no value given"),
    (["stray"], "unexpected argument 'stray'"),
    (["--training.grad_accum_steps=0"], "training.grad_accum_steps must be >= 1"),
    (["--slidedp.chunk_mib=1e6"], "slidedp.chunk_mib must be in (0, 1024]"),
    # inf passes every bound (lr > 0): a run at lr inf trains NaN from its first update.
    (["--optimizer.lr=inf"], "optimizer.lr must be finite, got inf"),
    (["--training.max_norm=nan"], "training.max_norm must be finite, got nan"),
    (["--optimizer.weight_decay=1e400"], "optimizer.weight_decay must be finite, got inf"),
    (["--training.dataset_path=/nonexistent"], "training.dataset_path"),
])
def test_cli_mistakes_are_one_line_naming_the_key(flags, key):
    """The same mistakes as in TOML, as flags: one line, not tyro's multi-line box."""
    assert key in parse_error(flags)


def test_cli_spellings():
    config = parse_config(["--training.seq-len=7", "--training.steps", "9", "--metrics.no_jsonl",
                           "--metrics.enable_tensorboard=false", "--slidedp.bf16-shadow=True",
                           "--training.init_on_meta", "--parallelism.mode=fsdp2",
                           "--job.config_file=None"])
    assert (config.training.seq_len, config.training.steps) == (7, 9)
    assert not config.metrics.jsonl and not config.metrics.enable_tensorboard
    assert config.slidedp.bf16_shadow and config.training.init_on_meta
    assert config.job.config_file is None


def test_fields_with_choices_are_literal():
    """tyro checks (and --help lists) the choices of every such field (slidedp.activation is a
    policy's written form, read by slidedp.activations.parse_policy)."""
    for section, key in [("slidedp", "delivery"), ("slidedp", "reduction"),
                         ("slidedp", "update_order"), ("parallelism", "mode"),
                         ("training", "dtype"), ("training", "dataset"),
                         ("lr_scheduler", "decay_type"), ("activation_checkpoint", "mode"),
                         ("deepspeed", "zero_stage")]:
        section_type = get_type_hints(JobConfig)[section]
        assert get_origin(get_type_hints(section_type)[key]) is Literal, f"{section}.{key}"


def test_help_spells_flags_as_the_readme(capsys):
    with pytest.raises(SystemExit) as info:
        parse_config(["--help"])
    assert info.value.code == 0
    help_text = capsys.readouterr().out
    assert "--slidedp.delivery {replicated,sharded}" in help_text
    # The README's flags and those of the reference it points to.
    readme = "".join(open(os.path.join(REPO, doc)).read() for doc in ("README.md", "docs/USAGE.md"))
    flags = {f for f in re.findall(r"--([a-z_]+\.[a-z_]+)", readme)
             if f.split(".")[0] in get_type_hints(JobConfig)}  # not the --section.key pattern
    assert {"model.hf_dir", "checkpoint.save_dir", "parallelism.mode"} <= flags
    for flag in flags:
        assert re.search(rf"--{re.escape(flag)}[ ,]", help_text), flag
    assert "--training.seq-len" not in help_text


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


@pytest.mark.parametrize("flag", ["--parallelism.mode=ddp", "--training.seq_lenn=5"])
def test_entry_point_bad_flag_is_one_line_exit_code_2(flag):
    proc = run_cli(flag)
    assert proc.returncode == 2
    assert proc.stdout == "" and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("error: ")


@pytest.mark.parametrize("source", ["toml", "flag"])
@pytest.mark.parametrize("key, value, said", [
    ("slidedp.window_slots", "1", "slidedp.window_slots must be >= 2, got 1"),
    ("training.dtype", '"fp16"', "training.dtype must be one of 'bf16', 'fp32', got 'fp16'"),
])
def test_entry_point_bound_and_choice_are_one_line_exit_code_2(tmp_path, source, key, value, said):
    """The section's own check refuses a number out of bounds or a bad choice, given in TOML or
    as a flag alike."""
    section, name = key.split(".")
    args = ([f"--{key}={value.strip(chr(34))}"] if source == "flag" else
            ["--job.config_file", write_toml(tmp_path, f"[{section}]\n{name} = {value}\n")])
    proc = run_cli(*args)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: "), proc.stderr
    assert said in proc.stderr


def test_sections_check_themselves_when_built_in_code():
    """Not only parsing: a section built in code is held to its annotations too (ints widened
    for floats)."""
    with pytest.raises(FieldError, match="^steps must be >= 1, got 0$") as info:
        Training(steps=0)
    assert info.value.owner is Training
    with pytest.raises(FieldError, match="^delivery must be one of 'replicated', 'sharded'"):
        SlideDPConfig(delivery="both")
    with pytest.raises(FieldError, match="^lr must be finite"):
        Optimizer(lr=float("inf"))
    assert isinstance(Optimizer(lr=1).lr, float)


def test_run_config_is_what_slidedp_reads_of_the_job():
    config = parse_config(["--parallelism.mode=slidedp", "--activation_checkpoint.mode=full",
                           "--training.seq_len=64", "--training.steps=3",
                           "--training.max_nonfinite_steps=5", "--optimizer.lr=0.5",
                           "--model.kernels=torch", "--slidedp.window_slots=4"])
    run = run_config(config)
    assert (run.mode, run.activation_checkpoint) == ("slidedp", "full")
    assert type(run.model) is RunModel and type(run.training) is RunTraining
    assert run.model == RunModel(kernels="torch")
    # training.steps too (every node must run as many); the guard's count is the recipes' own
    assert run.training == RunTraining(seq_len=64, steps=3)
    assert run.optimizer.lr == 0.5 and run.slidedp.window_slots == 4
    assert run_config(JobConfig()) == RunConfig(mode="single")


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
