"""The README's newcomer path, item by item: its sections in order with the internals in docs/,
the Quick start that CI runs and its measured time, the install commands against pyproject's
torch range, every command of its code blocks naming configs, flags, modules and rates that
exist, and the fine-tune recipe run as written (a tiny Hugging Face model and the README's own
JSONL lines in a temporary folder): it trains, writes a Hugging Face checkpoint with the
tokenizer, its TensorBoard folder is where the README points, it resumes, and it plans."""

import importlib.util
import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.specifiers import SpecifierSet
from safetensors.torch import load_file

from models.hf_checkpoint import save_hf_checkpoint
from protocols.model_spec import get_flavor
from recipes.config import ConfigError, parse_config
from recipes.model import build_model
from slidedp.plan.rates import load_rates
from tests.conftest import REPO, subprocess_env

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

README = Path(REPO, "README.md").read_text()
TINY = Path(REPO, "tests", "assets", "tiny")
DEBUG = get_flavor("qwen3-debug")
# The README's placeholders: the downloaded model and the user's data.
MODEL_DIR, DATA = "$HOME/models/Qwen3-0.6B", "my_data.jsonl"
PATH = ["Quick start", "Install", "Train", "Plots", "Fine-tune your model on your data", "Resume",
        "Plan", "More"]
# Only as many steps and tokens as a CPU test needs; the rest is the README's command.
SMALL = ["--training.seq_len=64", "--training.local_batch_size=2",
         "--lr_scheduler.warmup_steps=0", "--metrics.log_freq=1"]


def section(title: str) -> str:
    found = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, re.M | re.S)
    assert found, f"README has no section {title!r}"
    return found[1]


def blocks(text: str, lang: str = "bash") -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.M | re.S)


