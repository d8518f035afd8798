"""Long context through the recipe: the [model] RoPE scaling keys over config.json's, the bound
on training.seq_len at start (recipes/preflight.py: one line, exit code 2), and a run past its
model's positions that trains and saves its scaling."""

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from models.hf_checkpoint import save_hf_checkpoint
from models.rope import RopeScaling
from protocols.model_spec import get_flavor
from recipes.config import ConfigError, parse_config, resolve_model
from recipes.model import build_model
from recipes.preflight import check_run
from tests.conftest import REPO, subprocess_env

SHORT = dataclasses.replace(get_flavor("qwen3-debug"), max_position_embeddings=64)
YARN4 = RopeScaling("yarn", 4.0, original_max_position_embeddings=64)


def save_model(tmp_path, rope_scaling: RopeScaling | None) -> str:
    """A qwen3-debug directory of 64 positions with this scaling in its config.json."""
    args = dataclasses.replace(SHORT, rope_scaling=rope_scaling)
    out = tmp_path / ("yarn" if rope_scaling else "plain")
    save_hf_checkpoint(build_model(args, seed=0).named_parameters(), args, out)
    return str(out)


def resolved(*flags: str):
    return resolve_model(parse_config(list(flags)))


def parse_error(*flags: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(list(flags))
    assert "\n" not in str(info.value)
    return str(info.value)


def refused_at_start(tmp_path, *flags: str) -> str:
    """The start-up checks' one line for a configuration that parses."""
    config = parse_config([f"--job.dump_folder={tmp_path}/out", *flags])
    with pytest.raises(ConfigError) as info:
        check_run(config, world=1, device=torch.device("cpu"), thorough=False)
    assert "\n" not in str(info.value) and not (tmp_path / "out").exists()
    return str(info.value)


def test_toml_keys_apply_over_config_json(tmp_path):
    hf_dir = f"--model.hf_dir={save_model(tmp_path, YARN4)}"
    name, args = resolved(hf_dir)
    assert name == "qwen3-debug" and args == dataclasses.replace(SHORT, rope_scaling=YARN4)
    assert args.max_positions() == 256
    # A factor alone changes the model's scaling and keeps the rest of it.
    _, args = resolved(hf_dir, "--model.rope_scaling_factor=8")
    assert args.rope_scaling == dataclasses.replace(YARN4, factor=8.0)
    _, args = resolved(hf_dir, "--model.rope_scaling_type=linear", "--model.rope_scaling_factor=2")
    assert args.rope_scaling == RopeScaling("linear", 2.0) and args.max_positions() == 128
    # "none" turns it off, and then the default seq_len of 128 is past the model's 64 positions.
    message = refused_at_start(tmp_path, hf_dir, "--model.rope_scaling_type=none")
    assert message == ("training.seq_len = 128 exceeds the model's 64 positions "
                       '(max_position_embeddings): set model.rope_scaling_type = "yarn" and '
                       "model.rope_scaling_factor, or lower training.seq_len")
    _, args = resolved(hf_dir, "--model.rope_scaling_type=none", "--training.seq_len=64")
    assert args.rope_scaling is None


def test_a_flavor_gets_yarn_from_toml(tmp_path):
    toml = tmp_path / "long.toml"
    toml.write_text('[model]\nflavor = "qwen3-4B"\nrope_scaling_type = "yarn"\n'
                    "rope_scaling_factor = 8\noriginal_max_position_embeddings = 32768\n"
                    "[training]\nseq_len = 262144\n")
    _, args = resolved(f"--job.config_file={toml}")
    assert args.rope_scaling == RopeScaling("yarn", 8.0, original_max_position_embeddings=32768)
    assert args.max_positions() == 262_144
    message = refused_at_start(tmp_path, f"--job.config_file={toml}",
                               "--model.rope_scaling_factor=4")
    assert message.startswith("training.seq_len = 262144 exceeds the model's 131,072 positions "
                              "(RoPE yarn x4 over 32,768): raise model.rope_scaling_factor")
    # The shipped 262K config says the same.
    shipped = f"{REPO}/train_configs/h200_qwen3_8b_262k_slidedp.toml"
    config = parse_config([f"--job.config_file={shipped}"])
    assert config.training.seq_len == resolve_model(config)[1].max_positions() == 262_144
    # Without original_max_position_embeddings yarn scales max_position_embeddings (40,960).
    _, args = resolved("--model.flavor=qwen3-4B", "--model.rope_scaling_type=yarn",
                       "--model.rope_scaling_factor=4")
    assert args.rope_scaling.original_max_position_embeddings == 40960


@pytest.mark.parametrize("flags, key", [
    (["--model.rope_scaling_factor=0.5"], "model.rope_scaling_factor must be 0"),
    (["--model.rope_scaling_factor=2"], "model.rope_scaling_factor is set but the model has no"),
    (["--model.original_max_position_embeddings=-1"], "model.original_max_position_embeddings"),
    (["--model.rope_scaling_type=dynamic"], '"dynamic" needs model.rope_scaling_factor'),
    (["--model.rope_scaling_type=none", "--model.rope_scaling_factor=2"], '= "none"'),
    (["--model.rope_scaling_type=dynamic", "--model.rope_scaling_factor=2",
      "--model.original_max_position_embeddings=4096"], "dynamic scaling does not take one"),
])
def test_rope_mistakes_are_one_line(flags, key):
    assert key in parse_error(*flags)


def test_a_flavor_takes_its_positions_and_no_more(tmp_path):
    message = refused_at_start(tmp_path, "--training.seq_len=32769")
    assert "exceeds the model's 32,768 positions (max_position_embeddings)" in message
    config = parse_config([f"--job.dump_folder={tmp_path}/out", "--training.seq_len=32768"])
    check_run(config, world=1, device=torch.device("cpu"), thorough=False)  # at the limit: runs


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "recipes.train", *args], cwd=REPO,
                          env=subprocess_env(), capture_output=True, text=True, timeout=300)


def test_seq_len_past_the_positions_exits_2_before_any_work(tmp_path):
    proc = run_cli(f"--model.hf_dir={save_model(tmp_path, None)}", "--training.seq_len=65",
                   f"--job.dump_folder={tmp_path / 'out'}")
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: training.seq_len = 65 exceeds the model's 64 positions")
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert not (tmp_path / "out").exists()


def test_scaled_run_trains_past_the_positions_and_saves_its_scaling(tmp_path):
    proc = run_cli(f"--model.hf_dir={save_model(tmp_path, None)}", "--training.seq_len=128",
                   "--model.rope_scaling_type=yarn", "--model.rope_scaling_factor=2",
                   "--training.steps=2", "--training.local_batch_size=2",
                   f"--job.dump_folder={tmp_path / 'out'}",
                   f"--checkpoint.save_dir={tmp_path / 'hf'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "4 layers, 128 positions (RoPE yarn x2 over 64)" in proc.stderr
    saved = json.loads((tmp_path / "hf" / "step-2" / "config.json").read_text())
    assert saved["rope_scaling"] == {"rope_type": "yarn", "factor": 2.0,
                                     "original_max_position_embeddings": 64}
    assert saved["max_position_embeddings"] == 64