def commands(block: str) -> list[list[str]]:
    """The block's commands as argv lists: continuations joined, comments dropped, `&&` split."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            out.append(words[:cut])
            words = words[cut + 1:]
    return out


def split_env(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    env = {}
    while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):
        key, value = argv[0].split("=", 1)
        env[key] = value
        argv = argv[1:]
    return env, argv


def substitute(argv: list[str], model_dir: Path, data: Path) -> list[str]:
    return [a.replace(MODEL_DIR, str(model_dir)).replace(DATA, str(data)) for a in argv]


def run(argv: list[str], *extra: str) -> subprocess.CompletedProcess:
    """A README command as the user types it (from the repository root), plus `extra` flags."""
    env, argv = split_env(argv)
    if argv[0] == "python":
        argv = [sys.executable, *argv[1:]]
    return subprocess.run([*argv, *extra], cwd=REPO, env=subprocess_env(**env),
                          capture_output=True, text=True, timeout=600)


# ---------------------------------------------------------------------------------------------
# The document


def test_the_newcomer_path_comes_first_and_the_internals_are_in_docs():
    assert re.findall(r"^## (.+)$", README, re.M) == PATH
    # The layout tree, the runtime's tables and the results tables live in docs/.
    assert not re.search(r"^\|", README, re.M), "a table in the README"
    assert "host_state.py" not in README and "window_slots" not in README
    design = Path(REPO, "docs", "DESIGN.md").read_text()
    usage = Path(REPO, "docs", "USAGE.md").read_text()
    assert "host_state.py    the shared FP32 master" in design
    assert "| `window_slots` |" in usage and "#### " not in usage
    for heading in ["Bad input", "Saves and resume", "Failures", "Data", "Activation policies",
                    "Peer runtimes on the same engine"]:
        assert re.search(rf"^### {heading}$", usage, re.M), heading


def test_links_resolve():
    """Every relative link of the README and docs/*.md names a file that exists, and every
    `#anchor` a heading of its file (GitHub's slugs)."""
    def slugs(text: str) -> set[str]:
        return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                for h in re.findall(r"^#+ (.+)$", text, re.M)}

    for doc in [Path(REPO, "README.md"), *Path(REPO, "docs").glob("*.md")]:
        text = doc.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            assert file.exists(), f"{doc.name}: {target}"
            if anchor:
                assert anchor in slugs(file.read_text()), f"{doc.name}: {target}"


def test_quick_start_is_what_ci_runs_and_states_its_measured_time():
    (block,) = blocks(section("Quick start"))
    ci = Path(REPO, ".ci", "run").read_text().strip().splitlines()[-1]
    assert ci in block
    assert "pip install -q torch==2.13.0 -e '.[test]' && ./run_train.sh " in block
    text = " ".join(section("Quick start").split())
    assert re.search(r"Measured on \d{4}-\d{2}-\d{2} on a 2-core .*shared", text)
    assert re.search(r"`\./run_train\.sh` took [\d.]+–[\d.]+ s of wall time", text)


def test_install_commands_fit_the_supported_torch():
    pyproject = tomllib.loads(Path(REPO, "pyproject.toml").read_text())
    (torch_spec,) = [d[len("torch"):] for d in pyproject["project"]["dependencies"]
                     if re.match(r"torch\W", d)]
    spec = SpecifierSet(torch_spec)
    low = next(s.version for s in spec if s.operator == ">=")
    high = next(s.version for s in spec if s.operator == "<=")
    text = section("Install")
    assert f"torch {low} to {high}" in text
    (block,) = blocks(text)
    installs = commands(block)
    pins = [a.split("==", 1)[1] for argv in installs for a in argv if a.startswith("torch==")]
    assert pins and all(pin in spec for pin in pins)
    urls = [argv[argv.index("--index-url") + 1] for argv in installs if "--index-url" in argv]
    assert any(u.endswith("/whl/cpu") for u in urls)
    assert any(re.search(r"/whl/cu\d+$", u) for u in urls)
    assert ["pip", "install", "-e", ".[test]"] in installs


def test_every_command_names_what_exists(tiny_model, tmp_path):
    """Each command of a bash block: its config file, every flag (parsed as a run parses it),
    the modules it runs, the rates it names, and TensorBoard's folder (the debug run's)."""
    model_dir, data = tiny_model
    kinds = set()
    for argv in (a for b in blocks(README) for a in commands(b)):
        env, argv = split_env(substitute(argv, model_dir, data))
        config = env.get("CONFIG_FILE", "train_configs/debug_cpu.toml")
        assert Path(REPO, config).is_file(), config
        assert int(env.get("NGPU", "1")) >= 1
        if argv[0] in ("pip", "hf"):
            continue  # the install's, checked above; the download, outside this repository
        if argv[0] == "tensorboard":
            kinds.add("tensorboard")
            dump = tomllib.loads(Path(REPO, config).read_text())["job"]["dump_folder"]
            assert os.path.normpath(argv[argv.index("--logdir") + 1]) == \
                os.path.normpath(os.path.join(dump, "tb"))
            continue
        if argv[0] == "./run_train.sh":
            kinds.add("run_train.sh")
            flags = argv[1:]
        else:
            assert argv[:2] == ["python", "-m"], argv
            module, flags = argv[2], argv[3:]
            kinds.add(module)
            assert importlib.util.find_spec(module), module
            if module == "pytest":
                continue
            if module == "recipes.plan":
                config, flags = flags[0], flags[1:]
                assert Path(REPO, config).is_file(), config
                for option in ("--rates", "--ngpu"):
                    if option in flags:
                        value = flags.pop(flags.index(option) + 1)
                        flags.remove(option)
                        load_rates(value) if option == "--rates" else int(value)
        # A resume needs a save to resume (the run tests below have one): the key is checked.
        flags = ["--checkpoint.resume_from=" if f == "--checkpoint.resume_from=latest" else f
                 for f in flags]
        if flags != ["--help"]:
            parse_config([f"--job.config_file={Path(REPO, config)}",
                          f"--job.dump_folder={tmp_path}/out", *flags])
    assert {"run_train.sh", "tensorboard", "recipes.train", "recipes.plan", "pytest"} <= kinds


def test_the_finetune_flags_are_the_ones_that_must_change(tiny_model):
    """The shipped config names no model and no data: without the README's two flags it is one
    line naming what is missing; with them the tokenizer is the model directory's."""
    model_dir, data = tiny_model
    config = ["--job.config_file=train_configs/finetune_hf.toml"]
    with pytest.raises(ConfigError, match="training.dataset_path"):
        parse_config(config)
    with pytest.raises(ConfigError, match="model.hf_dir is empty"):
        parse_config([*config, f"--training.dataset_path={data}"])
    (argv,) = commands(blocks(section("Fine-tune your model on your data"))[-1])
    assert argv[:2] == ["CONFIG_FILE=train_configs/finetune_hf.toml", "./run_train.sh"]
    assert argv[2:] == [f"--model.hf_dir={MODEL_DIR}", f"--training.dataset_path={DATA}"]
    parsed = parse_config([*config, *substitute(argv[2:], model_dir, data)])
    assert parsed.model.hf_dir == str(model_dir) and parsed.model.tokenizer_dir == ""
    assert parsed.training.dataset == "files"


# ---------------------------------------------------------------------------------------------
# The fine-tune recipe, run


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A Hugging Face model directory with its tokenizer (as a download has them) and a JSONL
    file of the README's own example lines."""
    root = tmp_path_factory.mktemp("finetune")
    model_dir = root / "Qwen3-tiny"
    # Not seed 0, the recipe's random init: a run that ignored the weights would show.
    save_hf_checkpoint(build_model(DEBUG, seed=5).named_parameters(), DEBUG, model_dir,
                       copy_tokenizer_from=TINY)
    (example,) = blocks(section("Fine-tune your model on your data"), "json")
    records = [json.loads(line) for line in example.splitlines()]
    assert {"text", "messages"} == {key for r in records for key in r}
    data = root / "my_data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records * 40))
    return model_dir, data


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def finetuned(tiny_model):
    """The README's fine-tune command for 2 steps: its output folder, stdout+stderr and rows."""
    model_dir, data = tiny_model
    out = model_dir.parent / "out"
    (argv,) = commands(blocks(section("Fine-tune your model on your data"))[-1])
    proc = run(substitute(argv, model_dir, data), *SMALL, "--training.steps=2",
               f"--job.dump_folder={out}", f"--checkpoint.save_dir={out}/hf")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out, proc.stdout + proc.stderr, read_metrics(out)


def test_finetune_config_trains_the_downloaded_model_on_the_jsonl(tiny_model, finetuned):
    model_dir, _ = tiny_model
    out, output, records = finetuned
    assert "model qwen3-debug" in output  # the flavor, from the directory's config.json
    assert "data: 80 documents" in output and "mode slidedp on 1 x cpu" in output
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
        assert not r["update_skipped"] and r["lr"] > 0
    saved = out / "hf" / "step-2"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(saved))
    assert (saved / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
    # Fine-tuned from the directory's weights (lr 1e-5, two steps), not from a random init.
    source = load_file(model_dir / "model.safetensors")
    tuned = load_file(saved / "model.safetensors")
    random_init = load_file(_seed0_checkpoint(model_dir.parent) / "model.safetensors")
    assert tuned.keys() == source.keys()
    for name in source:
        assert (tuned[name].float() - source[name].float()).abs().max() < 1e-2, name
    assert any(not torch.equal(tuned[n], random_init[n]) for n in source)
    transformers = pytest.importorskip("transformers")
    transformers.AutoModelForCausalLM.from_pretrained(saved)  # the README's claim


def _seed0_checkpoint(root: Path) -> Path:
    path = root / "seed0"
    if not path.exists():
        save_hf_checkpoint(build_model(DEBUG, seed=0).named_parameters(), DEBUG, path)
    return path


def test_plots_are_where_the_readme_points(finetuned):
    out, output, _ = finetuned
    assert f"tensorboard --logdir {out}/tb" in output
    (run_dir,) = (out / "tb").iterdir()
    assert re.fullmatch(r"\d{8}-\d{6}-slidedp", run_dir.name)
    assert any(p.name.startswith("events.out.tfevents") for p in run_dir.iterdir())
    assert "tensorboard --logdir outputs/debug_cpu/tb" in section("Plots")


def test_resume_continues_the_finetune(tiny_model, finetuned):
    """The README's resume command after the 2-step run, with more steps: it continues the save
    at step 2 and the run's rows."""
    model_dir, data = tiny_model
    out, _, first = finetuned
    argv = commands(blocks(section("Resume"))[0])[0]
    assert argv[-1] == "--checkpoint.resume_from=latest"
    proc = run(substitute(argv, model_dir, data), *SMALL, "--training.steps=4",
               f"--job.dump_folder={out}", f"--checkpoint.save_dir={out}/hf")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert f"resumed from {out}/hf/step-2 at step 2" in proc.stdout + proc.stderr
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[:2] == first
    assert (out / "hf" / "step-4" / "model.safetensors").is_file()


def test_plan_of_the_finetune(tiny_model):
    model_dir, data = tiny_model
    (argv,) = [a for a in commands(blocks(section("Plan"))[0])
               if "train_configs/finetune_hf.toml" in a]
    proc = run(substitute(argv, model_dir, data))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.startswith("plan of qwen3-debug:")
    assert re.search(r"^predicted step: [\d.]+ s", proc.stdout, re.M)
    assert "DOES NOT FIT" not in proc.stdout
